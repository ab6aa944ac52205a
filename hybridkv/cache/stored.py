"""A prefix cache whose bytes live in a store, shared by every process that opens the same URL.

Writing a cached prompt puts one entry per C-token block of attention KV (with the block's tokens
and its rows of the linear layers' decay summary), keyed by the prompt through the block's last
token, and one per linear-state checkpoint. Looking a prompt up walks its blocks through the store
(`hybridkv.cache.prefix_walk`): the blocks it holds whole are found by their keys; the block where
it diverges from every stored prompt is the listed one after the same prefix sharing the most
tokens with it (`hybridkv.cache.variants`), so prompts that share a start and then differ inside a
block each keep theirs. Stored tokens are always compared with the prompt's, and the walk stops at
the first differing token — a token-level match that needs no shared index. Anything missing,
unreadable or failing verification ends the walk there: the hit gets shorter and the rest is
recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.block_codec import BlockCodec
from hybridkv.cache.keys import PrefixKeys, model_fingerprint
from hybridkv.cache.prefix_cache import CachedMatch
from hybridkv.cache.prompt import CachedPrompt, LinearState, LinearStates, PromptKV
from hybridkv.errors import CorruptEntry
from hybridkv.models.decay import DECAY_SPAN, DecaySummary
from hybridkv.models.kv import LayerKV
from hybridkv.models.loader import HybridModel
from hybridkv.store.codec import Entry
from hybridkv.store.guarded import GuardedStore

DEFAULT_BLOCK_TOKENS = 64


@dataclass
class _Block:
    """What a stored block holds besides its tokens."""

    kv: PromptKV  # attention KV
    decay: tuple[torch.Tensor, int] | None  # its rows of the decay summary and their span size, if written


class StoredPrefixCache:
    def __init__(
        self,
        model: HybridModel,
        store: GuardedStore,
        salt: str = "",
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        checkpoint_interval: int | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.keys = PrefixKeys(self.fingerprint, salt, block_tokens)
        self.checkpoint_interval = checkpoint_interval
        self._dims = {index: model.description.token_tensors(index) for index in model.description.attention_layers}
        self._codec = BlockCodec(store, self.fingerprint, "kv", "state")

    def block_key(self, tokens, index: int) -> str:
        """Where block `index` of the prompt `tokens` is stored: the key of the prompt through its last token."""
        return self._codec.block_key(self.keys, tokens, index)

    # -- writing -----------------------------------------------------------------------------

    def add(self, cached: CachedPrompt) -> int:
        """Write a cached prompt's KV blocks and checkpoints; returns how many writes succeeded."""
        tokens = cached.tokens
        chain = self.keys.chain(tokens)
        size = self.keys.block_tokens
        written = 0
        for index, start in enumerate(range(0, len(tokens), size)):
            end = min(start + size, len(tokens))
            block = cached.attention.narrow(start, end)
            tensors = {f"{layer}.{name}": tensor for layer, kv in block.items() for name, tensor in kv.tensors.items()}
            meta = {}
            if cached.decay is not None:
                # Each summary row rides along with the block holding its last token, so the rows of
                # consecutive blocks concatenate in order whatever the block size.
                tensors["decay"] = cached.decay.log_decay[start // cached.decay.span : end // cached.decay.span]
                meta["decay_chunk"] = cached.decay.span
            written += self._codec.put_block(self.keys, chain, tokens, index, tensors, meta)
        for position, states in cached.checkpoints.items():
            tensors = {f"{layer}.{name}": t for layer, state in states.items() for name, t in state.tensors.items()}
            written += self._codec.put_state(self.keys, tokens, position, tensors, chain=chain)
        return written

    # -- reading -----------------------------------------------------------------------------

    def _read(self, key: str, kind: str) -> Entry | None:
        return self._codec.read(key, kind)

    def _kv_block(self, key: str, entry: Entry, start: int) -> tuple[list[int], _Block]:
        """The tokens and pages of the block stored under `key` at `start` (`PrefixWalk`'s decode)."""
        tokens = entry.meta.get("tokens")
        # Entries written before the summary's span size was recorded all used DECAY_SPAN.
        decay, decay_span = entry.tensors.get("decay"), entry.meta.get("decay_chunk", DECAY_SPAN)
        try:
            layers = {
                layer: {name: entry.tensors[f"{layer}.{name}"] for name in dims} for layer, dims in self._dims.items()
            }
            consistent = (
                entry.meta.get("start") == start
                and isinstance(tokens, list)
                and all(
                    layers[layer][name].shape[dim] == len(tokens)
                    for layer, dims in self._dims.items()
                    for name, dim in dims.items()
                )
            )
            kv = PromptKV({layer: LayerKV(layers[layer], dims) for layer, dims in self._dims.items()})
            consistent = consistent and (
                decay is None
                or (
                    isinstance(decay_span, int)
                    and decay_span > 0
                    and decay.dim() == 3
                    and decay.shape[0] == (start + len(tokens)) // decay_span - start // decay_span
                    and decay.shape[1] == len(self.model.description.linear_layers)
                )
            )
        except KeyError:
            consistent = False
        if not consistent:
            raise CorruptEntry("tensors do not match this model's attention layout or the block's tokens")
        return tokens, _Block(kv, (decay, decay_span) if decay is not None else None)

    def _checkpoint(self, prompt: torch.Tensor, position: int, chain: list[bytes]) -> LinearStates | None:
        key = self._codec.state_key(self.keys, prompt, position, chain)
        entry = self._read(key, "state")
        if entry is None:
            return None
        try:
            linear = [spec for spec in self.model.description.layers if spec.state_tensors]
            states = {
                spec.index: LinearState(
                    {name: entry.tensors[f"{spec.index}.{name}"] for name, _shape, _dtype in spec.state_tensors}
                )
                for spec in linear
            }
            consistent = all(
                tuple(states[spec.index][name].shape) == shape
                for spec in linear
                for name, shape, _dtype in spec.state_tensors
            )
        except KeyError:
            consistent = False
        if not consistent:
            self.store.corrupt(key, "states do not match this model's linear layers")
            return None
        return states

    def lookup(self, prompt: torch.Tensor) -> CachedMatch | None:
        """The longest stored prefix of `prompt` (never its last token), with the checkpoint at or before it."""
        prompt = prompt.reshape(-1)
        limit = prompt.numel() - 1
        chain = self.keys.chain(prompt[:limit])
        found = self._codec.walk.match(self.keys, chain, prompt[:limit].numpy(), self._kv_block)
        matched = found.length
        if matched == 0:
            return None
        attention = PromptKV.cat([block.page.kv for block in found.blocks])
        checkpoints = {}
        if self.checkpoint_interval:
            position = matched // self.checkpoint_interval * self.checkpoint_interval
            states = self._checkpoint(prompt, position, chain) if position > 0 else None
            if states is not None:
                checkpoints[position] = states
        tokens = torch.tensor([t for block in found.blocks for t in block.tokens], dtype=torch.long)
        block_decay = [block.page.decay for block in found.blocks]
        decay = None  # blocks written without a summary (an architecture without a gate probe) give none
        if all(d is not None for d in block_decay) and len({size for _, size in block_decay}) == 1:
            decay = DecaySummary(torch.cat([rows for rows, _ in block_decay]), block_decay[0][1])
        return CachedMatch(CachedPrompt(tokens, attention, checkpoints, self.checkpoint_interval, decay), matched)
