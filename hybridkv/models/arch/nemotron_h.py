"""Nemotron-H (`nemotron_h`): Mamba-2 layers, MLP layers and a few NoPE attention layers."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.arch.base import SPECIAL_TOKENS, TINY_VOCAB, Architecture, Probe
from hybridkv.models.gates import mamba2_dt, submodule
from hybridkv.models.rope import no_shift


def tiny_config(**overrides) -> PreTrainedConfig:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **dict(
            vocab_size=TINY_VOCAB,
            hidden_size=256,
            layers_block_type=[
                "mamba",
                "mlp",
                "mamba",
                "attention",
                "mlp",
                "mamba",
                "mlp",
                "mamba",
                "attention",
                "mlp",
            ],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            ssm_state_size=32,
            mamba_num_heads=8,
            mamba_head_dim=32,
            n_groups=2,
            chunk_size=64,
            use_mamba_kernels=False,
            max_position_embeddings=65536,
        )
        | overrides
    )


def decay_probe(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
    """Mamba-2's `in_proj` output ends with the per-head Δ."""
    mixer = submodule(layer, "mixer")
    return None if mixer is None or not hasattr(mixer, "A_log") else (mixer.in_proj, mamba2_dt(mixer))


ARCHITECTURE = Architecture(
    name="nemotron-h",
    model_types=("nemotron_h",),
    tiny_config=tiny_config,
    decay_probe=decay_probe,
    # Nemotron-H's mix of Mamba-2, MLP and NoPE attention layers, shaped as the others: three
    # Mamba-2 layers (expand 2: 8 heads of 32), then one attention layer, MLPs between (about
    # 13,000 tokens/s here).
    trained_shape=dict(
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        mamba_num_heads=8,
        layers_block_type=["mamba", "mlp", "mamba", "mlp", "mamba", "attention", "mlp"],
        **SPECIAL_TOKENS,
    ),
    shift_keys=no_shift,  # NoPE attention
)
