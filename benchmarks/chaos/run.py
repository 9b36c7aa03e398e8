"""One ``make bench-chaos`` run: each mode under chaos, the no-connector references, then
``chaos.json``, the table and ``chaos.png``.

Per mode (`run_mode`): a kvshelf server, engines A and B on it, the sampler, the workloads and
the chaos loop until ``minutes`` are up; then the end readings (leases drained, protected
blocks), one more server kill and restart, the sequential verification pass on engine A, a clean
stop, and the arenas left behind. Then (`run_references`) engines A and B without a connector,
on the same CPUs as a mode's: two concurrent runs of ``baseline_requests`` requests on A while B
runs its own workload beside it, and the sequential pass over every mode's verification
prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.chaos import analysis
from benchmarks.chaos.actions import ChaosLoop, VictimEngine, kill_and_restart_server
from benchmarks.chaos.attacks import AttackRunner
from benchmarks.chaos.config import ChaosConfig
from benchmarks.chaos.freezes import FreezeWatch
from benchmarks.chaos.monitor import Sampler, arena_usage, protected_blocks, wait_drained
from benchmarks.chaos.plots import plot
from benchmarks.chaos.schedule import plan_events
from benchmarks.chaos.shm import SegmentWatch
from benchmarks.chaos.workload import (
    Budget,
    Clock,
    Endpoint,
    Sent,
    run_conversations,
    run_sequential,
)
from benchmarks.e2e.api_server import ApiServer
from benchmarks.e2e.backends import engine_env, kvshelf_connector_config
from benchmarks.e2e.config import E2EConfig, Mode
from benchmarks.e2e.load import openai_server_args
from benchmarks.run_meta import run_meta
from kvshelf.connector_config import REQUEST_TIMEOUT_S
from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR, shm_path
from testbed.models import TINY, build_model
from testbed.redis import RedisServer, have_redis
from testbed.server import ServerProcess

LOG_TAIL_CHARS = 8000
"""Characters of engine A's and the server's logs kept in ``chaos.json``."""
MODEL = TINY
"""The tiny locally built model: the chaos run measures robustness, not speed."""


def _launcher(
    config: ChaosConfig,
    model: str,
    env: dict[str, str],
    kv: dict[str, Any] | None,
    cpus: str,
) -> Callable[[], ApiServer]:
    """A function that builds a not yet started engine with the run's flags, computing on
    ``cpus`` (``VLLM_CPU_OMP_THREADS_BIND``)."""
    args = openai_server_args(
        MODEL,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        gpu_blocks=config.gpu_blocks,
        max_num_seqs=config.workload.users,
        kv_transfer_config=kv,
    )
    args.append("--enable-prompt-tokens-details")
    # A victim restart beside a loaded engine A took 223 s on a busy 2-core machine.
    env = {**env, "VLLM_CPU_OMP_THREADS_BIND": cpus}
    return lambda: ApiServer(sys.executable, model, args, env, startup_timeout_s=900.0)


def _failures(records: list[Sent]) -> list[dict[str, Any]]:
    """The failed requests of both engines, for ``chaos.json``."""
    return [
        {
            "engine": r.engine,
            "start_s": round(r.start_s, 3),
            "latency_s": round(r.latency_s, 4),
            "error": r.error,
        }
        for r in records
        if r.error is not None
    ]


async def _load_phase(
    config: ChaosConfig,
    a: Endpoint,
    b: Endpoint,
    clock: Clock,
    records: list[Sent],
    *,
    deadline_s: float,
    until: Callable[[], bool],
) -> None:
    """Run both engines' workloads until ``deadline_s`` on the clock has passed and ``until``
    says so (a late chaos event, e.g. after a slow victim restart, still happens under load)."""
    pool = list(range(config.pool_users))
    workload = config.workload
    await asyncio.gather(
        run_conversations(
            a,
            "A",
            workload,
            slots=workload.users,
            pool=pool,
            budget=Budget(deadline_s=deadline_s, also_until=until),
            clock=clock,
            records=records,
        ),
        run_conversations(
            b,
            "B",
            workload,
            slots=config.victim_users,
            # The victim's users come back at other times than A's: both engines load and
            # store the same pages, in different orders.
            pool=pool[::-1],
            budget=Budget(deadline_s=deadline_s, also_until=until),
            clock=clock,
            records=records,
        ),
    )


def run_mode(config: ChaosConfig, mode: Mode, model: str, env: dict[str, str]) -> dict[str, Any]:
    """Run one mode under chaos.

    Returns:
        The mode's object of ``chaos.json`` (without the targets and references) and, under
        ``"_a"`` and ``"_verify"``, engine A's records and the verification pass for the caller.
    """
    # A real Redis as the server's shared tier (L3), for the paused-Redis attack; the server
    # keeps it across its restarts (same flags).
    redis = RedisServer() if have_redis() else None
    server = ServerProcess(
        l1_size_gb=config.cache_gib,
        lease_timeout_s=config.lease_timeout_s,
        extra_args=[] if redis is None else ["--l3-redis-url", redis.url],
        env=env,
    )
    pause_redis = None if redis is None else partial(_pause_redis, redis)
    plan = plan_events(
        config.seed,
        config.duration_s,
        min_gap_s=min(config.min_gap_s, config.duration_s / 8),
        warmup_s=min(60.0, config.duration_s / 4),
        stall_seconds=config.stall_seconds,
    )
    records: list[Sent] = []
    with redis if redis is not None else contextlib.nullcontext(), server:
        server.wait_zeroed()
        kv = kvshelf_connector_config(
            mode,
            server.host,
            server.port,
            lazy_threshold=config.lazy_threshold,
            lazy_select_count=config.lazy_select_count,
        )
        # The stall target names the timeout: set it rather than rely on the default.
        kv["kv_connector_extra_config"][REQUEST_TIMEOUT_S] = config.request_timeout_s
        cpus_a, cpus_b = config.engine_cpus
        launch_a = _launcher(config, model, env, kv, cpus_a)
        print(f"[chaos] {mode.name}: starting engines A and B", flush=True)
        # What the mode's engines leave in /dev/shm (the victim sweeps after each of its
        # kills; this sweep, once every engine stopped, catches the rest).
        segments = SegmentWatch()
        segments.mark()
        with launch_a() as engine_a:
            a = Endpoint(engine_a.url, model)
            victim = VictimEngine(_launcher(config, model, env, kv, cpus_b), Endpoint(None, model))
            victim.start()
            try:
                clock = Clock()
                loop = ChaosLoop(plan, server, victim, clock, config.event_settle_s)
                sampler = Sampler(
                    server.host,
                    server.port,
                    lambda: server.pid,
                    clock.now,
                    config.sample_interval_s,
                )
                print(f"[chaos] {mode.name}: {config.minutes} min, plan {plan}", flush=True)
                with sampler, FreezeWatch(clock.now) as freezes:
                    loop.start()
                    asyncio.run(
                        _load_phase(
                            config,
                            a,
                            victim.endpoint,
                            clock,
                            records,
                            deadline_s=config.duration_s,
                            until=loop.finished,
                        )
                    )
                    loop.join()
                    print(f"[chaos] {mode.name}: hostile clients, {config.attack_s} s each")
                    attacks = AttackRunner(
                        server.host, server.port, clock.now, config.attack_s, pause_redis
                    )
                    attacks.start()
                    asyncio.run(
                        _load_phase(
                            config,
                            a,
                            victim.endpoint,
                            clock,
                            records,
                            deadline_s=0.0,
                            until=attacks.finished,
                        )
                    )
                    attacks.join()
                    end = wait_drained(server.host, server.port, config.lease_timeout_s + 15)
                end["protected_blocks"] = protected_blocks(a.url)
                end["protected_blocks_victim"] = protected_blocks(victim.endpoint.url)
            finally:
                victim.stop()
            # The ping target is for an idle machine: the same attacks again, engine A idle
            # and engine B stopped.
            print(f"[chaos] {mode.name}: hostile clients, idle machine", flush=True)
            idle_attacks = AttackRunner(
                server.host, server.port, clock.now, config.attack_s, pause_redis
            )
            idle_attacks.start()
            idle_attacks.join()
            a_records = [r for r in records if r.engine == "A"]
            prompts = analysis.pick_prompts(a_records, config.verify_prompts)
            final_kill = {"kind": "final_server_kill", "at_s": round(clock.now(), 3)}
            final_kill.update(kill_and_restart_server(server))
            # The connector learns of the new server at its next call and reconnects within
            # its retry interval: one throwaway request, then that interval, before the pass.
            asyncio.run(run_sequential(a, "A", [config.workload.system_prompt()], 1, clock))
            time.sleep(config.reconnect_settle_s + 1)
            verify = asyncio.run(run_sequential(a, "A", prompts, config.workload.answer_len, clock))
            # What the connector logged (its periodic KV transfer metrics) explains a bad figure.
            engine_log = engine_a.log_tail(LOG_TAIL_CHARS)
            engine_error = engine_a.first_traceback(LOG_TAIL_CHARS)
    end["arenas_left_after_stop"] = arena_usage(server.port)["shm_arenas"]
    end["arenas_removed_by_harness"] = _remove_arenas(server.port)
    segments.sweep()
    end["vllm_shm_segments_removed"] = victim.segments.removed + segments.removed
    end["vllm_shm_bytes_removed"] = victim.segments.removed_bytes + segments.removed_bytes
    end["vllm_shm_segments_left"] = len(segments.left())
    samples = sampler.samples
    attacks_at_s = attacks.quiet["at_s"]
    b_records = [r for r in records if r.engine == "B"]
    return {
        "mode": mode.name,
        "plan": [dataclasses.asdict(e) for e in plan],
        "events": [*loop.events, final_kill],
        "victim_starts": victim.starts,
        "requests": {
            "sent": len(a_records),
            "failed": len(a_records) - len(analysis.ok(a_records)),
            "victim_sent": len(b_records),
            "victim_failed": len(b_records) - len(analysis.ok(b_records)),
            "errors": sorted({r.error for r in a_records if r.error})[:10],
        },
        "hit_rate": {
            "source": "vLLM usage.prompt_tokens_details.cached_tokens / prompt tokens "
            "(vLLM's prefix cache + kvshelf hits), engine A",
            "overall": analysis.hit_rate(analysis.ok(a_records)),
        },
        "restarts": analysis.restart_windows(
            a_records,
            loop.events,
            before=config.window_before,
            after=config.window_after,
            settle_s=config.reconnect_settle_s,
        ),
        "latency": analysis.latency_summary(a_records),
        "freezes": freezes.spans,
        "freezes_with_page_faults": freezes.faulted,
        "attacks": {
            "quiet": attacks.quiet,
            **analysis.attack_windows(attacks.results, a_records, samples, attacks_at_s),
        },
        "attacks_idle": {"quiet": idle_attacks.quiet, "runs": idle_attacks.results},
        # Flat over the chaos phase; the attacks that follow have their own memory bound.
        "memory": {
            f: analysis.series_growth([s for s in samples if s["t_s"] < attacks_at_s], f)
            for f in ("rss_bytes", "shm_bytes")
        },
        "end": end,
        "samples": samples,
        "logs": {
            "engine_a_tail": engine_log,
            "engine_a_first_traceback": engine_error,
            "server_tail": server.log()[-LOG_TAIL_CHARS:],
        },
        "timeline": analysis.timeline(records, config.timeline_bin_s),
        "failures": _failures(records),
        "_a": a_records,
        "_verify": verify,
    }


def _pause_redis(redis: RedisServer, milliseconds: int) -> None:
    """``CLIENT PAUSE`` every client of ``redis`` (the kvshelf server's L3) for a while."""
    answer = redis.cli("CLIENT", "PAUSE", str(milliseconds), "ALL").strip()
    if answer != "OK":
        raise RuntimeError(f"CLIENT PAUSE answered {answer!r}")


def _remove_arenas(port: int) -> int:
    """Remove the arenas a server on ``port`` left (killed servers' arenas nobody adopted)."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"{ARENA_PREFIX}{port}-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path(name))
                removed += 1
    return removed


def run_references(
    config: ChaosConfig, model: str, env: dict[str, str], prompts: list[list[int]]
) -> dict[str, Any]:
    """The no-connector references: two concurrent runs and one sequential pass.

    Returns:
        ``concurrent`` (two record lists), ``sequential`` (records, in ``prompts`` order),
        ``freezes`` (the machine's during the concurrent runs, on their clock) and
        ``freezes_with_page_faults`` (how many of them the watch took a major fault in).
    """
    print("[chaos] references: engines A and B without a connector", flush=True)
    concurrent = []
    segments = SegmentWatch()
    segments.mark()
    cpus_a, cpus_b = config.engine_cpus
    with (
        _launcher(config, model, env, None, cpus_a)() as engine,
        _launcher(config, model, env, None, cpus_b)() as beside,
    ):
        endpoint = Endpoint(engine.url, model)
        clock = Clock()
        with FreezeWatch(clock.now) as freezes:
            for _ in range(2):
                records: list[Sent] = []
                asyncio.run(
                    _reference_run(config, endpoint, Endpoint(beside.url, model), clock, records)
                )
                concurrent.append([r for r in records if r.engine == "none"])
        sequential = asyncio.run(
            run_sequential(endpoint, "none", prompts, config.workload.answer_len, clock)
        )
    segments.sweep()
    return {
        "concurrent": concurrent,
        "sequential": sequential,
        "freezes": freezes.spans,
        "freezes_with_page_faults": freezes.faulted,
    }


async def _reference_run(
    config: ChaosConfig, a: Endpoint, b: Endpoint, clock: Clock, records: list[Sent]
) -> None:
    """``baseline_requests`` of engine A's workload on ``a`` while ``b`` runs engine B's until
    they are done: the same load as a mode's, so that the latency the stall target forgives is
    the machine's under that load, not one engine's alone."""
    pool = list(range(config.pool_users))
    a_done = False

    async def run_a() -> None:
        nonlocal a_done
        await run_conversations(
            a,
            "none",
            config.workload,
            slots=config.workload.users,
            pool=pool,
            budget=Budget(requests=config.baseline_requests),
            clock=clock,
            records=records,
        )
        a_done = True

    await asyncio.gather(
        run_a(),
        run_conversations(
            b,
            "none-B",
            config.workload,
            slots=config.victim_users,
            pool=pool[::-1],
            budget=Budget(deadline_s=0.0, also_until=lambda: a_done),
            clock=clock,
            records=records,
        ),
    )


def run(config: ChaosConfig, out: Path) -> int:
    """Run the whole benchmark and write ``chaos.json`` and ``chaos.png`` into ``out``.

    Returns:
        The exit status: 0 when every target with a verdict passed, else 1.
    """
    started = time.time()
    model = str(build_model(MODEL))
    folder = Path(tempfile.mkdtemp(prefix="kvshelf-chaos-"))
    e2e = E2EConfig(kv_cache_gib=config.kv_cache_gib)
    env = {**os.environ, **engine_env(e2e, folder)}
    try:
        modes = [run_mode(config, mode, model, env) for mode in config.modes]
        prompts = list({tuple(p.prompt): p.prompt for m in modes for p in m["_verify"]}.values())
        references = run_references(config, model, env, prompts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    sequential = {tuple(r.prompt): r for r in references["sequential"]}
    first, second = references["concurrent"]
    no_connector_worst = analysis.latency_summary(first + second)["worst_s"]
    # What the stall target forgives: the machine's freezes are taken out of both sides.
    slowest = analysis.slowest_unfrozen(first + second, references["freezes"])
    no_connector_unfrozen = None if slowest is None else slowest[1]
    for mode in modes:
        a_records, verify = mode.pop("_a"), mode.pop("_verify")
        mode["verification"] = analysis.sequential_identity(
            verify, [sequential[tuple(r.prompt)] for r in verify]
        )
        mode["latency"]["no_connector_worst_s"] = no_connector_worst
        mode["latency"]["no_connector_worst_unfrozen_s"] = no_connector_unfrozen
        mode["stalls"] = analysis.stall_windows(
            a_records,
            mode["events"],
            mode["freezes"],
            no_connector_worst_s=no_connector_unfrozen,
            request_timeout_s=config.request_timeout_s,
        )
        mode["concurrent_identical"] = {
            "vs_no_connector": analysis.identical_fraction(a_records, first),
            "no_connector_pair": analysis.identical_fraction(second, first),
        }
        mode["targets"] = analysis.evaluate_mode(mode)
    document = {
        "meta": {
            **run_meta("benchmarks.chaos", started),
            "config": _jsonable(dataclasses.asdict(config)),
            "no_connector": {
                "concurrent_requests": [len(first), len(second)],
                "worst_latency_s": no_connector_worst,
                "worst_latency_unfrozen_s": no_connector_unfrozen,
                "slowest": None if slowest is None else analysis.describe(*slowest),
                "freezes": references["freezes"],
                "freezes_with_page_faults": references["freezes_with_page_faults"],
                "sequential_prompts": len(prompts),
            },
        },
        "modes": {mode["mode"]: mode for mode in modes},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(document, indent=1) + "\n")
    plot(document, out / "chaos.png")
    print()
    print(analysis.format_table(document))
    print(
        f"\nwrote {out / 'chaos.json'} and {out / 'chaos.png'}; wall {document['meta']['wall_s']} s"
    )
    failed = any(
        row["verdict"] == "FAIL" for mode in document["modes"].values() for row in mode["targets"]
    )
    return 1 if failed else 0


def _jsonable(value: Any) -> Any:
    """Turn tuples into lists, recursively."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
