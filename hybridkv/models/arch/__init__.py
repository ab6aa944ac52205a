"""The architecture registry: one module per model family, the one place that knows a family.

To add a family, write one module here that builds an `Architecture` and list it below.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedConfig

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import (
    bamba,
    falcon_h1,
    glm5_next,
    granitemoehybrid,
    kimi_linear,
    lfm2,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_next,
    zamba2,
)
from hybridkv.models.arch.base import SPECIAL_TOKENS, TINY_VOCAB, Architecture, CacheSizes, Probe
from hybridkv.models.cost import CostModel

# The five with a built-in tiny config (random-<name>) first; then the families hybridkv supports
# in users' checkpoints (their random checkpoints are tests/families.py's).
ARCHITECTURES: tuple[Architecture, ...] = tuple(
    module.ARCHITECTURE
    for module in (
        glm5_next, qwen3_next, kimi_linear, olmo_hybrid, nemotron_h,
        qwen3_5, granitemoehybrid, bamba, falcon_h1, zamba2, lfm2,
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


def _requires(config: PreTrainedConfig, what: str, attribute: str):
    arch = architecture_for(config)
    found = getattr(arch, attribute) if arch is not None else None
    if found is None:
        known = sorted(t for a in ARCHITECTURES if getattr(a, attribute) for t in a.model_types)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        raise HybridKVError(f"no {what} for model type {text.model_type!r} yet; known: {', '.join(known)}")
    return found


def cost_model(config: PreTrainedConfig, dense_attention: bool = False) -> CostModel:
    """The cost model of a transformers config (a multimodal config's text part is used).

    `dense_attention`: every query scores every earlier token even where DSA selects top-k, as
    transformers' implementation does (it masks the dense scores); a serving kernel that computes
    only the selected tokens (vLLM's sparse MLA) is the default.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model = _requires(config, "cost model", "cost_model")(text)
    if dense_attention:
        model = replace(model, layers=tuple(replace(layer, max_attended=None) for layer in model.layers))
    return model


def cache_sizes(config: PreTrainedConfig, dtype_bytes: int = 2, state_dtype_bytes: int = 4) -> CacheSizes:
    """A config's cache sizes from its family's formulas (no weights, no probe)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _requires(config, "cache-size formulas", "cache_sizes")(text, dtype_bytes, state_dtype_bytes)


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
