"""The chaos loop: carries out the planned events (`benchmarks.chaos.schedule`) on the real
kvshelf server and the victim engine, and records when each really happened.

A server kill sends SIGKILL and starts the same `ServerProcess` again (same port, same flags);
its arena stays in ``/dev/shm`` for the new server to adopt (or to leak, on a server that cannot
adopt). A stall sends SIGSTOP and, the event's ``stall_s`` later, SIGCONT. An engine kill
SIGKILLs the victim's whole process group, removes the ``/dev/shm`` segments it left
(`benchmarks.chaos.shm`) and starts a new one; its `Endpoint` is None meanwhile, so the
victim's workload waits instead of counting refusals.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.chaos.schedule import ENGINE_KILL, SERVER_KILL, SERVER_STALL, PlannedEvent
from benchmarks.chaos.shm import SegmentWatch
from benchmarks.chaos.workload import Clock, Endpoint
from benchmarks.e2e.api_server import ApiServer
from testbed.server import ServerProcess

KILLED_EXIT_TIMEOUT_S = 120.0
"""How long a SIGKILLed server may take to exit: it cannot refuse, but on the 2-core VM a
process that is not scheduled for seconds (:mod:`benchmarks.chaos.freezes`) once took more
than 10 s to go, which failed the event and left the rest of the mode without a server."""


def kill_and_restart_server(server: ServerProcess) -> dict[str, Any]:
    """SIGKILL the server and start it again on its port with its flags (no arena removal).

    Returns:
        The old and new process ids and boot ids, ``exited_after_s`` (kill to the old
        process's exit) and ``ready_after_s`` (kill to first ping).
    """
    old = {"old_pid": server.pid, "old_boot_id": server.boot_id}
    start = time.monotonic()
    server.send_signal(signal.SIGKILL, timeout_s=KILLED_EXIT_TIMEOUT_S)
    exited_after_s = time.monotonic() - start
    server.start()
    ready_after_s = time.monotonic() - start
    server.wait_zeroed()
    return {
        **old,
        "new_pid": server.pid,
        "new_boot_id": server.boot_id,
        "exited_after_s": round(exited_after_s, 3),
        "ready_after_s": round(ready_after_s, 3),
        "zeroed_after_s": round(time.monotonic() - start, 3),
    }


class VictimEngine:
    """Engine B: an `ApiServer` that the chaos loop kills and replaces.

    Args:
        launch: Builds a new, not yet started `ApiServer` with the engine's flags.
        endpoint: The endpoint the victim's workload sends to; kept current here.
    """

    def __init__(self, launch: Callable[[], ApiServer], endpoint: Endpoint) -> None:
        self._launch = launch
        self.endpoint = endpoint
        self.server: ApiServer | None = None
        self.starts = 0
        # The vLLM segments in /dev/shm a killed engine leaves: those new since its start.
        self.segments = SegmentWatch()

    def start(self) -> None:
        """Start a new engine and point the endpoint at it."""
        self.segments.mark()
        self.server = self._launch().__enter__()
        self.starts += 1
        self.endpoint.url = self.server.url

    def kill_and_restart(self) -> dict[str, Any]:
        """SIGKILL the engine's process group, remove the segments it left, then start a new
        engine.

        Returns:
            ``restart_s``: seconds from the kill until the new engine is healthy;
            ``shm_segments_removed``: the killed engine's segments removed.
        """
        assert self.server is not None
        start = time.monotonic()
        self.endpoint.url = None
        self.server.kill()
        self.server.__exit__(None, None, None)
        removed = self.segments.sweep()
        self.start()
        return {"restart_s": round(time.monotonic() - start, 3), "shm_segments_removed": removed}

    def stop(self) -> None:
        """Stop the current engine (SIGTERM)."""
        if self.server is not None:
            self.endpoint.url = None
            self.server.__exit__(None, None, None)
            self.server = None


class ChaosLoop:
    """A thread that carries out ``plan`` on the run's clock.

    An event starts at its planned time, or ``settle_s`` after the one before it finished when
    that took longer (a victim restart can take minutes on a busy machine), so that the
    requests in flight around one event do not meet the next. An event that fails
    (e.g. a victim that does not come up) is recorded with its ``error`` and the loop goes on.

    Args:
        plan: The events.
        server: The kvshelf server.
        victim: Engine B.
        clock: The run's clock (the plan's times are on it).
        settle_s: Least time from the end of one event to the start of the next.
    """

    def __init__(
        self,
        plan: list[PlannedEvent],
        server: ServerProcess,
        victim: VictimEngine,
        clock: Clock,
        settle_s: float,
    ) -> None:
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._plan = plan
        self._server = server
        self._victim = victim
        self.clock = clock
        self._settle_s = settle_s
        self._thread = threading.Thread(target=self._run, name="chaos-loop", daemon=True)

    def execute(self, event: PlannedEvent) -> dict[str, Any]:
        """Carry out one event now (its planned time is not looked at).

        Returns:
            Its record: ``kind``, ``at_s``, ``done_s`` and what the action reported.
        """
        at_s = self.clock.now()
        kind = event.kind
        if kind == SERVER_KILL:
            details = kill_and_restart_server(self._server)
        elif kind == SERVER_STALL:
            assert event.stall_s is not None, "a stall has a length"
            os.kill(self._server.pid, signal.SIGSTOP)
            try:
                time.sleep(event.stall_s)
            finally:
                os.kill(self._server.pid, signal.SIGCONT)
            details = {"stall_s": event.stall_s}
        elif kind == ENGINE_KILL:
            details = self._victim.kill_and_restart()
        else:
            raise ValueError(f"unknown chaos event {kind!r}")
        record = {"kind": kind, "at_s": round(at_s, 3), "done_s": round(self.clock.now(), 3)}
        return {**record, **details}

    def _run(self) -> None:
        try:
            not_before = 0.0
            for event in self._plan:
                time.sleep(max(0.0, event.at_s - self.clock.now(), not_before - self.clock.now()))
                at_s = self.clock.now()
                try:
                    record = self.execute(event)
                except Exception as exc:  # recorded: e.g. a victim that did not start
                    record = {
                        "kind": event.kind,
                        "at_s": round(at_s, 3),
                        "error": repr(exc)[-2000:],
                    }
                    record["done_s"] = round(self.clock.now(), 3)
                self.events.append({"planned_s": round(event.at_s, 3), **record})
                print(f"[chaos] {record}", flush=True)
                not_before = self.clock.now() + self._settle_s
        except BaseException as exc:  # reported by join()
            self.error = exc

    def start(self) -> None:
        """Start carrying out the plan."""
        self._thread.start()

    def finished(self) -> bool:
        """True once the last event is done (or the loop failed)."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the last event; re-raise what stopped the loop, if anything did."""
        self._thread.join()
        if self.error is not None:
            raise RuntimeError("the chaos loop failed") from self.error
