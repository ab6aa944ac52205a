"""MiniMax-Text-01 / M1 (`minimax`): lightning-attention linear layers and full attention layers, MoE.

transformers' MiniMax refuses any cache but its own `MiniMaxCache`, which keeps each lightning
layer's state (Kᵀ V, [B, H, D, D]) on the cache object instead of in a cache layer
(`get_linear_cache` / `set_linear_cache`). The architecture names that class; the adapter builds
the hybridkv cache as an instance of it whose linear states live in the ordinary linear cache
layers, so they are read, written and described like every other family's.

Lightning attention forgets at a fixed rate: S_t = exp(−slope_h) S_{t−1} + k_tᵀ v_t per head h,
whatever the token, so a dropped state's error decays by exactly exp(−slope_h) per token.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.arch.base import Architecture, Probe
from hybridkv.models.gates import submodule


def cache_class() -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache


def decay_probe(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
    """A lightning layer's per-head log-decay is −slope_rate for every token (its `slope_rate`
    buffer, [H, 1, 1]); the hooked `qkv_proj` output ([B, T, …]) only says how many tokens ran."""
    mixer = submodule(layer, "self_attn")
    if mixer is None or not hasattr(mixer, "slope_rate"):
        return None  # a full attention layer

    def probe(projected: torch.Tensor) -> torch.Tensor:
        per_head = -mixer.slope_rate.reshape(-1).float()
        return per_head.expand(projected.shape[1], -1)

    return mixer.qkv_proj, probe


ARCHITECTURE = Architecture(name="minimax", model_types=("minimax",), decay_probe=decay_probe, cache_class=cache_class)
