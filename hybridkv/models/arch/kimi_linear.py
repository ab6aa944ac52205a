"""Kimi Linear (`kimi_linear`): 3 KDA linear layers : 1 MLA attention layer, MoE."""

from __future__ import annotations

from transformers import PreTrainedConfig

from hybridkv.models.arch.base import TINY_VOCAB, Architecture
from hybridkv.models.gates import kda_probe
from hybridkv.models.rope import no_shift


def tiny_config(**overrides) -> PreTrainedConfig:
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        **dict(
            vocab_size=TINY_VOCAB,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            linear_head_dim=32,
            linear_num_heads=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        | overrides
    )


ARCHITECTURE = Architecture(
    name="kimi-linear",
    model_types=("kimi_linear",),
    tiny_config=tiny_config,
    decay_probe=kda_probe,
    shift_keys=no_shift,  # NoPE MLA
)
