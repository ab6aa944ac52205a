"""Encoded chunks in a store, found by their tokens wherever they sit in a prompt.

One entry per chunk, under its position-independent key (model fingerprint + salt + the
chunk's tokens, `PrefixKeys.chunk`): its tokens, its attention KV, every linear layer's end
state, and its composition maps where it was encoded with them. A reader compares the stored
tokens with its own and verifies the entry (`hybridkv.store.codec`); a missing, unreadable or
mismatched entry is a miss and the chunk is encoded again, never a wrong chunk.
"""

from __future__ import annotations

import torch

from hybridkv.cache.chunks import EncodedChunk, StateMap
from hybridkv.cache.keys import PrefixKeys, model_fingerprint
from hybridkv.models.kv import LayerKV, LinearState, PromptKV
from hybridkv.models.loader import HybridModel
from hybridkv.store.codec import Entry, encode
from hybridkv.store.guarded import GuardedStore

KIND = "chunk"


class StoredChunkCache:
    def __init__(self, model: HybridModel, store: GuardedStore, salt: str = "", fingerprint: str | None = None) -> None:
        self.model = model
        self.store = store
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.keys = PrefixKeys(self.fingerprint, salt)

    def key(self, tokens: torch.Tensor) -> str:
        return self.keys.chunk(tokens.reshape(-1)).hex()

    def put(self, chunk: EncodedChunk) -> bool:
        tensors: dict[str, torch.Tensor] = {"tokens": chunk.tokens}
        for layer, kv in chunk.kv.items():
            tensors.update({f"kv.{layer}.{name}": t for name, t in kv.items()})
        for layer, state in chunk.end_states.items():
            tensors.update({f"state.{layer}.{name}": t for name, t in state.tensors.items()})
        for layer, maps in chunk.maps.items():
            for slot, state_map in maps.items():
                tensors[f"map.{layer}.{slot}.operator"] = state_map.operator
                tensors[f"map.{layer}.{slot}.offset"] = state_map.offset
        key = self.key(chunk.tokens)
        meta = {"start": chunk.start, "seam": chunk.seam}
        return self.store.put(key, encode(Entry(KIND, self.fingerprint, key, meta, tensors)))

    def get(self, tokens: torch.Tensor, need_maps: bool = False) -> EncodedChunk | None:
        """The stored chunk of exactly these tokens (with maps, if `need_maps`), or None."""
        tokens = tokens.reshape(-1).to(torch.long)
        key = self.key(tokens)
        entry = self.store.read_entry(key, KIND, self.fingerprint)
        if entry is None or not torch.equal(entry.tensors.get("tokens", torch.empty(0)), tokens):
            return None
        description = self.model.description
        try:
            kv = PromptKV(
                {
                    layer: LayerKV(
                        {name: entry.tensors[f"kv.{layer}.{name}"] for name in description.token_tensors(layer)},
                        description.token_tensors(layer),
                    )
                    for layer in description.attention_layers
                }
            )
            states = {
                spec.index: LinearState(
                    {name: entry.tensors[f"state.{spec.index}.{name}"] for name, *_ in spec.state_tensors}
                )
                for spec in description.layers
                if spec.state_tensors
            }
            maps = {
                layer: {
                    name: StateMap(
                        entry.tensors[f"map.{layer}.{name}.operator"], entry.tensors[f"map.{layer}.{name}.offset"]
                    )
                    for name in state.tensors
                    if name.startswith("recurrent")
                }
                for layer, state in states.items()
                if f"map.{layer}.recurrent.0.operator" in entry.tensors
            }
            start, seam = int(entry.meta["start"]), int(entry.meta["seam"])
        except (KeyError, TypeError, ValueError) as err:
            self.store.corrupt(key, f"chunk entry does not fit this model ({err})")
            return None
        if len(kv) != tokens.numel() or (need_maps and set(maps) != set(states)):
            return None
        return EncodedChunk(tokens, kv, start, states, seam, maps)
