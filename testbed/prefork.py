"""Engine children forked from one process that has imported vLLM once.

Importing vLLM costs about 11 s of CPU on the test machines (over 30 s while they are busy),
and the suite starts about a hundred engine children: that import was most of each engine's
start-up. A *prefork* process imports vLLM, torch and kvshelf's connector once, then only
forks. Every engine still runs in a fresh process of its own (its pid, its log file, its exit
status, the signals tests send it, its own vLLM connector singleton), a copy of an interpreter
that imported modules and ran nothing else; vLLM's multiprocess executor forks its workers
after the same imports.

The parent talks to the prefork process over its stdin and stdout, one JSON document per line:
``{"module", "args", "env", "cwd", "log"}`` asks for a child running ``python -m module args``
with exactly ``env``, answered by ``{"started": pid}``; ``{"exited": pid, "code": c}`` reports a
child's end (``c`` as :attr:`subprocess.Popen.returncode`: negative for a signal).

A child's environment must agree with the prefork process's wherever modules read it at import
(:func:`compatible`); `Prefork.shared` starts a new prefork process when it does not.
``KVSHELF_TESTBED_PREFORK=0`` turns forking off (children are started by :mod:`subprocess`).

Must not import: pytest, and vLLM outside the prefork process itself.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SWITCH = "KVSHELF_TESTBED_PREFORK"
"""Set to 0 to start every engine child by :mod:`subprocess`."""

CLOSE_TIMEOUT_S = 30.0
"""How long the parent waits for the prefork process to end."""

ORPHAN_GRACE_S = 10.0
"""How long children left running when the parent closes get after SIGTERM, before SIGKILL."""

ENGINE_MODULES = (
    "vllm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.cpu_worker",
    "testbed.run_engine",
    "kvshelf.vllm",
)
"""Imported by the prefork process: what every engine child imports before its engine."""

# Read by vLLM, its dependencies or kvshelf when a child builds its engine, not when modules
# are imported: a child may set them to its own values. Every other variable must be equal.
_RUNTIME_PREFIXES = ("VLLM_", "KVSHELF_")
# vLLM configures its loggers when it is imported.
_IMPORT_TIME = ("VLLM_LOGGING_", "VLLM_CONFIGURE_LOGGING")


def enabled() -> bool:
    """Whether engine children are forked (``KVSHELF_TESTBED_PREFORK`` is not 0)."""
    return os.environ.get(SWITCH, "1") != "0"


def compatible(prefork_env: Mapping[str, str], child_env: Mapping[str, str]) -> bool:
    """Whether a child with ``child_env`` can be forked from a prefork process started with
    ``prefork_env``: they differ only in variables read at run time."""
    differing = {
        name
        for name in prefork_env.keys() | child_env.keys()
        if prefork_env.get(name) != child_env.get(name)
    }
    return all(
        name.startswith(_RUNTIME_PREFIXES) and not name.startswith(_IMPORT_TIME)
        for name in differing
    )


class ForkedChild:
    """A child of the prefork process, with the part of :class:`subprocess.Popen`'s interface
    the test bed uses (the parent cannot ``waitpid`` it: the prefork process reports its end).
    """

    def __init__(self, prefork: Prefork, pid: int):
        self._prefork = prefork
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._prefork.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._prefork.wait(self.pid, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            # It may end between the poll and the kill.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Prefork:
    """The parent's side of one prefork process.

    Args:
        env: the prefork process's environment; children differ from it only where
            :func:`compatible` allows.
    """

    _shared: Prefork | None = None
    _shared_lock = threading.Lock()

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "testbed.prefork"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._requests = self._proc.stdin
        self._replies = self._proc.stdout
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._exited: dict[int, int] = {}
        self._started: list[int] = []
        self._alive = True
        ready = self._replies.readline()
        if not ready:
            raise RuntimeError(f"the prefork process exited with {self._proc.wait()}")
        self._reader = threading.Thread(target=self._read, name="kvshelf-prefork", daemon=True)
        self._reader.start()

    @classmethod
    def shared(cls, env: Mapping[str, str]) -> Prefork | None:
        """This process's prefork process for children with ``env``: the running one if
        ``env`` is compatible with it, else a new one (the old one ends when its children
        have). None when forking is off."""
        if not enabled():
            return None
        with cls._shared_lock:
            current = cls._shared
            if current is not None and current.alive() and compatible(current.env, env):
                return current
            if current is not None:
                logger.info("kvshelf test bed: a new prefork process for another environment")
                current.close()
            cls._shared = cls(env)
            atexit.register(cls._shared.close)
            return cls._shared

    def alive(self) -> bool:
        return self._alive and self._proc.poll() is None

    def spawn(
        self, module: str, args: Sequence[str], env: Mapping[str, str], log: Path
    ) -> ForkedChild:
        """Start ``python -m module args`` with ``env``, its stdout and stderr in ``log``."""
        request = {
            "module": module,
            "args": list(args),
            "env": dict(env),
            "cwd": os.getcwd(),
            "log": str(log),
        }
        with self._lock, self._changed:
            start = len(self._started)
            self._requests.write(json.dumps(request) + "\n")
            self._requests.flush()
            while len(self._started) == start:
                if not self._alive:
                    raise RuntimeError("the prefork process ended")
                self._changed.wait(1.0)
            return ForkedChild(self, self._started[start])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exited.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._exited:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {pid}", timeout or 0.0)
                if not self._alive:
                    raise RuntimeError(f"the prefork process ended before child {pid}")
                self._changed.wait(left)
            return self._exited[pid]

    def close(self) -> None:
        """End the prefork process; children still running are stopped."""
        if self._proc.poll() is None:
            self._requests.close()
            try:
                self._proc.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _read(self) -> None:
        for line in self._replies:
            reply = json.loads(line)
            with self._changed:
                if "started" in reply:
                    self._started.append(reply["started"])
                else:
                    self._exited[reply["exited"]] = reply["code"]
                self._changed.notify_all()
        with self._changed:
            self._alive = False
            self._changed.notify_all()


def _import_engine_modules() -> None:
    """What every engine child imports before it builds an engine, then frozen: the garbage
    collector's full passes, which vLLM runs several times while it builds an engine, skip
    these objects in every child (about 1 s less per engine here), and do not write to the
    pages the children share with this process."""
    for name in ENGINE_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def _serve() -> None:
    """The prefork process: import, then fork a child per request until stdin closes (the
    parent ended); children still running then are stopped (SIGTERM, then SIGKILL)."""
    _import_engine_modules()
    replies = sys.stdout
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    requests = sys.stdin
    children: set[int] = set()
    closed_at: float | None = None
    while closed_at is None or children:
        if closed_at is None and select.select([requests], [], [], 0.05)[0]:
            line = requests.readline()
            if line:
                replies.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line))  # never returns
                children.add(pid)
                replies.write(json.dumps({"started": pid}) + "\n")
            else:
                closed_at = time.monotonic()
                _signal(children, signal.SIGTERM)
        elif closed_at is not None:
            time.sleep(0.05)
            if time.monotonic() - closed_at > ORPHAN_GRACE_S:
                _signal(children, signal.SIGKILL)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                replies.write(json.dumps({"exited": pid, "code": code}) + "\n")
        replies.flush()


def _signal(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet
            os.kill(pid, signum)


def _child(request: dict[str, Any]) -> None:
    """Run ``python -m module args`` in this forked process, then exit as that would."""
    # Standard streams of its own: the prefork process's pipes stay with the parent.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # The prefork process's random state would repeat in every child.
    random.seed()
    sys.argv = [request["module"], *request["args"]]
    code: Any = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # The interpreter's teardown runs full garbage-collector passes over every object, vLLM's
    # and torch's modules included: about 2 s of each engine child's 5 here. Frozen, the
    # objects alive now are freed by their reference counts alone; only those in reference
    # cycles are left to the end of the process (Python does not promise to finalize objects
    # alive at exit anyway). The exit functions still run, vLLM's engine shutdown among them.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    _serve()
