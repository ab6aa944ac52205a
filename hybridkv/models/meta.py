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
from dataclasses import dataclass, replace

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from transformers import PreTrainedConfig

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import architecture_for
from hybridkv.models.cost import CostModel, generic_cost_model
from hybridkv.models.describe import LayerSpec, ModelDescription
from hybridkv.models.loader import describe_modules, model_from_config
from hybridkv.models.placement import MemoryPlan

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
    _, description = describe_config(config, dtype)
    return CacheSizes(
        linear_layers=len(description.linear_layers),
        attention_layers=len(description.attention_layers),
        kv_bytes_per_token=description.kv_bytes_per_token,
        state_bytes_per_checkpoint=description.state_bytes,
    )


def memory_plan(config: PreTrainedConfig, parameters: int, dtype: torch.dtype, context_tokens: int) -> MemoryPlan:
    """What a checkpoint of `parameters` weights needs in `dtype` with a cache of `context_tokens`."""
    sizes = cache_sizes(config, dtype)
    return MemoryPlan(
        parameters * dtype.itemsize, sizes.kv_bytes_per_token, sizes.state_bytes_per_checkpoint, context_tokens
    )
