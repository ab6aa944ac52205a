"""What a hybrid model caches, per layer, and what a token costs.

The description is read off the model itself: one probe forward over two tokens fills a fresh
transformers `DynamicCache`, and each cache layer tells what it holds. That way the shapes are
the ones the model library really uses (MLA's latent KV, the DSA indexer's packed keys, Mamba-2's
state), not ones we re-derive from config fields that differ per architecture.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, LinearAttentionCacheLayerMixin

LayerKind = Literal["linear", "attention", "indexed_attention", "none"]

# Token-indexed tensors an attention cache layer holds, and the dimension that counts tokens.
ATTENTION_TENSORS: dict[str, int] = {"keys": -2, "values": -2}
INDEXED_ATTENTION_TENSORS: dict[str, int] = {**ATTENTION_TENSORS, "indexer_keys": 1}


def token_tensors(kind: LayerKind) -> dict[str, int]:
    """Names of the token-indexed tensors of an attention layer kind, with their token dimension."""
    return INDEXED_ATTENTION_TENSORS if kind == "indexed_attention" else ATTENTION_TENSORS


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: LayerKind
    conv_shape: tuple[int, ...] = ()  # linear layers: short-conv state (batch 1)
    recurrent_shape: tuple[int, ...] = ()  # linear layers: recurrent / SSM state (batch 1)
    state_dtype: str = ""
    state_bytes: int = 0  # conv + recurrent state bytes of one linear layer
    kv_bytes_per_token: int = 0  # attention layers: bytes of every token-indexed tensor per token


@dataclass(frozen=True)
class ModelDescription:
    name: str
    model_type: str
    layers: tuple[LayerSpec, ...]
    parameters: int
    active_parameters: int  # per token: routed experts counted at top-k / n_experts
    attention_flops_per_context_token: int  # per new token, per token of visible context
    max_attended_context: int | None  # DSA top-k caps the context a query attends

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def linear_layers(self) -> list[int]:
        return [spec.index for spec in self.layers if spec.kind == "linear"]

    @property
    def attention_layers(self) -> list[int]:
        return [spec.index for spec in self.layers if spec.kind in ("attention", "indexed_attention")]

    def token_tensors(self, index: int) -> dict[str, int]:
        """The token-indexed tensors of attention layer `index`, with their token dimension."""
        return token_tensors(self.layers[index].kind)

    @property
    def state_bytes(self) -> int:
        """Bytes of one full linear-state checkpoint (every linear layer, conv + recurrent)."""
        return sum(spec.state_bytes for spec in self.layers)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(spec.kv_bytes_per_token for spec in self.layers)

    def flops_per_token(self, context: int = 0) -> float:
        """Approximate forward FLOPs for one token that sees `context` earlier tokens.

        2 × active parameters for the matrix multiplies, plus QK^T and AV over the attended
        context for every attention layer. A first-order model; the fuller cost model is
        separate work.
        """
        attended = context if self.max_attended_context is None else min(context, self.max_attended_context)
        return 2.0 * self.active_parameters + self.attention_flops_per_context_token * attended

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "linear_layers": self.linear_layers,
            "attention_layers": self.attention_layers,
            "layer_kinds": [spec.kind for spec in self.layers],
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
            "state_bytes_per_checkpoint": self.state_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "flops_per_token": self.flops_per_token(0),
            "layer_specs": [asdict(spec) for spec in self.layers],
        }


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def describe_cache_layers(cache: DynamicCache, tokens_seen: int) -> tuple[LayerSpec, ...]:
    """Classify every layer of a cache that has seen `tokens_seen` tokens of one sequence."""
    specs = []
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            if conv is None and recurrent is None:
                specs.append(LayerSpec(index, "none"))  # e.g. Nemotron-H's MLP-only blocks
                continue
            specs.append(
                LayerSpec(
                    index,
                    "linear",
                    conv_shape=tuple(conv.shape) if conv is not None else (),
                    recurrent_shape=tuple(recurrent.shape) if recurrent is not None else (),
                    state_dtype=str(recurrent.dtype if recurrent is not None else conv.dtype).removeprefix("torch."),
                    state_bytes=_nbytes(conv) + _nbytes(recurrent),
                )
            )
        elif isinstance(layer, DynamicLayer):
            kind: LayerKind = "indexed_attention" if isinstance(layer, DynamicIndexedLayer) else "attention"
            per_token = sum(_nbytes(getattr(layer, name)) for name in token_tensors(kind)) // tokens_seen
            specs.append(LayerSpec(index, kind, kv_bytes_per_token=per_token))
        else:
            raise TypeError(f"layer {index}: unsupported cache layer type {type(layer).__name__}")
    return tuple(specs)


def first_set(config: PreTrainedConfig, *names: str, default=None):
    """The first of `names` that the config sets (architectures name the same field differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def count_parameters(backbone: nn.Module, lm_head: nn.Module, config: PreTrainedConfig) -> tuple[int, int]:
    """(total, active-per-token) parameters; embeddings are looked up, not multiplied."""
    total = sum(p.numel() for p in backbone.parameters()) + sum(p.numel() for p in lm_head.parameters())
    embedding = backbone.get_input_embeddings().weight.numel()
    routed = sum(
        sum(p.numel() for p in module.parameters(recurse=False))
        for module in backbone.modules()
        if type(module).__name__.endswith("Experts")  # transformers' fused routed-expert modules
    )
    n_experts = first_set(config, "n_routed_experts", "num_experts", "num_local_experts")
    top_k = first_set(config, "num_experts_per_tok", default=1)
    inactive = routed - routed * top_k // n_experts if n_experts else 0
    return total, total - embedding - inactive


def attention_flops_per_context_token(config: PreTrainedConfig, attention_layers: int) -> int:
    """2·heads·(qk_dim + v_dim) FLOPs per attended context token, summed over attention layers."""
    heads = config.num_attention_heads
    qk_dim = first_set(config, "qk_head_dim") or first_set(config, "head_dim") or config.hidden_size // heads
    v_dim = first_set(config, "v_head_dim", default=qk_dim)
    return 2 * heads * (qk_dim + v_dim) * attention_layers
