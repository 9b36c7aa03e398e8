"""A random-weight DeepSeek-V3-like model built locally, for tests of MLA (multi-head latent
attention) caches: vLLM caches one latent per token and layer (``kv_lora_rank`` + the rope
key), the same on every tensor parallel rank.

``build_deepseek_v3_like``: ``DeepseekV3ForCausalLM`` with DeepSeek-V3's MLA shapes
(``kv_lora_rank`` 512, rope key 64) on a tiny body (hidden size 256, 2 layers, the second a
small mixture of experts), in bfloat16, with the tiny Llama's tokenizer. Like
:mod:`kvshelf.testbed.models`, building is deterministic and done once per folder, and nothing
here imports vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvshelf.testbed.models import MARKER_FILE, TINY, build_model

KV_LORA_RANK = 512
ROPE_HEAD_DIM = 64
"""The MLA cache entry of a token in a layer is ``KV_LORA_RANK + ROPE_HEAD_DIM`` values."""


def build_deepseek_v3_like(folder: Path, seed: int = 0) -> Path:
    """A DeepSeek-V3-like model with random bfloat16 weights, written to ``folder`` once.

    Four query heads (so that 2 tensor parallel ranks split them), no query compression, one
    dense layer then one MoE layer of 4 routed experts (2 per token) and a shared one.
    """
    if (folder / MARKER_FILE).exists():
        return folder
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    base = build_model(TINY)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in base.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, tmp / file.name)
    llama = json.loads((base / "config.json").read_text())
    config = DeepseekV3Config(
        vocab_size=TINY.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
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
        bos_token_id=llama["bos_token_id"],
        eos_token_id=llama["eos_token_id"],
        pad_token_id=llama["pad_token_id"],
        tie_word_embeddings=False,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    generator = torch.Generator().manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            elif "e_score_correction_bias" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.to(torch.bfloat16).save_pretrained(tmp)
    (tmp / MARKER_FILE).write_text(json.dumps({"deepseek_v3_like": seed}) + "\n")
    tmp.rename(folder)
    return folder
