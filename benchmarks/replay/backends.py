"""The backends of ``make bench-lazy``: vLLM's scheduler alone, or kvshelf's connector rig.

`run_plain` replays on the scheduler without a connector (mode ``none``); `run_connector`
replays through `testbed.rig.ConnectorRig` with a fresh server of its own, and reads
the connector, worker and server measures once the run is over. The connector is reached
through public names only (``lazy_offloader``, ``take_pending``, the hooks vLLM calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm.v1.request import Request

from benchmarks.replay.loop import Traffic
from benchmarks.replay.measurement import HOOKS, HookTimer, block_refs, step_times
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.lazy.policies.base import PendingStoreItem
from kvshelf.metrics import LAZY
from testbed.rig import ConnectorRig
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_scheduler, step


def run_plain(
    model: Path,
    engine: dict[str, Any],
    replay: Callable[..., Traffic],
    sample: Callable[[Request], int],
) -> tuple[Traffic, dict[str, Any]]:
    """Replay on vLLM's scheduler with no connector.

    Returns:
        The traffic, and the measures (all connector measures 0).
    """
    scheduler = make_scheduler(model, **engine)
    try:
        traffic = replay(scheduler, lambda: step(scheduler, sampled_token=sample))
        refs = block_refs(scheduler)
    finally:
        scheduler.shutdown()
    return traffic, {
        "blocks_stored": 0,
        "hash_mismatch_skips": 0,
        **step_times([]),
        "step_cpu_us_mean": 0.0,
        "hook_us_per_step": dict.fromkeys(HOOKS, 0.0),
        "protected_at_end": 0,
        "tail_unstored": 0,
        "tail_requests": 0,
        "requests_offloaded": 0,
        "blocks_loaded": 0,
        "blocks_load_failed": 0,
        "server_committed": 0,
        "server_evicted": 0,
        "block_refs_at_end": refs,
        "lazy_stats": {},
    }


def run_connector(
    model: Path,
    engine: dict[str, Any],
    replay: Callable[..., Traffic],
    sample: Callable[[Request], int],
    extra: dict[str, Any],
    l1_size_gb: float,
) -> tuple[Traffic, dict[str, Any]]:
    """Replay through `ConnectorRig` with its own fresh server.

    Returns:
        The traffic, and the connector, worker and server measures.
    """
    # A fresh server zeroes its arena in a background thread for seconds after it starts,
    # longer than a short run: it would take a core from the run it is meant to serve.
    with ServerProcess(l1_size_gb=l1_size_gb, extra_args=("--no-prefault",)) as server:
        rig = ConnectorRig(
            model,
            host=server.host,
            port=server.port,
            extra_config=extra,
            flush_stores=False,
            **engine,
        )
        try:
            timer = HookTimer(rig.connector)
            # The lazy offloader the connector built when vLLM bound its block pool; None in
            # eager mode.
            offloader = rig.connector.lazy_offloader
            traffic = replay(rig.scheduler, lambda: rig.step(sample), after_step=timer.end_step)
            # vLLM's engine loop goes idle here (no request and, through the connector's
            # has_pending_push_work, no store work it wants stepped): read what it leaves.
            lazy_stats = (
                offloader.snapshot() if offloader is not None else dict.fromkeys(LAZY.names(), 0)
            )
            refs = block_refs(rig.scheduler)
            tail = _take_pending(offloader, [f.request_id for f in traffic.finished])
            with server.client() as client:
                server_stats = client.stats()
            worker = rig.worker.snapshot()
        finally:
            rig.close()
    return traffic, {
        "blocks_stored": worker["blocks_stored"],
        "hash_mismatch_skips": lazy_stats["requests_skipped_hash_mismatch"],
        **step_times(timer.per_step_ns),
        "step_cpu_us_mean": step_times(timer.per_step_cpu_ns)["step_us_mean"],
        "hook_us_per_step": timer.hook_us_per_step(),
        "protected_at_end": lazy_stats["blocks_protected"],
        "tail_unstored": sum(item.num_blocks for item in tail),
        "tail_requests": len(tail),
        "requests_offloaded": lazy_stats["requests_submitted"],
        "blocks_loaded": worker["blocks_loaded"],
        "blocks_load_failed": worker["blocks_load_failed"],
        "server_committed": server_stats["committed_objects_total"],
        "server_evicted": server_stats["evicted_objects_total"],
        "block_refs_at_end": refs,
        "lazy_stats": lazy_stats if offloader is not None else {},
    }


def _take_pending(
    offloader: LazyOffloader | None, request_ids: Sequence[str]
) -> list[PendingStoreItem]:
    """Take the store work still buffered for ``request_ids`` out of the offloader's policy.

    Only once the run is over: the items leave the policy, as if submitted.

    Args:
        offloader: the connector's lazy offloader, or None in eager mode.
        request_ids: every request of the run.

    Returns:
        The pending items (all requests have finished, so every pending item is returned).
    """
    if offloader is None:
        return []
    return offloader.take_pending(request_ids)
