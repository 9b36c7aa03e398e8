"""The connector driven exactly as vLLM 0.32's GPU model runners drive it, for every CUDA graph
mode, with the CUDA engine's code on CPU tensors (the arena pinned through a fake CUDA driver)
and a fake device whose work completes later than it is queued
(``FakeCudaStreams(late=True)``): the forward pass's attention reads are
kernels on the compute stream, and the fake device runs them ahead of the copies wherever no
wait holds them back, as a GPU may.

- Model runner V2 (vLLM 0.32's default where Triton is available), ``vllm/v1/worker/gpu``:
  its own ``ActiveKVConnector``; a ``FULL`` step calls ``pre_forward`` outside any forward
  context (``start_load_kv`` runs under ``set_forward_context(None, ...)``) and replays the
  graph without the layer hooks; ``PIECEWISE`` and eager steps call ``pre_forward`` inside the
  step's forward context, and each attention layer goes through vLLM's own hook wrapper.
- Model runner V1: the step's forward context, then the runner's own KV connector context.

Every attention layer must read the loaded bytes; vLLM's thread never waits on the host for the
loads, and their lock is released only after the device finished the copies (by the worker's
settle thread, without another step).
"""

from __future__ import annotations

import socket
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvshelf.plan import LoadJob, StepPlan
from kvshelf.transfer import CudaTransferEngine, engine_override
from kvshelf.transfer.pinned import CudaDriver
from kvshelf.transfer.streams import FakeCudaStreams
from kvshelf.vllm.connector import KVShelfConnector
from kvshelf.vllm.metadata import KVShelfConnectorMetadata
from testbed.cuda_driver import FakeCudaDriver
from testbed.rig import CONNECTOR
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_kv_cache_config, make_vllm_config
from testbed.worker import store_and_lock

pytestmark = pytest.mark.vllm

SOURCES = (1, 2, 3, 5)
MODES = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE)


