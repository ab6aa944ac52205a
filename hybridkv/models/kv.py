"""What hybridkv keeps of a prompt, as typed containers that know their own token dimensions.

- `LayerKV`: one attention layer's token-indexed tensors (keys, values, and for DSA layers the
  indexer's packed keys), each with the dimension that counts tokens;
- `PromptKV`: those of every attention layer, sliceable by token range without the model;
- `LinearState`: one linear layer's state after some token — its short-conv windows and
  recurrent / SSM states, by slot (`conv.0`, `recurrent.0`, …; most layers have one slot, some
  have several conv windows, short-conv layers have no recurrent state).

Only `hybridkv.models.adapter` moves these in and out of a transformers cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's token-indexed tensors, by name, and each one's token dimension."""

    tensors: Mapping[str, torch.Tensor]
    token_dims: Mapping[str, int]

    def __post_init__(self) -> None:
        if set(self.tensors) != set(self.token_dims):
            raise ValueError(f"tensors {sorted(self.tensors)} do not match token dims {sorted(self.token_dims)}")
        lengths = {name: t.shape[self.token_dims[name]] for name, t in self.tensors.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"token-indexed tensors of one layer disagree on length: {lengths}")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def __len__(self) -> int:
        """Tokens held."""
        name = next(iter(self.tensors))
        return self.tensors[name].shape[self.token_dims[name]]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensors.values())

    def narrow(self, start: int, end: int) -> LayerKV:
        """Views (no copies) of tokens [start, end)."""
        return LayerKV(
            {name: t.narrow(self.token_dims[name], start, end - start) for name, t in self.tensors.items()},
            self.token_dims,
        )

    def map(self, fn) -> LayerKV:
        """The same layer with `fn(name, tensor, token_dim)` applied to every tensor."""
        return LayerKV({name: fn(name, t, self.token_dims[name]) for name, t in self.tensors.items()}, self.token_dims)


@dataclass(frozen=True)
class PromptKV:
    """The attention KV of a token range of a prompt: attention layer index -> `LayerKV`."""

    layers: Mapping[int, LayerKV]

    def __post_init__(self) -> None:
        lengths = {index: len(layer) for index, layer in self.layers.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"attention layers disagree on how many tokens they hold: {lengths}")

    def __getitem__(self, index: int) -> LayerKV:
        return self.layers[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def __bool__(self) -> bool:
        return bool(self.layers) and len(self) > 0

    def __len__(self) -> int:
        """Tokens held (0 for no layers)."""
        return len(next(iter(self.layers.values()))) if self.layers else 0

    def keys(self):
        return self.layers.keys()

    def items(self):
        return self.layers.items()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

    def narrow(self, start: int, end: int) -> PromptKV:
        """Views (no copies) of tokens [start, end)."""
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"tokens [{start}, {end}) asked from KV of {len(self)} tokens")
        return PromptKV({index: layer.narrow(start, end) for index, layer in self.layers.items()})

    def map(self, fn) -> PromptKV:
        """`fn(name, tensor, token_dim)` applied to every tensor of every layer."""
        return PromptKV({index: layer.map(fn) for index, layer in self.layers.items()})

    def clone(self) -> PromptKV:
        return self.map(lambda _name, t, _dim: t.clone())

    def row(self, row: int) -> PromptKV:
        """Batch row `row` (views)."""
        return self.map(lambda _name, t, _dim: t[row : row + 1])

    @classmethod
    def cat(cls, parts: list[PromptKV]) -> PromptKV:
        """Consecutive token ranges joined into one (the layers of `parts[0]` decide the layout)."""
        first = parts[0]
        return cls(
            {
                index: LayerKV(
                    {
                        name: torch.cat([p[index][name] for p in parts], dim=dim)
                        for name, dim in layer.token_dims.items()
                    },
                    layer.token_dims,
                )
                for index, layer in first.items()
            }
        )


@dataclass(frozen=True)
class LinearState:
    """One linear layer's state after some token: tensors named `conv.<slot>` and `recurrent.<slot>`."""

    tensors: Mapping[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensors.values())

    def map(self, fn) -> LinearState:
        return LinearState({name: fn(t) for name, t in self.tensors.items()})

    def clone(self) -> LinearState:
        return self.map(torch.clone)

    def row(self, row: int) -> LinearState:
        return self.map(lambda t: t[row : row + 1])

    def equal(self, other: LinearState) -> bool:
        return self.tensors.keys() == other.tensors.keys() and all(
            torch.equal(t, other.tensors[name]) for name, t in self.tensors.items()
        )

    @classmethod
    def cat(cls, rows: list[LinearState]) -> LinearState:
        """Batch rows stacked (every row has the same slots)."""
        return cls({name: torch.cat([row[name] for row in rows]) for name in rows[0].tensors})


# linear layer index -> its state
LinearStates = dict[int, LinearState]
