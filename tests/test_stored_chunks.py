"""Encoded chunks through a store: found by their tokens, bytes round-trip, bad entries are misses."""

from __future__ import annotations

import pytest
import torch

from hybridkv.cache.chunks import encode_chunk
from hybridkv.cache.stored_chunks import StoredChunkCache
from hybridkv.methods.chunked import execute_chunks, parse_pair
from hybridkv.store import open_store
from hybridkv.store.guarded import GuardedStore
from tests.conftest import random_tokens


@pytest.mark.parametrize("url", ["memory://", "file://{tmp}"])
@pytest.mark.parametrize("name", ["random-glm5-next", "random-qwen3-next"])
def test_a_stored_chunk_round_trips_and_answers_as_the_encoded_one(models, tmp_path, url, name):
    model = models[name]
    store = GuardedStore(open_store(url.format(tmp=tmp_path)))
    cache = StoredChunkCache(model, store, salt="tenant-a")
    vocab = model.config.vocab_size
    parts = [random_tokens(n, seed=60 + n, vocab=vocab) for n in (24, 31)]
    chunks = [encode_chunk(model, part) for part in parts]
    assert all(cache.put(chunk) for chunk in chunks)
    loaded = [cache.get(part, need_maps=True) for part in parts]
    for chunk, back in zip(chunks, loaded, strict=True):
        assert back is not None and torch.equal(back.tokens, chunk.tokens) and back.seam == chunk.seam
        assert back.nbytes() == chunk.nbytes()
        for layer, kv in chunk.kv.items():
            assert all(torch.equal(back.kv[layer][n], t) for n, t in kv.items())
        for layer, state in chunk.end_states.items():
            assert back.end_states[layer].equal(state)
        for layer, maps in chunk.maps.items():
            for slot, m in maps.items():
                assert torch.equal(back.maps[layer][slot].operator, m.operator)
                assert torch.equal(back.maps[layer][slot].offset, m.offset)
    question = random_tokens(5, seed=9, vocab=vocab)
    for pair in ("epic+compose", "position-corrected+linearkv"):
        want = execute_chunks(model, chunks, question, *parse_pair(pair)).logits
        got = execute_chunks(model, loaded, question, *parse_pair(pair)).logits
        assert torch.equal(got, want), pair


def test_misses_never_hand_back_a_wrong_chunk(models):
    model = models["random-qwen3-next"]
    store = GuardedStore(open_store("memory://"))
    cache = StoredChunkCache(model, store, salt="a")
    tokens = random_tokens(20, seed=1, vocab=model.config.vocab_size)
    plain = encode_chunk(model, tokens, with_maps=False)
    assert cache.get(tokens) is None  # nothing stored yet
    assert cache.put(plain)
    assert cache.get(tokens) is not None
    assert cache.get(tokens, need_maps=True) is None  # stored without the maps compose needs
    other = tokens.clone()
    other[7] = (other[7] + 1) % model.config.vocab_size
    assert cache.get(other) is None  # one token off: another key
    assert StoredChunkCache(model, store, salt="b").get(tokens) is None  # another tenant
    key = cache.key(tokens)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF
    store.put(key, bytes(data))
    assert cache.get(tokens) is None and store.stats()["corrupt"] == 1  # flipped bytes: refused, removed
    assert store.get(key) is None
