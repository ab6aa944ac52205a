"""The architecture registry: one module per model family, the one place that knows a family.

To add a family, write one module here that builds an `Architecture` and list it below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedConfig

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import (
    bamba,
    falcon_h1,
    glm5_next,
    granitemoehybrid,
    inkling,
    kimi_linear,
    lfm2,
    minimax,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_next,
    qwen4_exp,
    zamba2,
    zaya,
)
from hybridkv.models.arch.base import SPECIAL_TOKENS, TINY_VOCAB, Architecture, Probe
from hybridkv.models.cost import CostModel, generic_cost_model

# The five with a built-in tiny config (random-<name>) first; then the families hybridkv supports
# in users' checkpoints (their random checkpoints are tests/families.py's).
ARCHITECTURES: tuple[Architecture, ...] = tuple(
    module.ARCHITECTURE
    for module in (
        glm5_next, qwen3_next, kimi_linear, olmo_hybrid, nemotron_h,
        qwen3_5, granitemoehybrid, bamba, falcon_h1, zamba2, lfm2, zaya, inkling, minimax, qwen4_exp,
    )
)  # fmt: skip
_BY_MODEL_TYPE = {model_type: arch for arch in ARCHITECTURES for model_type in arch.model_types}


def architecture_for(config: PreTrainedConfig) -> Architecture | None:
    """The family of a config (its text part for a multimodal one), or None if hybridkv has no module for it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _BY_MODEL_TYPE.get(text.model_type) or _BY_MODEL_TYPE.get(config.model_type)


def by_name(name: str) -> Architecture:
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise HybridKVError(f"unknown architecture {name!r}; known: {', '.join(a.name for a in ARCHITECTURES)}")


def cost_model(config: PreTrainedConfig, dense_attention: bool = False) -> CostModel:
    """The cost model of a transformers config (a multimodal config's text part is used): the
    family's own where it has one, else the generic one built from its modules on the meta device.

    `dense_attention`: every query scores every earlier token even where DSA selects top-k, as
    transformers' implementation does (it masks the dense scores); a serving kernel that computes
    only the selected tokens (vLLM's sparse MLA) is the default.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = architecture_for(text)
    if arch is not None and arch.cost_model is not None:
        model = arch.cost_model(text)
    else:
        from hybridkv.models.meta import describe_config

        model = generic_cost_model(text, *describe_config(text))
    if dense_attention:
        model = replace(model, layers=tuple(replace(layer, max_attended=None) for layer in model.layers))
    return model


@dataclass(frozen=True)
class CacheSizes:
    """A model's cache from its config alone, in a deployment dtype."""

    linear_layers: int
    attention_layers: int
    kv_bytes_per_token: int  # every attention layer's token-indexed tensors
    state_bytes_per_checkpoint: int  # every linear layer's states


def cache_sizes(config: PreTrainedConfig, dtype: torch.dtype = torch.bfloat16) -> CacheSizes:
    """Read off the library's own modules on the meta device (no weights, no per-family formulas).
    Recurrent states keep the dtype the library gives them (float32 for the delta-rule kernels)."""
    from hybridkv.models.meta import describe_config

    _, description = describe_config(config, dtype)
    return CacheSizes(
        linear_layers=len(description.linear_layers),
        attention_layers=len(description.attention_layers),
        kv_bytes_per_token=description.kv_bytes_per_token,
        state_bytes_per_checkpoint=description.state_bytes,
    )


__all__ = [
    "ARCHITECTURES",
    "SPECIAL_TOKENS",
    "TINY_VOCAB",
    "Architecture",
    "CacheSizes",
    "Probe",
    "architecture_for",
    "by_name",
    "cache_sizes",
    "cost_model",
]
