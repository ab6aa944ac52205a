"""How fast each linear layer forgets, read off the model's own gates while a prompt is cached.

A linear layer's state after a window is its state before the window, decayed, plus what the
window wrote. For the delta-rule layers (KDA, Gated DeltaNet) one step is
S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ, with ‖k_t‖ = 1 (the kernels L2-normalise
k) and β_t ∈ (0, 1), so I − β_t k_t k_tᵀ is a contraction. A wrong starting state (zero instead of
the true S_s) therefore leaves an error at n of at most

    ‖S_n − S'_n‖ ≤ ‖S_s‖ · Π_{t∈[s,n)} max_c α_t,c = ‖S_s‖ · exp(Σ_t max_c log α_t,c)

per head: the slowest-forgetting channel decides. KDA's α is per key channel, GDN's per head.
Mamba-2's S_t = exp(Δ_t A) S_{t−1} + … decays a head's whole state by exp(Δ_t A): the same bound
with log α_t = Δ_t A, and there it is an equality.
That relative bound, maximised over layers and heads, is what adaptive-replay keeps below ε.

At capture time we add up max_c log α_t,c over each `DECAY_SPAN`-token span (absolute span
positions), per linear layer and head: a few KB per prompt, next to megabytes of KV.
The gates come from the model's own modules through forward hooks; each architecture's module
(`hybridkv.models.arch`) says which module to hook (`hybridkv.models.gates` reads it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybridkv.models.arch import architecture_for
from hybridkv.models.loader import HybridModel

DECAY_SPAN = 64  # tokens per summary row; a multiple of it is the stored KV block size


@dataclass(frozen=True)
class DecaySummary:
    """Per span c (tokens [c·S, (c+1)·S)): Σ over its tokens of max_c log α, per linear layer and head.

    A span is one row of the summary: `span` consecutive tokens at absolute positions, the
    granularity at which forgetting is recorded; `spans` is how many rows there are.
    """

    log_decay: torch.Tensor  # float32 [spans, linear layers, heads], every entry ≤ 0
    span: int = DECAY_SPAN

    def __post_init__(self) -> None:
        if self.log_decay.dim() != 3:
            raise ValueError(f"decay summary must be [spans, layers, heads], got {tuple(self.log_decay.shape)}")

    @property
    def spans(self) -> int:
        return self.log_decay.shape[0]

    def bound(self, start: int, end: int) -> float:
        """Upper bound on ‖error at end‖ / ‖state at start‖ when the state at `start` is replaced by zero.

        Only spans wholly inside [start, end) count (a partial span might forget less), so the
        bound is conservative; 0 when start is 0 (nothing is dropped).
        """
        if start == 0:
            return 0.0
        first, last = -(-start // self.span), min(end // self.span, self.spans)
        if last <= first:
            return 1.0
        per_head = self.log_decay[first:last].sum(0)  # [layers, heads]
        return math.exp(float(per_head.max()))

    def shortest_tail(self, end: int, tolerance: float, longest: int) -> tuple[int, float]:
        """The shortest replay tail t ≤ `longest` ending at `end` whose bound is below `tolerance`.

        Tails start on span boundaries. If none within `longest` qualifies, returns `longest`
        with its own bound: the caller's budget caps the work, and the bound says what it buys.
        """
        for start in range(end // self.span * self.span, end - longest - 1, -self.span):
            bound = self.bound(start, end)
            if bound < tolerance:
                return end - start, bound
        return longest, self.bound(end - longest, end)


@contextmanager
def record_decay(model: HybridModel) -> Iterator[list[list[torch.Tensor]] | None]:
    """While active, every forward appends each linear layer's per-token worst log-decay.

    Yields one list per linear layer (in `description.linear_layers` order) that collects
    [tokens, heads] tensors, or None when the architecture has no probe.
    """
    arch = architecture_for(model.config)
    find = arch.decay_probe if arch is not None else None
    probes = [find(model.backbone.layers[index]) if find else None for index in model.description.linear_layers]
    if any(probe is None for probe in probes):
        yield None
        return
    recorded: list[list[torch.Tensor]] = [[] for _ in probes]
    handles = [
        module.register_forward_hook(lambda _m, _i, out, p=probe, s=slot: recorded[s].append(p(out)))
        for slot, (module, probe) in enumerate(probes)
    ]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def summarise(recorded: list[list[torch.Tensor]], span: int = DECAY_SPAN) -> DecaySummary:
    """Sum the recorded per-token worst log-decays over whole spans."""
    per_layer = [torch.cat(parts) for parts in recorded]  # each [T, H]
    tokens = per_layer[0].shape[0]
    whole = tokens // span * span
    stacked = torch.stack([values[:whole] for values in per_layer], dim=1)  # [T', layers, H]
    return DecaySummary(stacked.view(whole // span, span, *stacked.shape[1:]).sum(1).contiguous(), span)
