"""Prefixes in a hybridkv store, in vLLM's own block layout: the connector's bytes, without vLLM.

vLLM's CPU attention keeps each block packed in an ISA-specific layout, so a block is stored and
restored whole, as opaque bytes, per attention layer. A block is stored under the key of its
prompt through the block's last token, with its tokens inside the entry, and listed in its slot
for readers whose prompt diverges inside it (`hybridkv.cache.variants`). Linear layers' states are
stored as raw pages too, as an exact checkpoint after a saved prompt's last token; the block entry
holding that position records it, so a lookup knows which checkpoints to ask for without probing
every position.

Every read is verified (codec checksum, model fingerprint, key, layout); anything missing or bad
just shortens the match.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import snapshot_download

from hybridkv.cache.block_codec import BlockCodec
from hybridkv.cache.keys import PrefixKeys, checkpoint_fingerprint
from hybridkv.errors import CorruptEntry, HybridKVError
from hybridkv.methods import Budget, PositionsMatch, RecoveryMethod
from hybridkv.store.base import Worth
from hybridkv.store.codec import Entry
from hybridkv.store.guarded import GuardedStore
from hybridkv.store.policy import KV_BLOCK, STATE

Pages = dict[str, torch.Tensor]  # layer name -> one block's (or state slot's) raw bytes, uint8
Layout = dict[str, int | None]  # layer name -> its page's bytes (None: not known on this side)


@dataclass
class PageMatch:
    """The longest stored prefix of a prompt, block by block."""

    length: int = 0  # tokens matched, at token granularity
    blocks: list[Pages] = field(default_factory=list)  # pages of the blocks covering [0, length)
    checkpoints: list[int] = field(default_factory=list)  # positions ≤ length where a state may be stored
    exact: list[bool] = field(default_factory=list)  # per block: computed exactly (see BlockStore)


def token_count(start: int, end: int) -> float:
    """A stand-in cost model: every token costs one (where the model's own cannot be built)."""
    return float(end - start)


@dataclass(frozen=True)
class EntryWorths:
    """What each entry a save writes is worth to a store whose capacity is kept by value
    (`hybridkv.store.base.Worth`), as `hybridkv trace-sim`'s hybridkv-value weighs it: a KV block
    the prefill compute of its tokens after those before it; a state at p either the whole prefill
    of [0, p) it restores (`tail` None: `save_states` "always") or only the tail replay it spares,
    the compute of [p − tail(p), p) ("value")."""

    prefill_flops: Callable[[int, int], float] = token_count  # FLOPs of [start, end) after [0, start)
    tail: Callable[[int], int] | None = None

    def block(self, start: int, end: int, parent: str | None) -> Worth:
        return Worth(KV_BLOCK, self.prefill_flops(start, end), parent)

    def state(self, position: int, parent: str | None) -> Worth:
        spared = position if self.tail is None else self.tail(position)
        return Worth(STATE, self.prefill_flops(position - spared, position), parent)


@dataclass(frozen=True)
class _Prompt:
    """A prompt as the block walk reads it: its namespace's keys, its chained block keys, its tokens."""

    keys: PrefixKeys
    chain: list[bytes]
    wanted: np.ndarray  # int64, all but the last token (one token is always left to compute)


@dataclass
class ResumePlan:
    """Where vLLM resumes a prompt: KV of [0, start) is loaded; linear states are `states` at
    `start` (an exact checkpoint) or zero (None), and vLLM prefills [start, end) itself."""

    matched: int
    start: int
    blocks: list[Pages]
    states: Pages | None
    exact: bool = True  # everything loaded was computed exactly: the resume equals a full prefill

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the pages it holds in memory (counted once: added and taken off the held total)."""
        pages = [*self.blocks, *([self.states] if self.states is not None else [])]
        return sum(t.numel() * t.element_size() for page in pages for t in page.values())


class BlockStore:
    """Blocks and states of one engine (`fingerprint`), in the namespace of the engine's `salt`;
    a request's own salt (vLLM's per-request `cache_salt`, one per tenant) opens a namespace inside
    it, so two tenants never read each other's pages.

    A prompt resumed from a zero state (a tail replay) computed its later KV and its final state
    approximately; what it saves is marked inexact, and a resume that loads anything inexact is
    reported as such, so an approximation never passes for an exact checkpoint turns later."""

    def __init__(
        self, store: GuardedStore, fingerprint: str, block_size: int, salt: str = "",
        worths: EntryWorths = EntryWorths(),
    ) -> None:  # fmt: skip
        self.store = store
        self.worths = worths
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.salt = salt
        self._namespaces: dict[str | None, PrefixKeys] = {}
        self._codec = BlockCodec(store, fingerprint, "vllm-kv", "vllm-state")

    def keys(self, request_salt: str | None = None) -> PrefixKeys:
        if request_salt not in self._namespaces:
            salt = self.salt if request_salt is None else json.dumps([self.salt, request_salt])
            self._namespaces[request_salt] = PrefixKeys(self.fingerprint, salt, self.block_size)
        return self._namespaces[request_salt]

    def block_keys(self, tokens: list[int], request_salt: str | None = None) -> list[str]:
        """Where each block of the prompt `tokens` is stored (its last one may be partial)."""
        keys = self.keys(request_salt)
        chain = keys.chain(tokens)
        return [
            self._codec.block_key(keys, tokens, index, chain) for index in range(-(-len(tokens) // self.block_size))
        ]

    def state_key(self, tokens: list[int], position: int, request_salt: str | None = None) -> str:
        return self._codec.state_key(self.keys(request_salt), tokens, position)

    # -- writing -----------------------------------------------------------------------------

    def save_blocks(
        self, tokens: list[int], first: int, pages: list[Pages], state_at: int | None = None, salt: str | None = None,
        exact: bool = True,
    ) -> int:  # fmt: skip
        """Store blocks first, first+1, ... of the prompt `tokens`; `state_at` marks a checkpoint
        stored at that position (inside the last block); `exact`: whether the prompt was computed
        exactly (block `first`, where its match ended, is then not written over when stored). Each
        block depends on the one before it. Returns how many writes succeeded."""
        keys = self.keys(salt)
        chain = keys.chain(tokens)
        written = 0
        parent = self._codec.block_key(keys, tokens, first - 1, chain) if first else None
        for index, block in enumerate(pages, start=first):
            start = index * self.block_size
            end = min(start + self.block_size, len(tokens))
            meta: dict = {"exact": exact}
            if state_at is not None and start < state_at <= end:
                meta["checkpoint"] = state_at
            key = self._codec.block_key(keys, tokens, index, chain)
            if not exact and index == first and self.store.contains(key):
                pass  # the block the match ended in, stored already: an approximation never replaces it
            elif self._codec.put_block(keys, chain, tokens, index, block, meta, self.worths.block(start, end, parent)):
                written += 1
            else:
                break  # a later block would depend on one not stored: no lookup reaches it
            parent = key
        return written

    def save_state(
        self, tokens: list[int], position: int, pages: Pages, salt: str | None = None, exact: bool = True
    ) -> bool:
        """Store the state checkpoint at `position`; it depends on the block holding that position.
        An approximate one (`exact` false) never replaces one stored there."""
        keys = self.keys(salt)
        if not exact and self.store.contains(self.state_key(tokens, position, salt)):
            return False
        parent = self._codec.block_key(keys, tokens[:position], (position - 1) // self.block_size)
        worth = self.worths.state(position, parent)
        return self._codec.put_state(keys, tokens, position, pages, {"exact": exact}, worth=worth)

    # -- reading -----------------------------------------------------------------------------

    def _read(self, key: str, kind: str) -> Entry | None:
        return self._codec.read(key, kind)

    def match(self, tokens: list[int], layout: Layout, salt: str | None = None) -> PageMatch:
        """The longest stored prefix of `tokens[:-1]` (one token is always left to compute).
        `layout` maps each attention layer to its block's byte size (None: any size, which the
        worker checks when it copies the page); entries that disagree are corrupt."""
        return self._match(self._prompt(tokens, salt), layout)

    def _prompt(self, tokens: list[int], salt: str | None) -> _Prompt:
        """The prompt as the walk reads it: all but its last token, with their chained keys."""
        keys, limit = self.keys(salt), len(tokens) - 1
        return _Prompt(keys, keys.chain(tokens[:limit]), np.asarray(tokens[:limit], dtype=np.int64))

    def _match(self, prompt: _Prompt, layout: Layout) -> PageMatch:

        def decode(key: str, entry: Entry, start: int) -> tuple[list[int], Entry]:
            stored = entry.meta.get("tokens")
            if not isinstance(stored, list) or not _fits(entry.tensors, layout):
                raise CorruptEntry("block does not match this engine's attention layout")
            return stored, entry

        walk = self._codec.walk.match(prompt.keys, prompt.chain, prompt.wanted, decode)
        found = PageMatch(walk.length)
        for block in walk.blocks:
            found.blocks.append(block.page.tensors)
            found.exact.append(block.page.meta.get("exact") is not False)
            checkpoint = block.page.meta.get("checkpoint")
            if isinstance(checkpoint, int) and block.start < checkpoint <= block.end:
                found.checkpoints.append(checkpoint)
        return found

    def resume(
        self, tokens: list[int], layout: Layout, state_layout: Layout, method: RecoveryMethod, budget: Budget,
        salt: str | None = None, horizon: int | None = None, alignment: int = 1,
    ) -> ResumePlan:  # fmt: skip
        """Everything needed to resume `tokens` as `method`'s recipe says: the match, the start, the
        pages to load. vLLM resumes at one position: KV of [0, start) loaded, the linear states at
        start a stored checkpoint or zero, and it prefills [start, end) itself, so the recipe's state
        position is the start (a method declares it may run so: `engine_resumable`). A `horizon` (the
        model's calibrated forgetting horizon, `hybridkv calibrate`) caps the budget's tail: the
        gates have forgotten the dropped state by then. The start is a multiple of `alignment`
        (GLM-5.3-Flash's indexer pool: no pool in progress at the start), so a checkpoint off that
        grid is not used and a zero-state start moves down onto it."""
        prompt = self._prompt(tokens, salt)
        found = self._match(prompt, layout)
        if horizon is not None:
            budget = Budget(tokens=min(horizon, budget.tail_tokens(found.length)))
        checkpoints = [c for c in found.checkpoints if c % alignment == 0] if method.uses_checkpoints else []
        first = method.recipe(PositionsMatch(found.length, tuple(checkpoints)), budget)
        if method.uses_checkpoints and not first.state_seed and found.length:
            # a shorter stored prompt this one extends (a shared document) may hold a state at its end
            ends = self._codec.walk.prompt_ends(
                prompt.keys, prompt.chain, prompt.wanted, first.state_position, found.length
            )
            checkpoints += [c for c in ends if c % alignment == 0]
        states, exact_states = None, False
        while True:  # the checkpoint the recipe picks, if it reads; else its pick among those left
            recipe = method.recipe(PositionsMatch(found.length, tuple(checkpoints)), budget)
            start = recipe.state_position
            if not recipe.state_seed:
                break
            entry = self._read(self.state_key(tokens, start, salt), "vllm-state")
            if entry is not None and _fits(entry.tensors, state_layout):
                states, exact_states = entry.tensors, entry.meta.get("exact") is not False
                break
            if entry is not None:  # gone (or never stored: a prompt end) is a miss; this is corrupt
                self.store.corrupt(self.state_key(tokens, start, salt), "state does not match this engine's layout")
            checkpoints.remove(start)
        if states is None:
            start -= start % alignment
        loaded = -(-start // self.block_size) if start else 0
        exact = start == 0 or (exact_states and all(found.exact[:loaded]))
        return ResumePlan(found.length, start, found.blocks[:loaded], states, exact)


def _sizes(pages: Pages) -> list[tuple[str, int]]:
    return [(name, int(page.numel() * page.element_size())) for name, page in pages.items()]


def _fits(pages: Pages, layout: Layout) -> bool:
    """The pages are the layout's layers, each of its size where the layout knows it."""
    sizes = dict(_sizes(pages))
    return sizes.keys() == layout.keys() and all(want in (None, sizes[name]) for name, want in layout.items())


def hub_snapshot(model: str, revision: str | None, cache_dir: str | None = None) -> Path:
    """The snapshot vLLM loaded for the Hugging Face repository `model` at `revision` ("main" when
    None), looked up in the local cache only: `cache_dir` (vLLM's --download-dir), else the hub's
    own. Refused in one line when it is not there."""
    try:
        return Path(snapshot_download(model, revision=revision or "main", cache_dir=cache_dir, local_files_only=True))
    except (OSError, ValueError) as error:  # not cached, or no repository name at all
        raise HybridKVError(
            f"HybridKVConnector cannot name the model {model!r} (revision {revision or 'main'}): it is neither a "
            f"local directory nor a snapshot in the Hugging Face cache ({type(error).__name__}); pass the "
            "checkpoint's local directory as the model"
        ) from error


def engine_fingerprint(
    model: str,
    layout: list[tuple[str, int, int, list[str]]],
    dtype: str,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> str:
    """Binds cached bytes to one model and one vLLM cache layout: hybridkv's one `fingerprint` of
    the checkpoint's files (`checkpoint_fingerprint`: its config and every byte of its weights,
    hashed once and kept beside them) in `dtype`, bound to `layout` (each KV-cache group as spec
    class, block size, page bytes, layer names).

    `model` is a local directory, or a name vLLM fetched from the Hugging Face hub: then the files
    of the snapshot it resolved (`hub_snapshot`, at `revision`, in `cache_dir`) and that snapshot's
    commit name it, so two revisions of one repository never read each other's pages. Pages keyed
    by the connector's earlier recipe (a recipe of its own; a fetched model by its name alone) are
    never read: a miss, recomputed once.
    """
    context = json.dumps(layout, sort_keys=True).encode()
    path = Path(model)
    if path.is_dir():
        return checkpoint_fingerprint(path, b"vllm-pages", context, dtype=dtype)
    snapshot = hub_snapshot(model, revision, cache_dir)
    return checkpoint_fingerprint(snapshot, b"vllm-pages", context, b"commit:" + snapshot.name.encode(), dtype=dtype)
