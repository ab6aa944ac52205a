"""The shapes the trained built-in models have: the real architectures, sized for a 2-core CPU.

Per-token training cost on a CPU is dominated by per-layer overheads (the chunked linear-attention
recurrence, hyper-connection routing), not by width, so these keep the layer pattern of the real
model at 8-10 layers and a hidden size of 128. Each is a transformers config, and the trained
weights load into the unmodified transformers class.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.tiny import TINY_VOCAB


def _glm5_next() -> PreTrainedConfig:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    # GLM-5.3-Flash's pattern (3 KDA : 1 MLA/DSA, NoPE, hyper-connections with 4 streams, MoE after
    # 3 dense layers) at 8 layers. The indexer keeps 512 tokens (32 pools of 16) per query.
    return Glm5NextTextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=512,
        index_head_dim=32,
        index_n_heads=4,
        index_kpool=16,
        linear_head_dim=32,
        linear_num_heads=4,
        hc_mult=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=65536,
    )


def _qwen3_next() -> PreTrainedConfig:
    from transformers import Qwen3NextConfig

    # Qwen3-Next's pattern (3 Gated DeltaNet : 1 gated attention with partial RoPE, MoE with a
    # shared expert) at 8 layers. Linear heads: 2 key heads, 4 value heads, 32 channels each.
    return Qwen3NextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=65536,
    )


def _nemotron_h() -> PreTrainedConfig:
    from transformers import NemotronHConfig

    # Nemotron-H's pattern (Mamba-2 and squared-ReLU MLP layers, a few NoPE attention layers) at
    # 10 layers: 4 Mamba-2, 4 MLP, 2 attention.
    return NemotronHConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp", "mamba", "attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        ssm_state_size=32,
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=2,
        chunk_size=64,
        use_mamba_kernels=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=65536,
    )


TRAINABLE: dict[str, Callable[[], PreTrainedConfig]] = {
    "tiny-glm5-next": _glm5_next,
    "tiny-qwen3-next": _qwen3_next,
    "tiny-nemotron-h": _nemotron_h,
}


def build(name: str) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    """(config, backbone, lm_head) initialised by the library under the current torch seed."""
    from hybridkv.models.loader import model_from_config

    config = TRAINABLE[name]()
    return config, *model_from_config(config)
