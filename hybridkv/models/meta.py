"""A model described from its config alone: the library's own modules, built on the meta device.

`hybridkv plan` must speak about GLM-5.3-Flash (300B) or any checkpoint without loading its
weights. Building the transformers model on the meta device costs no memory, and one probe
forward there fills a cache whose layers give the real shapes (`describe_layers`); the modules
give the parameters per layer. So the cache sizes and the cost model of every family come from
the model library's code, not from per-family arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from transformers import PreTrainedConfig

from hybridkv.errors import HybridKVError
from hybridkv.models.describe import LayerSpec, ModelDescription

# The meta forward runs in bfloat16: torch's meta kernel of grouped_mm (transformers' MoE path)
# takes nothing else. Sizes in another dtype are converted from it (`_in_dtype`).
PROBE_DTYPE = torch.bfloat16


@contextmanager
def _on_meta() -> Iterator[None]:
    # MoE routing indexes by `nonzero`, whose size a meta tensor cannot know; every expert then
    # counts as selected, which changes no shape the description reads.
    with torch.device("meta"), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def meta_modules(config: PreTrainedConfig) -> tuple[nn.Module, nn.Module]:
    """(decoder, LM head) of `config`'s text model on the meta device: shapes, no storage."""
    from hybridkv.models.loader import model_from_config

    with _on_meta():
        backbone, lm_head = model_from_config(config.get_text_config())
    return backbone.to(PROBE_DTYPE), lm_head.to(PROBE_DTYPE)


def _in_dtype(spec: LayerSpec, dtype: torch.dtype) -> LayerSpec:
    """`spec` of a model run in `dtype`: tensors in the model's dtype follow it; those the library
    keeps in a dtype of its own (float32 delta-rule states) stay."""
    probe = str(PROBE_DTYPE).removeprefix("torch.")
    name = str(dtype).removeprefix("torch.")
    tensors = tuple((n, shape, name if d == probe else d) for n, shape, d in spec.state_tensors)
    state_bytes = sum(torch.Size(shape).numel() * getattr(torch, d).itemsize for _, shape, d in tensors)
    kv = spec.kv_bytes_per_token * dtype.itemsize // PROBE_DTYPE.itemsize
    return replace(spec, state_tensors=tensors, state_bytes=state_bytes, kv_bytes_per_token=kv)


def describe_config(
    config: PreTrainedConfig, dtype: torch.dtype = torch.bfloat16
) -> tuple[nn.Module, ModelDescription]:
    """The meta decoder of `config` and its description, with KV and state bytes in `dtype`."""
    from hybridkv.models.loader import describe_modules

    text = config.get_text_config()
    try:
        backbone, lm_head = meta_modules(text)
        with _on_meta():
            description = describe_modules(text.model_type, text, backbone, lm_head)
    except (HybridKVError, RuntimeError, ValueError, TypeError, NotImplementedError, IndexError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HybridKVError(f"cannot describe a {text.model_type} model from its config alone ({first})") from err
    if not description.linear_layers:
        # RecurrentGemma keeps its states on its modules: a cache shows none, and sizes would lie
        raise HybridKVError(
            f"cannot describe a {text.model_type} model from its config alone (its cache shows no linear-attention "
            "or state-space layers)"
        )
    return backbone, replace(description, layers=tuple(_in_dtype(spec, dtype) for spec in description.layers))
