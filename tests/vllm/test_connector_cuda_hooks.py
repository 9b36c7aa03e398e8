"""The connector's answers to vLLM's CUDA hooks: no required KV cache layout, no forced
piecewise graphs, and loads put fully in place before a step replayed as a full CUDA graph
(which skips ``wait_for_layer_load``)."""

from __future__ import annotations

import pytest
from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext

from kvshelf.vllm.connector import KVShelfConnector, _calls_layer_hooks


def _context(mode: CUDAGraphMode) -> ForwardContext:
    return ForwardContext(
        no_compile_layers={}, attn_metadata={}, slot_mapping={}, cudagraph_runtime_mode=mode
    )


@pytest.mark.parametrize(
    ("mode", "layerwise"),
    [(CUDAGraphMode.NONE, True), (CUDAGraphMode.PIECEWISE, True), (CUDAGraphMode.FULL, False)],
)
def test_full_graph_steps_load_every_layer_before_the_forward_pass(mode, layerwise) -> None:
    assert _calls_layer_hooks(_context(mode)) is layerwise


def test_connector_asks_no_layout_and_no_piecewise_graphs() -> None:
    assert KVShelfConnector.get_required_kvcache_layout(None) is None
    assert KVShelfConnector.requires_piecewise_for_cudagraph({}) is False
