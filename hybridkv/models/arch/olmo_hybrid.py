"""OLMo Hybrid (`olmo_hybrid`): 3 Gated DeltaNet layers : 1 full attention layer, dense MLP."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.arch.base import TINY_VOCAB, Architecture, Probe
from hybridkv.models.gates import gdn_gate, submodule
from hybridkv.models.rope import rope_shift


def tiny_config(**overrides) -> PreTrainedConfig:
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(
        **dict(
            vocab_size=TINY_VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=64,
            pad_token_id=0,
            eos_token_id=1,
            max_position_embeddings=65536,
        )
        | overrides
    )


def decay_probe(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
    """OLMo Hybrid's GDN projects `a` on its own (`a_proj`)."""
    mixer = submodule(layer, "linear_attn")
    return None if mixer is None else (mixer.a_proj, lambda a: gdn_gate(mixer, a))


ARCHITECTURE = Architecture(
    name="olmo-hybrid",
    model_types=("olmo_hybrid",),
    tiny_config=tiny_config,
    decay_probe=decay_probe,
    shift_keys=rope_shift("transformers.models.olmo_hybrid.modeling_olmo_hybrid"),
)
