"""The prefork process (``testbed.prefork``): each child a process of its own, with its
environment, its output, its exit status and the signals sent to it; environments that differ
where modules read them at import get a prefork process of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testbed.prefork import Prefork, compatible
from testbed.run_engine import DEFAULT_ENV

pytestmark = [pytest.mark.vllm]


def test_only_run_time_variables_may_differ() -> None:
    base = {"HF_HUB_OFFLINE": "1", "TMPDIR": "/tmp/a", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert compatible(base, dict(base))
    assert compatible(base, {**base, "VLLM_CPU_KVCACHE_SPACE": "4", "KVSHELF_X": "1"})
    assert compatible(base, {k: v for k, v in base.items() if k != "VLLM_CPU_KVCACHE_SPACE"})
    # Read when modules are imported: vLLM's logging, Hugging Face's constants, tempfile's
    # folder, OpenMP's thread count.
    assert not compatible(base, {**base, "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert not compatible(base, {**base, "VLLM_CONFIGURE_LOGGING": "0"})
    assert not compatible(base, {**base, "HF_HUB_OFFLINE": "0"})
    assert not compatible(base, {**base, "TMPDIR": "/tmp/b"})
    assert not compatible(base, {**base, "OMP_NUM_THREADS": "1"})


def timeit(statement: str) -> list[str]:
    """Arguments of ``python -m timeit`` that run ``statement`` once."""
    return ["-n", "1", "-r", "1", statement]


def test_children_have_their_environment_output_status_and_signals(
    vllm_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**DEFAULT_ENV, **os.environ}
    prefork = Prefork.shared(env)
    if prefork is None:
        pytest.skip("KVSHELF_TESTBED_PREFORK=0")
    log = tmp_path / "child.log"
    child = prefork.spawn(
        "timeit",
        timeit("import os, sys; print(os.getpid(), os.environ['VLLM_TEST_X'], flush=True)"),
        {**env, "VLLM_TEST_X": "seen"},
        log,
    )
    assert child.wait(timeout=60) == 0
    pid, value = log.read_text().split()[:2]
    assert (int(pid), value) == (child.pid, "seen")
    assert child.pid != os.getpid()

    # The exit functions run, vLLM's engine shutdown among them, and a thread that is no
    # daemon is waited for, as at any Python exit.
    ending = prefork.spawn(
        "timeit",
        timeit(
            "import atexit, threading, time; atexit.register(print, 'exit functions ran');"
            " threading.Thread(target=lambda: (time.sleep(0.5), print('thread ended'))).start()"
        ),
        env,
        tmp_path / "3.log",
    )
    assert ending.wait(timeout=60) == 0
    assert (tmp_path / "3.log").read_text().splitlines()[-2:] == [
        "thread ended",
        "exit functions ran",
    ]

    # argparse's exit status, and an exception no code catches.
    failing = prefork.spawn("json.tool", ["--no-such-flag"], env, tmp_path / "2.log")
    assert failing.wait(timeout=60) == 2
    missing = str(tmp_path / "missing.json")
    raising = prefork.spawn("testbed.run_engine", [missing], env, tmp_path / "1.log")
    assert raising.wait(timeout=60) == 1
    assert "FileNotFoundError" in (tmp_path / "1.log").read_text()

    sleeping = prefork.spawn("timeit", timeit("import time; time.sleep(60)"), env, log)
    assert sleeping.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(timeout=0.2)
    sleeping.send_signal(signal.SIGKILL)
    assert sleeping.wait(timeout=10) == -signal.SIGKILL
    # A signal to an ended child is no error.
    sleeping.kill()

    # Another value of a variable read at import: another prefork process.
    other = Prefork.shared({**env, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert other is not None and other is not prefork
    started = time.monotonic()
    assert other.spawn("timeit", timeit("pass"), other.env, log).wait(timeout=60) == 0
    assert time.monotonic() - started < 60
    other.close()
    assert not prefork.alive()
