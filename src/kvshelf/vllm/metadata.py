"""The connector's messages between vLLM's scheduler and its workers."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvshelf.plan import StepPlan


class KVShelfConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: one step's plan."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        plan = self.plan
        return (
            f"KVShelfConnectorMetadata(loads={len(plan.loads)}, stores={len(plan.stores)}, "
            f"delayed_free={len(plan.delayed_free)}, preempted={len(plan.preempted)})"
        )


class KVShelfWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: store jobs finished since the last step, per request.

    vLLM aggregates one of these per worker; the counts add up, so the scheduler sees a job
    done once ``world_size`` workers have reported it.
    """

    def __init__(self, completed_stores: dict[str, int]) -> None:
        self.completed_stores = completed_stores

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVShelfWorkerMetadata)
        merged = dict(self.completed_stores)
        for request_id, count in other.completed_stores.items():
            merged[request_id] = merged.get(request_id, 0) + count
        return KVShelfWorkerMetadata(merged)
