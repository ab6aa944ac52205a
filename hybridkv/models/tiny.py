"""Built-in tiny hybrid models: real architectures from transformers, scaled down.

Two kinds, both with a 512-token byte vocabulary (`hybridkv.models.tokenizer.ByteTokenizer`):

- `tiny-*` (TRAINED_MODELS): weights trained by `hybridkv train` and shipped in the package
  (`weights/<name>/`: a transformers config.json and model.safetensors). They read their
  context, so task scores, retention and PGR mean something (the README's model cards give their
  RULER scores). `tiny-glm5-next` ships and is the default.
- `random-*` (RANDOM_MODELS): a transformers config with the same layer pattern and mechanisms
  as the real model (layer kinds, NoPE/RoPE, MoE, hyper-connections, DSA indexer), a few million
  parameters, weights from the model library's own initialisation under a fixed seed, identical
  on every machine for the same seed and torch version. The invariant tests run on these.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedConfig

TINY_VOCAB = 512


def _glm5_next(**overrides) -> PreTrainedConfig:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    # GLM-5.3-Flash: 3 KDA : 1 MLA/DSA, NoPE, hyper-connections, MoE after 3 dense layers.
    return Glm5NextTextConfig(
        **dict(
            vocab_size=TINY_VOCAB,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
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
            index_topk=256,
            index_head_dim=32,
            index_n_heads=4,
            index_kpool=16,
            linear_head_dim=32,
            linear_num_heads=4,
            hc_mult=4,
            pad_token_id=0,
            max_position_embeddings=65536,
        )
        | overrides
    )


def _qwen3_next(**overrides) -> PreTrainedConfig:
    from transformers import Qwen3NextConfig

    # Qwen3-Next: 3 Gated DeltaNet : 1 gated attention with partial RoPE, MoE.
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


def _kimi_linear(**overrides) -> PreTrainedConfig:
    from transformers import KimiLinearConfig

    # Kimi Linear: 3 KDA : 1 MLA, MoE.
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


def _olmo_hybrid(**overrides) -> PreTrainedConfig:
    from transformers import OlmoHybridConfig

    # OLMo Hybrid: 3 Gated DeltaNet : 1 full attention, dense MLP.
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


def _nemotron_h(**overrides) -> PreTrainedConfig:
    from transformers import NemotronHConfig

    # Nemotron-H: Mamba-2 layers, MLP layers and a few NoPE attention layers.
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


# name -> config factory; keyword arguments override the random model's settings (the trained
# shapes in `hybridkv.train.shapes` are these with other sizes).
RANDOM_MODELS: dict[str, Callable[..., PreTrainedConfig]] = {
    "random-glm5-next": _glm5_next,
    "random-qwen3-next": _qwen3_next,
    "random-kimi-linear": _kimi_linear,
    "random-olmo-hybrid": _olmo_hybrid,
    "random-nemotron-h": _nemotron_h,
}
WEIGHTS_DIR = Path(__file__).parent / "weights"
# Trained models shipped with the package: name -> directory with config.json and model.safetensors.
TRAINED_MODELS: dict[str, Path] = {
    path.name: path for path in sorted(WEIGHTS_DIR.glob("tiny-*")) if (path / "model.safetensors").is_file()
}
BUILTIN_MODELS = (*TRAINED_MODELS, *RANDOM_MODELS)
# The trained GLM-5.3-Flash shape: the one built-in model whose task scores mean something.
DEFAULT_MODEL = "tiny-glm5-next"