class Rig:
    """A worker-role connector on CPU KV caches, the CUDA engine's code on a late fake device."""

    def __init__(self, vllm_config: Any, server: ServerProcess, streams: FakeCudaStreams) -> None:
        self.vllm_config = vllm_config
        self.server = server
        self.streams = streams
        kv_cache_config = make_kv_cache_config(self.vllm_config)
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        shape = (kv_cache_config.num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
        generator = torch.Generator().manual_seed(0)
        self.caches = {
            name: torch.randn(shape, generator=generator, dtype=spec.dtype)
            for name in group.layer_names
        }
        self.num_blocks = kv_cache_config.num_blocks
        # vLLM's attention wrapper finds each layer (its KV cache) in the forward context.
        static = self.vllm_config.compilation_config.static_forward_context
        for name, cache in self.caches.items():
            static[name] = types.SimpleNamespace(kv_cache=cache)
        self.connector = KVShelfConnector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        # vLLM's hooks find the connector here (V2's set_disabled(False) sets it too).
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        self.v2 = ActiveKVConnector(self.vllm_config, self.caches)
        self.hashes = 0
        self.stores = 0

    def stored_hit(self, targets: tuple[int, ...]) -> KVShelfConnectorMetadata:
        """Store the sources (new hashes), zero the targets, and plan their load."""
        worker = self.connector._worker
        hashes = tuple(b"hook-%d" % (self.hashes + i) for i in range(len(SOURCES)))
        self.hashes += len(SOURCES)
        hit = store_and_lock(worker, self.server, SOURCES, hashes)
        self.stores += 1
        for cache in self.caches.values():
            cache[list(targets)] = 0
        job = LoadJob("hit", targets, (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)
        return KVShelfConnectorMetadata(StepPlan(loads=(job,)))

    def active_locks(self) -> int:
        with self.server.client() as client:
            return client.stats()["active_locks"]


@pytest.fixture(scope="module")
def rig(tiny_model: Path) -> Iterator[Rig]:
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=30.0) as server:
        extra = {"lmcache.mp.host": server.host, "lmcache.mp.port": server.port}
        config = make_vllm_config(
            tiny_model, kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": extra}
        )
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # A one-process tensor-parallel group: the connector reads its KV rank from it.
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            ensure_model_parallel_initialized(1, 1)
        streams = FakeCudaStreams(late=True)

        def engine(kv_caches, layout, arena):
            driver = CudaDriver(FakeCudaDriver())
            return CudaTransferEngine(kv_caches, layout, arena, streams=streams, driver=driver)

        try:
            with engine_override("cpu", engine):
                made = Rig(config, server, streams)
                try:
                    yield made
                finally:
                    made.connector.shutdown()
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            destroy_model_parallel()
            destroy_distributed_environment()


def _scheduler_output(metadata: KVShelfConnectorMetadata) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.kv_connector_metadata = metadata
    output.has_sync_kv_loads = True  # the scheduler's flag for a step with a sync (kvshelf) load
    return output


def _forward(rig: Rig, targets: tuple[int, ...], *, hooks: bool) -> dict[str, torch.Tensor]:
    """The model's attention layers: each reads its KV cache's target blocks in a kernel on
    the compute stream; with ``hooks``, through vLLM's own connector wrapper (eager and
    piecewise steps), without (a replayed full CUDA graph)."""
    read: dict[str, torch.Tensor] = {}

    def attention(query: Any, layer_name: str) -> None:
        cache = rig.caches[layer_name]
        rig.streams.launch(lambda: read.__setitem__(layer_name, cache[list(targets)].clone()))

    layer = maybe_transfer_kv_layer(attention) if hooks else attention
    for name in rig.caches:
        layer(None, name)
    return read


def _step_v2(rig: Rig, mode: CUDAGraphMode, targets: tuple[int, ...]) -> Any:
    """One step of ``vllm/v1/worker/gpu/model_runner.py`` (V2) with a load, as it calls the
    connector; returns the step's KV connector output."""
    scheduler_output = _scheduler_output(rig.stored_hit(targets))
    input_batch = types.SimpleNamespace(idx_mapping=None, req_ids=["hit"], num_tokens=1)
    attn_metadata = {name: object() for name in rig.caches}
    if mode == CUDAGraphMode.FULL:
        rig.v2.pre_forward(scheduler_output, input_batch, attn_metadata=attn_metadata)
        read = _forward(rig, targets, hooks=False)
    else:
        with set_forward_context(
            attn_metadata, rig.vllm_config, num_tokens=1, cudagraph_runtime_mode=mode
        ):
            rig.v2.pre_forward(scheduler_output, input_batch)
            read = _forward(rig, targets, hooks=True)
    rig.v2.finish_forward()
    return read, rig.v2.post_forward(set())


def _step_v1(rig: Rig, mode: CUDAGraphMode, targets: tuple[int, ...]) -> Any:
    """One step of ``vllm/v1/worker/gpu_model_runner.py`` (V1) with a load."""
    scheduler_output = _scheduler_output(rig.stored_hit(targets))
    attn_metadata = {name: object() for name in rig.caches}
    with (
        set_forward_context(
            attn_metadata, rig.vllm_config, num_tokens=1, cudagraph_runtime_mode=mode
        ),
        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(scheduler_output) as output,
    ):
        read = _forward(rig, targets, hooks=mode != CUDAGraphMode.FULL)
    return read, output


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_every_attention_layer_reads_the_loaded_blocks_and_the_host_never_waits(
    rig: Rig, runner: str, mode: CUDAGraphMode
) -> None:
    targets = tuple(range(rig.num_blocks - len(SOURCES), rig.num_blocks))
    step = _step_v2 if runner == "v2" else _step_v1
    read, output = step(rig, mode, targets)
    # vLLM's thread never blocked on the device (the store thread waited for the test's store).
    assert [thread for thread, _ in rig.streams.host_waits] == ["kvshelf-store"] * rig.stores
    assert output.invalid_block_ids == set()
    # The copies have not run yet, so the pages are still read: the lock is still held.
    assert rig.active_locks() == 1
    rig.streams.run_device()  # the GPU catches up
    for name, cache in rig.caches.items():
        assert torch.equal(read[name], cache[list(SOURCES)]), f"{name} read before its load"
    # The settle thread releases the lock once the copies finished, without another step.
    deadline = time.monotonic() + 10
    while rig.active_locks() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rig.active_locks() == 0
    assert rig.connector.get_block_ids_with_load_errors() == set()
    assert rig.streams.unscoped == []


def test_connector_asks_no_layout_and_no_piecewise_graphs() -> None:
    assert KVShelfConnector.get_required_kvcache_layout(None) is None
    assert KVShelfConnector.requires_piecewise_for_cudagraph({}) is False
