"""What hybridkv knows of one model family, in one place: `Architecture`.

A family is one module in this package that builds one `Architecture`; the registry
(`hybridkv.models.arch`) is the only place the rest of hybridkv asks. Everything a family
brings is optional except its transformers model types: a tiny config (a random-<name>
built-in), the decay probe (for adaptive-replay), a cost model of its own (for `hybridkv plan`
and the speed bounds; every family has the generic one), a trained shape (for `hybridkv train`),
a vLLM-servable variant, the cache class the model requires, and the start values of state slots
that do not start at zero. Cache sizes need nothing: they are read off the library's modules on
the meta device (`hybridkv.models.meta`).
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
class Architecture:
    name: str  # the family, as built-in names spell it: random-<name>, tiny-<name>
    model_types: tuple[str, ...]  # transformers `model_type`s it covers (text and multimodal)
    # The random built-in's config (keywords override), or None: a family supported in users'
    # checkpoints without a built-in tiny model.
    tiny_config: Callable[..., PreTrainedConfig] | None = None
    # Where to hook one decoder layer to read its forgetting, and how to read the hooked output.
    decay_probe: Callable[[nn.Module], tuple[nn.Module, Probe] | None] | None = None
    # A cost model of the family's own (config -> CostModel); without one, the generic cost
    # model of `hybridkv.models.cost` is built from the modules on the meta device.
    cost_model: Callable[[PreTrainedConfig], CostModel] | None = None
    # transformers has no causal-LM class for some text decoders (GLM-5.3-Flash's): build
    # (decoder, LM head) for a config here; None: AutoModelForCausalLM.
    decoder_and_head: Callable[[PreTrainedConfig], tuple[nn.Module, nn.Module]] | None = None
    # Overrides of `tiny_config` that give the shape `hybridkv train` trains (tiny-<name>).
    trained_shape: dict = field(default_factory=dict)
    # A variant of `tiny_config` that vLLM's CPU build can serve, or None.
    servable_config: Callable[[], PreTrainedConfig] | None = None
    # The transformers cache class the model insists on (MiniMax refuses any cache that is not a
    # `MiniMaxCache`), imported when first asked; None: a plain `DynamicCache` layout will do.
    # The adapter builds its hybridkv cache as an instance of it (`hybridkv.models.adapter`).
    cache_class: Callable[[], type] | None = None
    # Linear-state slots whose state before any token is not zero: config -> {slot name: value}
    # (Qwen4-Exp's n-gram context holds token ids and starts as end-of-sequence ids).
    zero_state_fills: Callable[[PreTrainedConfig], dict[str, int]] | None = None
    # How cached keys move to new positions (`hybridkv.models.rope`): `rope_shift(...)` for rotary
    # attention, `no_shift` for NoPE; None: not known, and position correction is refused.
    shift_keys: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] | None = None

    @property
    def random_name(self) -> str:
        return f"random-{self.name}"

    @property
    def trained_name(self) -> str | None:
        return f"tiny-{self.name}" if self.trained_shape else None
