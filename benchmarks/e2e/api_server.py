"""vLLM's OpenAI-compatible server in a child process, and its Prometheus counters.

`ApiServer` starts ``python -m vllm.entrypoints.openai.api_server`` under any interpreter
(kvshelf's venv or the LMCache peer venv); `read_counters` reads the `COUNTERS` the multi-round
QA workload (`benchmarks.e2e.multiround`) reports. Imports httpx, not vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from testbed.server import free_port

COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "local_hit_tokens": "vllm:prefix_cache_hits",
    "external_hit_tokens": "vllm:external_prefix_cache_hits",
}
"""Server counters read from ``/metrics`` before and after the workload (result key: name)."""


class ApiServer:
    """vLLM's OpenAI-compatible server in a child process (its own process group).

    Use as a context manager: entering starts it and waits for ``/health``; leaving sends
    SIGTERM to its process group (the server and the engine processes it spawned), then
    SIGKILL if needed.

    Args:
        python: Interpreter that runs vLLM.
        model: Local model folder.
        args: More server flags (``--block-size``, ``--kv-transfer-config``, ...).
        env: Environment of the child.
        startup_timeout_s: How long to wait for ``/health``.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        python: str,
        model: str,
        args: Sequence[str],
        env: Mapping[str, str],
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.port = free_port(self.host)
        self.command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *args,
        ]
        self.url = f"http://{self.host}:{self.port}"
        self._env = dict(env)
        self._startup_timeout_s = startup_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-api-", suffix=".log")  # noqa: SIM115
        self._proc: subprocess.Popen[bytes] | None = None

    def log_tail(self, chars: int = 6000) -> str:
        """Return the last ``chars`` characters of the server's output."""
        return self._log_text()[-chars:]

    def first_traceback(self, chars: int = 6000) -> str:
        """Return ``chars`` characters of the server's output from its first traceback ("" if
        none): the root cause of a failure the tail only shows the end of."""
        text = self._log_text()
        start = text.find("Traceback (most recent call last)")
        return "" if start < 0 else text[start : start + chars]

    def _log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def __enter__(self) -> ApiServer:
        self._proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self._startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"vLLM API server exited at startup:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    tail = self.log_tail()  # before __exit__ closes (and removes) the log
                    self.__exit__()
                    raise RuntimeError(f"vLLM API server not healthy:\n{tail}")
                time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL the process group (the server and its engine processes) at once, as an OOM
        kill would, and wait for the server's exit; leaving the context still closes the log."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def __exit__(self, *exc_info: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()


def read_counters(url: str) -> dict[str, float]:
    """Read `COUNTERS` from the server's Prometheus endpoint.

    Args:
        url: The server's base URL.

    Returns:
        Each counter (result key of `COUNTERS`), summed over label sets; 0 when absent.
    """
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in COUNTERS.items():
            if name in (metric, f"{metric}_total"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values
