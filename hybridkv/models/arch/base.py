"""What hybridkv knows of one model family, in one place: `Architecture`.

A family is one module in this package that builds one `Architecture`; the registry
(`hybridkv.models.arch`) is the only place the rest of hybridkv asks. Everything a family
brings is optional except its transformers model types: a tiny config (a random-<name>
built-in), the decay probe
(for adaptive-replay), the cost model and cache-size formulas (for `hybridkv plan` and the
speed bounds), a trained shape (for `hybridkv train`) and a vLLM-servable variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.cost import CostModel

TINY_VOCAB = 512  # the byte tokenizer's vocabulary (`hybridkv.models.tokenizer`)
# The byte tokenizer's special tokens; trained models learn to emit EOS at an answer's end.
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# A probe turns one hooked module's output into the per-token worst log-decay, [tokens, heads].
Probe = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CacheSizes:
    """A full-size model's cache, from its config alone: bytes per token of attention KV, per linear layer of state."""

    linear_layers: int
    attention_layers: int
    kv_bytes_per_token_per_layer: int
    state_bytes_per_layer: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.attention_layers

    @property
    def state_bytes_per_checkpoint(self) -> int:
        return self.state_bytes_per_layer * self.linear_layers


@dataclass(frozen=True)
class Architecture:
    name: str  # the family, as built-in names spell it: random-<name>, tiny-<name>
    model_types: tuple[str, ...]  # transformers `model_type`s it covers (text and multimodal)
    # The random built-in's config (keywords override), or None: a family supported in users'
    # checkpoints without a built-in tiny model.
    tiny_config: Callable[..., PreTrainedConfig] | None = None
    # Where to hook one decoder layer to read its forgetting, and how to read the hooked output.
    decay_probe: Callable[[nn.Module], tuple[nn.Module, Probe] | None] | None = None
    cost_model: Callable[[PreTrainedConfig], CostModel] | None = None
    # (config, bytes per KV / conv entry, bytes per recurrent-state entry) -> sizes
    cache_sizes: Callable[[PreTrainedConfig, int, int], CacheSizes] | None = None
    # Overrides of `tiny_config` that give the shape `hybridkv train` trains (tiny-<name>).
    trained_shape: dict = field(default_factory=dict)
    # A variant of `tiny_config` that vLLM's CPU build can serve, or None.
    servable_config: Callable[[], PreTrainedConfig] | None = None

    @property
    def random_name(self) -> str:
        return f"random-{self.name}"

    @property
    def trained_name(self) -> str | None:
        return f"tiny-{self.name}" if self.trained_shape else None
