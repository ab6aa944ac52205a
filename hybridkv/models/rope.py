"""Moving cached attention keys to new positions (position-independent reuse).

A chunk's keys were computed at the positions where it was encoded. Rotary embeddings compose
additively — R(p + δ) = R(δ) R(p) — so keys moved δ positions are the cached keys rotated by δ,
with the model's own rotary module and its own `apply_rotary_pos_emb` (partial rotary included).
Which families rotate their keys is each architecture module's to say (`Architecture.shift_keys`):
NoPE attention (GLM-5.3-Flash's MLA and its DSA indexer, Kimi Linear's MLA, Nemotron-H) keeps no
position in its keys, so moving them changes nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

# (decoder, keys [batch, heads, tokens, dim], δ) -> the keys δ positions later
KeyShift = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]


def no_shift(backbone: nn.Module, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """NoPE attention: keys carry no position."""
    return keys


def rope_shift(modeling: str) -> KeyShift:
    """A shift for a family whose decoder has a `rotary_emb` module (None: NoPE) and whose attention
    rotates keys with the `apply_rotary_pos_emb(q, k, cos, sin)` of transformers' module `modeling`
    (imported when first used)."""

    def shift(backbone: nn.Module, keys: torch.Tensor, delta: int) -> torch.Tensor:
        rotary = getattr(backbone, "rotary_emb", None)
        if rotary is None or delta == 0:
            return keys
        apply_rotary_pos_emb = importlib.import_module(modeling).apply_rotary_pos_emb
        positions = torch.full((keys.shape[0], keys.shape[-2]), delta, device=keys.device)
        cos, sin = rotary(keys, positions)
        _, shifted = apply_rotary_pos_emb(keys, keys, cos, sin)
        return shifted

    return shift
