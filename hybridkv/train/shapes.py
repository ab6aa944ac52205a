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

from hybridkv.models.arch import ARCHITECTURES

TRAINABLE: dict[str, Callable[[], PreTrainedConfig]] = {
    arch.trained_name: partial(arch.tiny_config, **arch.trained_shape) for arch in ARCHITECTURES if arch.trained_shape
}


def build(name: str) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    """(config, backbone, lm_head) initialised by the library under the current torch seed."""
    from hybridkv.models.loader import model_from_config

    config = TRAINABLE[name]()
    return config, *model_from_config(config)
