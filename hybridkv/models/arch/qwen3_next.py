"""Qwen3-Next (`qwen3_next`): 3 Gated DeltaNet layers : 1 gated attention layer with partial RoPE, MoE."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.arch.base import SPECIAL_TOKENS, TINY_VOCAB, Architecture, Probe
from hybridkv.models.cost import STATE_BYTES, WEIGHT_BYTES, CostModel, LayerCost, moe
from hybridkv.models.gates import gdn_gate, submodule
from hybridkv.models.rope import rope_shift


def tiny_config(**overrides) -> PreTrainedConfig:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **dict(
            vocab_size=TINY_VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=65536,
        )
        | overrides
    )


def servable_config() -> PreTrainedConfig:
    """vLLM's CPU Gated-DeltaNet kernel needs a linear head size it has kernels for (128) and bfloat16."""
    config = tiny_config(
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    return config


def decay_probe(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
    """Qwen3-Next packs (b, a) per key-head group in `in_proj_ba`; unpack `a` as the model does."""
    mixer = submodule(layer, "linear_attn")
    if mixer is None:
        return None

    def probe(mixed_ba):
        group = mixer.num_v_heads // mixer.num_k_heads
        grouped = mixed_ba.view(*mixed_ba.shape[:-1], mixer.num_k_heads, 2 * group)
        a = grouped[..., group:].reshape(*mixed_ba.shape[:-1], mixer.num_v_heads)
        return gdn_gate(mixer, a)

    return mixer.in_proj_ba, probe


def cost_model(config: PreTrainedConfig) -> CostModel:
    d, nq, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    ffn = moe(config, d)
    activations = 4 * d * WEIGHT_BYTES
    attention_params = d * (2 * nq * hd + 2 * nkv * hd) + nq * hd * d  # gated q, k, v, o
    attention = LayerCost(
        "attention",
        flops_per_token=2 * attention_params,
        flops_per_context_token=4 * nq * hd,
        weight_bytes=attention_params * WEIGHT_BYTES,
        activation_bytes_per_token=activations,
        kv_bytes_per_token=2 * nkv * hd * WEIGHT_BYTES,
    )
    conv_channels = 2 * hk * dk + hv * dv
    gdn_params = d * (conv_channels + hv * dv + 2 * hv) + hv * dv * d + conv_channels * config.linear_conv_kernel_dim
    gdn = LayerCost(
        "linear",
        flops_per_token=2 * gdn_params + 6 * hv * dk * dv,  # q, k, v, z, b, a; the recurrence
        weight_bytes=gdn_params * WEIGHT_BYTES,
        activation_bytes_per_token=activations,
        # float32 delta-rule state and bfloat16 short-conv windows (q, k and v channels)
        state_bytes=hv * dk * dv * STATE_BYTES + conv_channels * config.linear_conv_kernel_dim * WEIGHT_BYTES,
    )
    attention, gdn = ffn.add_to(attention), ffn.add_to(gdn)
    layers = tuple(attention if kind == "full_attention" else gdn for kind in config.layer_types)
    head = d * config.vocab_size
    return CostModel(config.model_type, layers, 2 * head, head * WEIGHT_BYTES)


ARCHITECTURE = Architecture(
    name="qwen3-next",
    model_types=("qwen3_next",),
    tiny_config=tiny_config,
    decay_probe=decay_probe,
    cost_model=cost_model,
    # Qwen3-Next's pattern once (3 Gated DeltaNet, then gated attention with partial RoPE), shaped
    # for speed as tiny-glm5-next is (about 8,000 tokens/s here); linear heads: 2 key heads, 4
    # value heads, 32 channels each.
    trained_shape=dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **SPECIAL_TOKENS,
    ),
    servable_config=servable_config,
    shift_keys=rope_shift("transformers.models.qwen3_next.modeling_qwen3_next"),
)
