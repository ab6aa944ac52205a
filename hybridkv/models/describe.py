"""What a hybrid model caches, per layer, and what a token costs.

The description is read off the model itself: one probe forward over two tokens fills a fresh
transformers `DynamicCache`, and each cache layer tells what it holds. That way the shapes are
the ones the model library really uses (MLA's latent KV, the DSA indexer's packed keys, Mamba-2's
state), not ones we re-derive from config fields that differ per architecture.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from torch import nn
from transformers import PreTrainedConfig

# "hybrid": a parallel hybrid's layer, attention and a recurrent mixer side by side (Falcon-H1,
# Zamba), one cache layer holding both KV and states: it counts as attention and as linear.
LayerKind = Literal["linear", "attention", "indexed_attention", "hybrid", "none"]


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: LayerKind
    # linear layers: (name, shape at batch 1, dtype) of each state tensor — `conv.<slot>` windows
    # and `recurrent.<slot>` states, as `hybridkv.models.kv.LinearState` names them
    state_tensors: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    state_bytes: int = 0  # every state tensor of one linear layer
    # attention layers: (name, token dimension) of each token-indexed tensor
    token_dims: tuple[tuple[str, int], ...] = ()
    kv_bytes_per_token: int = 0  # attention layers: bytes of every token-indexed tensor per token
    # sliding-window attention: the tokens each query attends (its cached prompt still holds every
    # token's KV, since a resume at any L needs the window before L); None: all earlier tokens
    window: int | None = None


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
        return [spec.index for spec in self.layers if spec.kind in ("linear", "hybrid")]

    @property
    def attention_layers(self) -> list[int]:
        return [spec.index for spec in self.layers if spec.kind in ("attention", "indexed_attention", "hybrid")]

    def token_tensors(self, index: int) -> dict[str, int]:
        """The token-indexed tensors of attention layer `index`, with their token dimension."""
        return dict(self.layers[index].token_dims)

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

    def layout_difference(self, other: ModelDescription) -> str | None:
        """Why `other`'s cache pieces would not fit this model's cache layers, or None if they do
        (the same layer kinds, state shapes and dtypes, and token-indexed tensors, layer by layer)."""
        if self.num_layers != other.num_layers:
            return f"{other.num_layers} layers against {self.num_layers}"
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            fields = ("kind", "state_tensors", "token_dims", "kv_bytes_per_token", "window")
            for name in fields:
                if getattr(mine, name) != getattr(theirs, name):
                    return f"layer {mine.index}: {name} {getattr(theirs, name)} against {getattr(mine, name)}"
        return None

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
