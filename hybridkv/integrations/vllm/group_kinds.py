"""One manager per kind of vLLM KV-cache group, as vLLM keeps one per spec kind (`classify_groups`
says which group is which): which of a request's blocks a load writes and a save reads (the
scheduler side), and how the worker restores and copies them.

- `AttentionBlocks`: per-token KV (full attention, MLA with its indexer pages), stored and loaded
  whole, block by block, over [0, start).
- `StateSlots`: one linear state per request (Mamba, KDA, GDN, ...): the stored state at start, or
  zeros; saved from the request's slot once its prompt is complete.
- `RingBlocks`: the ring of a pool in progress (GLM-5.3-Flash's DSA tail): never stored, cleared on
  a load, which starts on the pool grid (vLLM's prefill of the rest refills it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridkv.integrations.vllm.block_store import Pages
from hybridkv.integrations.vllm.metadata import LoadOp, SaveOp


class CachePages(Protocol):
    """The worker's KV-cache pages, as the kinds reach them (`worker_side.WorkerSide`)."""

    def page(self, layer: str, block: int) -> torch.Tensor: ...  # one layer's page of a block, as bytes
    def restore_page(self, layer: str, block: int, stored: torch.Tensor) -> None: ...
    def clear_block(self, layer: str, block: int) -> None: ...


@dataclass
class Snapshot:
    """A saved prompt's pages, copied out of vLLM's cache for the background write."""

    blocks: list[Pages] = field(default_factory=list)  # from the save's first block on
    states: Pages = field(default_factory=dict)  # the linear states at the prompt's end


class GroupKind:
    """The groups of one kind: group -> its layers."""

    def __init__(self, groups: dict[int, list[str]]) -> None:
        self.groups = groups

    def load_targets(self, block_ids: tuple[list[int], ...], loaded_blocks: int) -> dict[int, list[int]]:
        """Each group's blocks that a load of `loaded_blocks` stored blocks writes."""
        raise NotImplementedError

    def save_sources(self, block_ids: list[list[int]], prompt_blocks: int, states: bool) -> dict[int, list[int]]:
        """Each group's blocks a save of a `prompt_blocks`-block prompt reads (`states`: save states)."""
        return {}

    def restore(self, pages: CachePages, group: int, ids: list[int], load: LoadOp) -> None:
        raise NotImplementedError

    def copy_out(self, pages: CachePages, group: int, ids: list[int], save: SaveOp, into: Snapshot) -> None:
        pass


class AttentionBlocks(GroupKind):
    def load_targets(self, block_ids, loaded_blocks):
        return {g: list(block_ids[g][:loaded_blocks]) for g in self.groups}

    def save_sources(self, block_ids, prompt_blocks, states):
        return {g: block_ids[g][:prompt_blocks] for g in self.groups}

    def restore(self, pages, group, ids, load):
        for block, stored in zip(ids, load.blocks, strict=True):
            for layer in self.groups[group]:
                pages.restore_page(layer, block, stored[layer])

    def copy_out(self, pages, group, ids, save, into):
        count = len(ids) - save.first_block
        into.blocks += [{} for _ in range(count - len(into.blocks))]
        for index, block in enumerate(ids[save.first_block :]):
            for layer in self.groups[group]:
                into.blocks[index][layer] = pages.page(layer, block).clone()


class StateSlots(GroupKind):
    def load_targets(self, block_ids, loaded_blocks):
        return {g: [block_ids[g][0]] for g in self.groups}

    def save_sources(self, block_ids, prompt_blocks, states):
        return {g: [block_ids[g][0]] for g in self.groups} if states else {}

    def restore(self, pages, group, ids, load):
        (slot,) = ids
        for layer in self.groups[group]:
            if load.states is not None:
                pages.restore_page(layer, slot, load.states[layer])
            else:
                pages.page(layer, slot).zero_()

    def copy_out(self, pages, group, ids, save, into):
        (slot,) = ids
        into.states |= {layer: pages.page(layer, slot).clone() for layer in self.groups[group]}


class RingBlocks(GroupKind):
    def load_targets(self, block_ids, loaded_blocks):
        return {g: [block_ids[g][0]] for g in self.groups if block_ids[g]}

    def restore(self, pages, group, ids, load):
        for layer in self.groups[group]:
            for block in ids:
                pages.clear_block(layer, block)
