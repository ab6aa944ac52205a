"""A chunk encoded on its own, for position-independent reuse (retrieved passages, agent reports).

Attention layers can concatenate the KV of separately encoded chunks and repair it; a linear
layer has one state per chunk and nothing token-indexed to repair. What a chunk keeps for its
linear layers, besides its attention KV:

- `end_states`: every linear layer's state at the chunk's end from a zero start (conv windows
  included: the chunk's conv tail). One of these initialises a layer in LinearKV.
- `maps`: for exact composition (HYPIC), what the chunk does to each linear layer's recurrent
  state from its `seam` on: S_end = M · S_seam + B. Given the layer's inputs, every linear
  layer's recurrence is affine in its starting state (a delta rule's S ↦ (I − β k kᵀ) D S + β k vᵀ,
  Mamba-2's h ↦ exp(Δ·A) h + Δ B x), and the linear part acts on the state's axis −2 only: the key
  channels of GDN/KDA (M is d_k × d_k per head), Mamba-2's head channels (M is a product of scalar
  decays times the identity). Composition starts each chunk's map at its seam, after recomputing
  the first `seam` tokens with the previous chunk's conv tail, so the conv windows inside the map
  are the chunk's own.

M and B are read off the library's own forward, not re-derived: from the seam on, the chunk runs
as a batch whose rows share every layer's natural state except one layer's recurrent state,
which is zero in row 0 (giving B) and a slice of the identity in the others (giving M's
columns). So a family's maps need no code of its own, and one extra forward per linear layer is
the build cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv.cache.assemble import zero_states
from hybridkv.models.adapter import read_kv, read_states, write_kv, write_states
from hybridkv.models.kv import LinearState, LinearStates, PromptKV
from hybridkv.models.loader import HybridModel

DEFAULT_SEAM = 8  # tokens recomputed at each chunk start on composition (HYPIC's window)


@dataclass(frozen=True)
class StateMap:
    """S_end = operator · S_start + offset for one recurrent state of one linear layer."""

    operator: torch.Tensor  # [heads, P, P], acting on the state's axis -2
    offset: torch.Tensor  # [1, heads, P, Q]: the end state from a zero start

    def apply(self, state: torch.Tensor) -> torch.Tensor:
        """The end state from `state` ([rows, heads, P, Q]) at the start."""
        return torch.einsum("hij,bhjq->bhiq", self.operator, state.to(self.operator.dtype)) + self.offset

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.operator, self.offset))


@dataclass(frozen=True)
class EncodedChunk:
    tokens: torch.Tensor  # 1-D int64, the chunk alone (no header)
    kv: PromptKV  # its attention KV as encoded (after the header, if any)
    start: int  # the position its first token was encoded at (the header's length)
    end_states: LinearStates  # every linear layer's state at the chunk's end, from a zero start
    seam: int  # where the maps start
    maps: dict[int, dict[str, StateMap]]  # linear layer -> recurrent slot -> what [seam, end) does to it

    def __len__(self) -> int:
        return self.tokens.numel()

    def nbytes(self) -> dict[str, int]:
        """Bytes of each part: attention KV, end states (recurrent and conv tails), composition maps."""
        conv = sum(t.nbytes for s in self.end_states.values() for n, t in s.tensors.items() if n.startswith("conv"))
        states = sum(state.nbytes for state in self.end_states.values())
        return {
            "attention_kv": self.kv.nbytes,
            "end_states": states - conv,
            "conv_tails": conv,
            "operators": sum(m.nbytes for maps in self.maps.values() for m in maps.values()),
        }


def _rows(kv: PromptKV, states: LinearStates, rows: int) -> tuple[PromptKV, LinearStates]:
    """`rows` copies of one sequence's KV and states, as a batch."""
    expanded = kv.map(lambda _name, t, _dim: t.expand(rows, *t.shape[1:]).contiguous())
    return expanded, {i: s.map(lambda t: t.expand(rows, *t.shape[1:]).contiguous()) for i, s in states.items()}


def _basis_starts(state: torch.Tensor) -> torch.Tensor:
    """Row 0 zero, then ceil(P / Q) rows whose [P, Q] slices of the identity span the axis M acts on."""
    _, heads, p, q = state.shape
    starts = torch.zeros((1 + math.ceil(p / q), heads, p, q), dtype=state.dtype, device=state.device)
    for column in range(p):
        starts[1 + column // q, :, column, column % q] = 1
    return starts


def state_map(
    model: HybridModel,
    tokens: torch.Tensor,
    start: int,
    kv: PromptKV,
    states: LinearStates,
    layer: int,
    slot: str,
) -> StateMap:
    """What running `tokens` (positions start, start+1, …) after `kv` and `states` does to `layer`'s
    recurrent `slot`, with every other layer's state and every layer's input as they are."""
    starts = _basis_starts(states[layer][slot])
    rows = starts.shape[0]
    batch_kv, batch_states = _rows(kv, states, rows)
    batch_states[layer] = LinearState({**batch_states[layer].tensors, slot: starts})
    cache = model.new_cache()
    if kv:
        write_kv(cache, batch_kv)
    write_states(cache, batch_states)
    positions = torch.arange(start, start + tokens.numel()).expand(rows, -1)
    model.forward_batch(tokens.expand(rows, -1), cache, positions, None)
    ends = read_states(model.description, cache)[layer][slot].float()
    offset = ends[:1]
    _, heads, p, q = offset.shape
    operator = torch.empty((heads, p, p), dtype=offset.dtype, device=offset.device)
    for column in range(p):
        operator[:, :, column] = ends[1 + column // q, :, :, column % q] - offset[0, :, :, column % q]
    return StateMap(operator, offset)


def encode_chunk(
    model: HybridModel,
    tokens: torch.Tensor,
    header: torch.Tensor | None = None,
    seam: int = DEFAULT_SEAM,
    with_maps: bool = True,
) -> EncodedChunk:
    """Encode `tokens` on their own (after `header`, whose KV is not kept), from zero states.

    `with_maps`: also read each linear layer's map from the seam on (one extra forward per layer).
    """
    tokens = tokens.reshape(-1).to(torch.long)
    header = torch.empty(0, dtype=torch.long) if header is None else header.reshape(-1).to(torch.long)
    if not 0 <= seam < tokens.numel():
        raise ValueError(f"seam {seam} must lie inside the chunk's {tokens.numel()} tokens")
    cache = model.new_cache()
    head = torch.cat([header, tokens[:seam]])
    if head.numel():
        model.forward(head, cache, start=0)
    kv_seam = read_kv(model.description, cache).clone() if head.numel() else PromptKV({})
    states_seam = read_states(model.description, cache) if head.numel() else None
    model.forward(tokens[seam:], cache, start=head.numel())
    kv = read_kv(model.description, cache).narrow(header.numel(), header.numel() + tokens.numel()).clone()
    end_states = read_states(model.description, cache)
    maps: dict[int, dict[str, StateMap]] = {}
    if with_maps:
        if states_seam is None:  # no header and no seam: the map starts at the first token
            states_seam = zero_states(model)
        rest = tokens[seam:]
        for layer, state in states_seam.items():
            maps[layer] = {
                name: state_map(model, rest, head.numel(), kv_seam, states_seam, layer, name)
                for name in state.tensors
                if name.startswith("recurrent")
            }
    return EncodedChunk(tokens, kv, header.numel(), end_states, seam, maps)


def compose(maps: list[StateMap], start: torch.Tensor) -> torch.Tensor:
    """One layer's state after chunks applied in order from `start` (their maps composed)."""
    state = start
    for state_map_ in maps:
        state = state_map_.apply(state)
    return state
