"""The forgetting of each linear-layer family, read from what its module computes (see `hybridkv.models.decay`).

Each function turns a hooked module's output into the per-token worst log-decay, [tokens, heads].
The gates come from the model's own modules, never recomputed by us, except GDN's and Mamba-2's
one-line gate formulas (their modules expose only the gate's inputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.arch.base import Probe


def kda_worst_channel(gate: torch.Tensor) -> torch.Tensor:
    """KDA: the forget gate returns log α per key channel, [B, T, H, D] -> worst channel [T, H]."""
    return gate[0].float().amax(-1)


def gdn_gate(mixer: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet: log α = −exp(A_log) · softplus(a + dt_bias), one per head, [T, H]."""
    return -mixer.A_log.float().exp() * F.softplus(a[0].float() + mixer.dt_bias.float())


def mamba2_dt(mixer: nn.Module) -> Probe:
    """Mamba-2: `in_proj` ends with the per-head Δ; log decay = Δ·A with Δ = clamp(softplus(Δ + dt_bias)).

    Falcon-H1 scales the projection by its µP multipliers (`mup_vector`) before splitting it."""
    scale = getattr(mixer, "mup_vector", None)

    def probe(projected: torch.Tensor) -> torch.Tensor:
        raw = projected[0, :, -mixer.num_heads :].float()
        if scale is not None:
            raw = raw * scale.reshape(-1)[-mixer.num_heads :].float()
        dt = F.softplus(raw + mixer.dt_bias.float())
        dt = dt.clamp(*mixer.time_step_limit)
        return dt * -mixer.A_log.float().exp()

    return probe


def submodule(layer: nn.Module, path: str) -> nn.Module | None:
    """`layer`'s module at the dotted `path`, or None (e.g. an attention layer asked for its gate)."""
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def mamba2_probe(*paths: str):
    """A probe finder for the Mamba-2 mixer at the first of `paths` a decoder layer has (None: it has none)."""

    def find(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
        for path in paths:
            mixer = submodule(layer, path)
            if mixer is not None and hasattr(mixer, "A_log"):
                return mixer.in_proj, mamba2_dt(mixer)
        return None

    return find


def gdn_probe(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
    """Gated DeltaNet mixers that project `a` on their own (Qwen3.5's `in_proj_a`)."""
    mixer = submodule(layer, "linear_attn")
    return None if mixer is None else (mixer.in_proj_a, lambda a: gdn_gate(mixer, a))


def short_conv_probe(path: str):
    """Short-convolution layers (LFM2) keep only their last K − 1 inputs: any whole span of tokens
    replaces the window entirely, so each token's log-decay is −∞ (one "head"). `path` names the
    layer's input projection ([B, T, ...], called once per forward)."""

    def find(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
        projection = submodule(layer, path)
        return None if projection is None else (projection, lambda out: torch.full((out.shape[1], 1), -math.inf))

    return find


def kda_probe(layer: nn.Module) -> tuple[nn.Module, Probe] | None:
    """KDA layers (GLM-5.3-Flash, Kimi Linear): hook the forget-gate module."""
    gate = submodule(layer, "self_attn.forget_gate")
    return None if gate is None else (gate, kda_worst_channel)
