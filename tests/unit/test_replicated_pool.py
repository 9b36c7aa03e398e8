"""A pool of replicated KV (``PageLayout.replicas``): one stored rank per group of replicas,
written by any of them and read (and locked, and released) by each; sharded pools are named
and encoded exactly as before the field existed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from kvshelf.plan import StoreJob
from kvshelf.protocol import (
    ErrorCode,
    PageLayout,
    ProtocolError,
    Register,
    decode_request,
    encode,
    pool_name,
)
from kvshelf.roles.replication import kv_replicas, own_share
from kvshelf.server.index import CacheIndex, RequestRejected
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.disk_format import read_layout, write_layout
from kvshelf.server.tiers.shared_memory import ExtentAllocator

PAGE = 1024


def make_index(num_pages: int = 16) -> CacheIndex:
    arena = ArenaTier(
        ExtentAllocator(num_pages * PAGE), eviction_watermark=1.0, extent_bytes=4 * PAGE
    )
    return CacheIndex([arena], lease_timeout_s=10.0)


def layout(world_size: int, replicas: int = 1, rank: int = 0) -> PageLayout:
    return PageLayout(
        model_fingerprint="m",
        layout_fingerprint="l",
        page_bytes=PAGE,
        world_size=world_size,
        rank=rank,
        replicas=replicas,
    )


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


class _LayoutBefore(msgspec.Struct, kw_only=True):
    """PageLayout as it was before ``replicas``: what older peers and page tables hold."""

    model_fingerprint: str
    layout_fingerprint: str
    page_bytes: int
    world_size: int
    rank: int


def test_sharded_layouts_keep_their_pool_names_and_bytes() -> None:
    legacy_name = "pool-" + hashlib.sha256(msgspec.msgpack.encode(["m", "l", 2])).hexdigest()[:32]
    assert pool_name("m", "l", 2) == legacy_name == layout(2).pool
    before = _LayoutBefore(
        model_fingerprint="m", layout_fingerprint="l", page_bytes=PAGE, world_size=2, rank=1
    )
    assert msgspec.msgpack.encode(layout(2, rank=1)) == msgspec.msgpack.encode(before)
    # Replicated KV of the same world size is a pool of its own.
    assert layout(2, replicas=2).pool != legacy_name
    frame = encode(Register(request_id=1, layout=layout(4, replicas=2, rank=3)))
    decoded = decode_request(frame)
    assert isinstance(decoded, Register) and decoded.layout.replicas == 2


def test_replicas_must_divide_the_world_size() -> None:
    with pytest.raises(ValueError, match="replicas 3 does not divide world_size 4"):
        layout(4, replicas=3)
    frame = encode(Register(request_id=7, layout=layout(4)))
    bad = msgspec.msgpack.encode(
        {
            "type": 3,
            "request_id": 7,
            "version": 2,
            "layout": {**msgspec.structs.asdict(layout(4)), "replicas": 3},
        }
    )
    assert decode_request(frame).layout.replicas == 1
    with pytest.raises(ProtocolError) as info:
        decode_request(bad)
    assert info.value.code is ErrorCode.MALFORMED and "replicas 3" in info.value.message


def test_a_replicated_pool_stores_once_and_every_replica_reads_and_releases() -> None:
    index = make_index()
    pool = index.register(layout(2, replicas=2))
    assert (pool.world_size, pool.replicas, pool.readers) == (1, 2, 2)
    # Either replica writes the one stored rank; the other's reserve of the same keys skips.
    reservation_id, pages = index.reserve(pool.name, 1, keys(1, 2), now=0.0)
    assert None not in pages
    index.commit(reservation_id)
    _, skipped = index.reserve(pool.name, 0, keys(1, 2), now=0.0)
    assert skipped == [None, None]
    assert index.stats()["committed_objects_total"] == 2

    hits, lock_id, lock_pages = index.lookup(pool.name, keys(1, 2, 3), 2, lock=True, now=0.0)
    assert hits == 2 and lock_pages[0] == lock_pages[1] == pages
    # A rank that wrote nothing releases its share like the writer; the pages stay pinned
    # until both did.
    index.release(lock_id, 0, copied=2)
    assert index.stats()["active_locks"] == 1
    index.check_invariants()
    index.release(lock_id, 1, copied=2)
    assert index.stats()["active_locks"] == 0
    assert index.stats()["loaded_objects_total"] == 4
    with pytest.raises(RequestRejected) as info:
        index.release(lock_id, 1)
    assert info.value.code is ErrorCode.UNKNOWN_LOCK
    index.check_invariants()

    with pytest.raises(RequestRejected) as info:
        index.lookup(pool.name, keys(1), 1, lock=False, now=0.0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(RequestRejected) as info:
        index.reserve(pool.name, 2, keys(4), now=0.0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


def test_pipeline_stages_of_replicated_kv_are_stored_ranks() -> None:
    """TP=2 x PP=2 with MLA: ranks 0, 1 hold stage 0's latent, ranks 2, 3 stage 1's."""
    index = make_index()
    pool = index.register(layout(4, replicas=2))
    assert pool.world_size == 2
    for rank in (1, 2):
        reservation_id, _ = index.reserve(pool.name, rank, keys(1), now=0.0)
        index.commit(reservation_id)
    hits, lock_id, pages = index.lookup(pool.name, keys(1), 4, lock=True, now=0.0)
    assert hits == 1 and pages[0] == pages[1] != pages[2] == pages[3]
    index.unlock(lock_id)
    index.check_invariants()


def test_the_disk_tier_keeps_a_pools_replicas(tmp_path: Path) -> None:
    write_layout(str(tmp_path / "replicated"), layout(2, replicas=2))
    write_layout(str(tmp_path / "sharded"), layout(2))
    assert read_layout(str(tmp_path / "replicated")) == layout(2, replicas=2)
    assert read_layout(str(tmp_path / "sharded")) == layout(2)
    assert "replicas" not in (tmp_path / "sharded" / "layout.json").read_text()


class MLAAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name (kvshelf reads specs by class name)."""


class FullAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name."""


class MambaSpec(SimpleNamespace):
    """Stands in for vLLM's spec of that name."""


def configs(
    specs: list[SimpleNamespace],
    *,
    tp: int,
    total_heads: int = 1,
    declared: int | None = 1,
    dcp: int = 1,
) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A ``VllmConfig`` and ``KVCacheConfig`` stand-in with what ``kv_replicas`` reads."""
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=1,
        ),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: total_heads),
    )
    groups = [SimpleNamespace(kv_cache_spec=spec) for spec in specs]
    kv_cache_config = SimpleNamespace(kv_cache_groups=groups)
    if declared is not None:
        kv_cache_config.kv_tp_replicas = declared
    return vllm_config, kv_cache_config


@pytest.mark.parametrize(
    ("specs", "kwargs", "replicas"),
    [
        ([MLAAttentionSpec(num_kv_heads=1)], {"tp": 4, "declared": 4}, 4),
        # A vLLM without kv_tp_replicas: MLA alone is replicated on every rank.
        ([MLAAttentionSpec(num_kv_heads=1)], {"tp": 2, "declared": None}, 2),
        # vLLM does not declare KV heads it replicates: 2 heads on 8 ranks, 4 ranks each.
        ([FullAttentionSpec(num_kv_heads=1)], {"tp": 8, "total_heads": 2}, 4),
        ([FullAttentionSpec(num_kv_heads=1)], {"tp": 2, "total_heads": 2}, 1),
        ([FullAttentionSpec(num_kv_heads=2)], {"tp": 2, "total_heads": 4}, 1),
        ([FullAttentionSpec(num_kv_heads=1)], {"tp": 1, "total_heads": 1}, 1),
        # Context parallel splits tokens over the ranks.
        ([FullAttentionSpec(num_kv_heads=1)], {"tp": 4, "total_heads": 1, "dcp": 2}, 1),
        # State-space states are sharded by head.
        ([FullAttentionSpec(num_kv_heads=1), MambaSpec()], {"tp": 2, "total_heads": 1}, 1),
    ],
)
def test_kv_replicas(specs: list[SimpleNamespace], kwargs: dict, replicas: int) -> None:
    assert kv_replicas(*configs(specs, **kwargs)) == replicas


def test_replicas_share_the_writes_of_a_job() -> None:
    job = StoreJob(
        request_id="r",
        block_ids=tuple(range(1, 201)),
        block_hashes=tuple(hashlib.sha256(bytes([i])).digest() for i in range(200)),
        first_block=0,
    )
    assert own_share(job, 0, 1) is job
    shares = [own_share(job, rank, 2) for rank in range(2)]
    # Every block written by exactly one replica, each about half of them.
    assert sorted(shares[0].block_ids + shares[1].block_ids) == list(job.block_ids)
    assert all(60 < share.num_blocks < 140 for share in shares)
    # Ranks 2 and 3 (the next group) split the same way as 0 and 1.
    assert own_share(job, 2, 2) == shares[0]
