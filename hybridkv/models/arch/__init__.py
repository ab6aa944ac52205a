"""The architecture registry: one module per model family, the one place that knows a family.

To add a family, write one module here that builds an `Architecture` and list it below.
"""

from __future__ import annotations

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


__all__ = [
    "ARCHITECTURES",
    "SPECIAL_TOKENS",
    "TINY_VOCAB",
    "Architecture",
    "Probe",
    "architecture_for",
    "by_name",
]
