"""Caches written by one checkpoint and read by another: only by explicit opt-in, and only where they fit."""

from __future__ import annotations

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.cache.chunks import encode_chunk
from hybridkv.cache.keys import family_fingerprint, model_fingerprint
from hybridkv.cache.stored_chunks import StoredChunkCache
from hybridkv.eval.arena import ArenaPlan, read_rows, run_arena
from hybridkv.eval.contract import ArenaConfig, get_arena_method
from hybridkv.eval.workloads import rag
from hybridkv.models import load_model
from hybridkv.models.tokenizer import ByteTokenizer
from hybridkv.store import open_store
from hybridkv.store.guarded import GuardedStore
from tests.conftest import random_tokens


@pytest.fixture(scope="module")
def other_checkpoint():
    """A second checkpoint of random-nemotron-h: the same architecture and size, other weights."""
    return load_model("random-nemotron-h", seed=1)


def test_the_named_family_shares_entries_and_nothing_else_does(models, other_checkpoint):
    a, b = other_checkpoint, models["random-nemotron-h"]
    assert model_fingerprint(a) != model_fingerprint(b)
    assert family_fingerprint(a, "nemo") == family_fingerprint(b, "nemo") != family_fingerprint(b, "other")
    store = GuardedStore(open_store("memory://"))
    tokens = random_tokens(20, seed=2, vocab=a.config.vocab_size)
    StoredChunkCache(a, store, fingerprint=family_fingerprint(a, "nemo")).put(encode_chunk(a, tokens))
    assert StoredChunkCache(b, store).get(tokens) is None  # keyed by b's own weights: never a silent hit
    assert StoredChunkCache(b, store, fingerprint=family_fingerprint(b, "other")).get(tokens) is None
    shared = StoredChunkCache(b, store, fingerprint=family_fingerprint(b, "nemo")).get(tokens)
    assert shared is not None and shared.end_states[0].equal(encode_chunk(a, tokens).end_states[0])


def test_the_arena_builds_caches_with_the_named_checkpoint_and_answers_with_the_model(models, other_checkpoint):
    a, b = other_checkpoint, models["random-nemotron-h"]
    tokens = random_tokens(24, seed=3, vocab=b.config.vocab_size).tolist()
    for name in ("naive+linearkv", "zero-state"):
        method = get_arena_method(name, None)
        method.setup(b, ArenaConfig(cache_model=a))
        built = method.build_cache(tokens).handle
        own = get_arena_method(name, None)
        own.setup(b, ArenaConfig())
        mine = own.build_cache(tokens).handle
        if name == "zero-state":
            built_kv, own_kv = built.attention, mine.attention
        else:
            built_kv, own_kv = built.kv, mine.kv
        layer = b.description.attention_layers[0]
        assert not torch.equal(built_kv[layer]["keys"], own_kv[layer]["keys"])  # b's would be its own
        want = encode_chunk(a, torch.tensor(tokens), with_maps=False).kv[layer]["keys"]
        torch.testing.assert_close(built_kv[layer]["keys"], want, atol=1e-5, rtol=0)


def test_a_run_with_the_same_checkpoint_named_equals_a_plain_run(models, tmp_path):
    model, tokenizer = models["random-nemotron-h"], ByteTokenizer()
    (sample,) = rag.generate("rag", 2048, 1, tokenizer)
    plan = ArenaPlan("rag", ["naive+linearkv", "zero-state"])
    plain = read_rows(
        run_arena(model, tokenizer, [sample], plan, ArenaConfig(max_new_tokens=3), tmp_path / "a", rag.score, False)
    )
    named = read_rows(
        run_arena(model, tokenizer, [sample], plan, ArenaConfig(max_new_tokens=3, cache_model=model), tmp_path / "b",
                  rag.score, False)
    )  # fmt: skip
    assert [r["prediction"] for r in plain] == [r["prediction"] for r in named]
    assert {r["cache_model"] for r in named} == {"random-nemotron-h"} and {r["cache_model"] for r in plain} == {None}


def test_caches_of_another_architecture_are_refused_in_one_line(models):
    method = get_arena_method("naive+linearkv", None)
    with pytest.raises(HybridKVError, match="do not fit") as refusal:
        method.setup(models["random-nemotron-h"], ArenaConfig(cache_model=models["random-qwen3-next"]))
    assert "\n" not in str(refusal.value)
