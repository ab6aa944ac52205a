"""The shapes the trained built-in models have: the random models' architectures, sized for a 2-core CPU.

Per-token training cost on a CPU is dominated by per-layer overheads (the chunked linear-attention
recurrence, hyper-connection routing), not by width, so these keep the random models' layer
patterns and halve their width to a hidden size of 128 (each architecture's `trained_shape`, in
`hybridkv.models.arch`, says why its shape is what it is). They also name the byte tokenizer's
special tokens, which the trained models learn to emit (EOS ends an answer). Each is a
transformers config, and the trained weights load into the unmodified transformers class.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import ARCHITECTURES

TRAINABLE: dict[str, Callable[[], PreTrainedConfig]] = {
    arch.trained_name: partial(arch.tiny_config, **arch.trained_shape) for arch in ARCHITECTURES if arch.trained_shape
}


def shape_config(name: str, overrides: dict | None = None) -> PreTrainedConfig:
    """The shape's transformers config; `overrides` replace its fields (e.g. a wider attention
    layer), refused when the config has no such field (a misspelt name would train the default)."""
    config = TRAINABLE[name]()
    unknown = sorted(set(overrides or {}) - set(config.to_dict()))
    if unknown:
        raise HybridKVError(f"--shape: {name} has no config field {', '.join(unknown)}")
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def build(name: str, overrides: dict | None = None) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    """(config, backbone, lm_head) initialised by the library under the current torch seed."""
    from hybridkv.models.loader import model_from_config

    config = shape_config(name, overrides)
    return config, *model_from_config(config)
