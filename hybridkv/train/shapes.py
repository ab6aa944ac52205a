"""The shapes the trained built-in models have: the random models' architectures, sized for a 2-core CPU.

Per-token training cost on a CPU is dominated by per-layer overheads (the chunked linear-attention
recurrence, hyper-connection routing), not by width, so these keep the random models' layer
patterns (`hybridkv.models.tiny`) and halve their width to a hidden size of 128. They also name
the byte tokenizer's special tokens, which the trained models learn to emit (EOS ends an answer).
Each is a transformers config, and the trained weights load into the unmodified transformers class.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.tiny import RANDOM_MODELS

_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

TRAINABLE: dict[str, Callable[[], PreTrainedConfig]] = {
    # GLM-5.3-Flash's pattern once (3 KDA, then MLA/DSA), shaped for speed: 4 layers and 2
    # hyper-connection streams train 2x faster per token than 8 layers and 4 streams (5,000 vs
    # 2,500 tokens/s here), and one MLA layer after three KDA layers is enough for retrieval, since
    # the KDA layers give it the recent-token features that key matching needs. The DSA indexer
    # keeps GLM-5.3-Flash's own 2,048 tokens (128 pools of 16) per query.
    "tiny-glm5-next": partial(
        RANDOM_MODELS["random-glm5-next"],
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        hc_mult=2,
        index_topk=2048,
        **_SPECIAL,
    ),
    # Qwen3-Next's pattern once (3 Gated DeltaNet, then gated attention with partial RoPE), shaped
    # for speed as tiny-glm5-next is (about 8,000 tokens/s here); linear heads: 2 key heads, 4
    # value heads, 32 channels each.
    "tiny-qwen3-next": partial(
        RANDOM_MODELS["random-qwen3-next"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **_SPECIAL,
    ),
    # Nemotron-H's mix of Mamba-2, MLP and NoPE attention layers, shaped as the others: three
    # Mamba-2 layers (expand 2: 8 heads of 32), then one attention layer, MLPs between (about
    # 13,000 tokens/s here).
    "tiny-nemotron-h": partial(
        RANDOM_MODELS["random-nemotron-h"],
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        mamba_num_heads=8,
        layers_block_type=["mamba", "mlp", "mamba", "mlp", "mamba", "attention", "mlp"],
        **_SPECIAL,
    ),
}


def build(name: str) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    """(config, backbone, lm_head) initialised by the library under the current torch seed."""
    from hybridkv.models.loader import model_from_config

    config = TRAINABLE[name]()
    return config, *model_from_config(config)
