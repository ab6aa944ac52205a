"""Prefix matching, cached prompts, state checkpoints and cache assembly; budget parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import HybridKVError
from hybridkv.cache import (
    CachedPrompt,
    PrefixCache,
    PrefixIndex,
    assemble_cache,
    capture_prompt,
)
from hybridkv.methods import Budget
from hybridkv.models import RANDOM_MODELS
from hybridkv.models.adapter import read_kv, read_states
from tests.helpers import lcp

NAMES = list(RANDOM_MODELS)

# ---------------------------------------------------------------------------------------------
# PrefixIndex / PrefixCache: brute force is the oracle.


def _check_match(sequences: list[list[int]], result: tuple[int | None, int], query: list[int]) -> None:
    best = max((lcp(seq, query) for seq in sequences), default=0)
    entry, length = result
    assert length == best
    if best == 0:
        assert entry is None
    else:
        assert entry is not None and 0 <= entry < len(sequences)
        assert lcp(sequences[entry], query) == best


_tokens = st.lists(st.integers(0, 2), max_size=10)  # 3 symbols: prefixes collide constantly


@st.composite
def _insertions(draw):
    """Sequences to insert, many of them prefixes, extensions or duplicates of earlier ones."""
    sequences: list[list[int]] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["new", "prefix", "duplicate", "extension"])) if sequences else "new"
        if kind == "new":
            seq = draw(_tokens)
        else:
            base = draw(st.sampled_from(sequences))
            if kind == "prefix":
                seq = base[: draw(st.integers(0, len(base)))]
            elif kind == "duplicate":
                seq = list(base)
            else:
                seq = base + draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))
        sequences.append(seq)
    return sequences


@st.composite
def _queries(draw, sequences):
    out = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["random", "prefix", "extension", "mutated"]))
        if kind == "random" or not sequences:
            out.append(draw(_tokens))
            continue
        base = draw(st.sampled_from(sequences))
        if kind == "prefix":
            out.append(base[: draw(st.integers(0, len(base)))])
        elif kind == "extension":
            out.append(base + draw(_tokens))
        else:
            q = list(base)
            if q:
                i = draw(st.integers(0, len(q) - 1))
                q[i] = (q[i] + draw(st.integers(1, 2))) % 3
            out.append(q)
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_prefix_index_longest_match_is_brute_forcelcp(data):
    sequences = data.draw(_insertions())
    index = PrefixIndex()
    inserted: list[list[int]] = []
    for entry_id, seq in enumerate(sequences):
        index.insert(np.array(seq, dtype=np.int64), entry_id)
        inserted.append(seq)
        # after every insertion, not only at the end: splits must keep earlier entries findable
        for query in data.draw(_queries(inserted)):
            _check_match(inserted, index.longest_match(np.array(query, dtype=np.int64)), query)
    for seq in sequences:  # every inserted sequence matches itself in full
        assert index.longest_match(np.array(seq, dtype=np.int64))[1] == len(seq)


def test_prefix_index_empty():
    index = PrefixIndex()
    assert index.longest_match(np.array([1, 2, 3])) == (None, 0)
    index.insert(np.array([4, 5]), 0)
    assert index.longest_match(np.array([1, 2, 3])) == (None, 0)
    assert index.longest_match(np.array([], dtype=np.int64)) == (None, 0)


def _cached(tokens) -> CachedPrompt:
    return CachedPrompt(torch.tensor(tokens, dtype=torch.long), attention={})


@settings(max_examples=200, deadline=None)
@given(cached=st.lists(_tokens, min_size=1, max_size=6), prompt=_tokens)
def test_prefix_cache_lookup_leaves_the_last_token(cached, prompt):
    store = PrefixCache()
    entries = [_cached(seq) for seq in cached]
    for i, entry in enumerate(entries):
        assert store.add(entry) == i
    assert len(store) == len(cached)
    hit = store.lookup(torch.tensor(prompt, dtype=torch.long))
    best = max(lcp(seq, prompt[:-1]) for seq in cached)
    if best == 0:
        assert hit is None
        return
    assert hit is not None
    assert hit.length == best
    assert hit.length <= len(prompt) - 1
    assert any(hit.cached is entry for entry in entries)
    assert hit.cached.tokens[: hit.length].tolist() == prompt[: hit.length]


def test_prefix_cache_identical_prompt_is_matched_up_to_its_last_token():
    store = PrefixCache()
    tokens = list(range(3, 40))
    store.add(_cached(tokens))
    hit = store.lookup(torch.tensor(tokens))
    assert hit is not None and hit.length == len(tokens) - 1
    longer = store.lookup(torch.tensor(tokens + [7, 8]))
    assert longer is not None and longer.length == len(tokens)
    assert store.lookup(torch.tensor(tokens[:1])) is None  # nothing may be taken from a 1-token prompt


# ---------------------------------------------------------------------------------------------
# CachedPrompt and capture_prompt on the real tiny models.


def _token_dim(tensor: torch.Tensor, n_tokens: int) -> int:
    dims = [d for d, size in enumerate(tensor.shape) if size == n_tokens]
    assert len(dims) == 1, f"cannot tell the token dimension of {tuple(tensor.shape)}"
    return dims[0]


@pytest.mark.parametrize("name", NAMES)
def test_kv_prefix_is_a_view_of_the_first_n_tokens(models, make_workload, name):
    model = models[name]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=45, seed=1)
    cached = capture_prompt(model, tokens)
    assert len(cached) == 45
    assert set(cached.attention) == set(model.description.attention_layers)
    for n in (0, 1, 17, 45):
        prefix = cached.kv_prefix(n)
        assert prefix.keys() == cached.attention.keys()
        for layer, tensors in cached.attention.items():
            assert prefix[layer].keys() == tensors.keys()
            for tensor_name, full in tensors.items():
                part = prefix[layer][tensor_name]
                dim = _token_dim(full, 45)
                expected = full.index_select(dim, torch.arange(n))
                assert part.shape == expected.shape
                assert torch.equal(part, expected)
                if n > 0:  # a view: same storage, same start, nothing copied
                    assert part.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                    assert part.data_ptr() == full.data_ptr()
    with pytest.raises(ValueError):
        cached.kv_prefix(46)


@pytest.mark.parametrize(
    ("length", "interval"),
    [(50, 7), (49, 7), (48, 16), (10, 16), (16, 16), (12, 1), (33, 32)],
)
def test_capture_checkpoint_positions(models, make_workload, length, interval):
    model = models["random-nemotron-h"]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=length, seed=2)
    cached = capture_prompt(model, tokens, checkpoint_interval=interval)
    expected = {k * interval for k in range(1, length // interval + 1)}
    assert set(cached.checkpoints) == expected
    assert all(0 < p <= length for p in cached.checkpoints)
    assert cached.checkpoint_interval == interval
    for states in cached.checkpoints.values():
        assert set(states) == set(model.description.linear_layers)
    assert cached.state_bytes() == len(expected) * model.description.state_bytes
    assert cached.kv_bytes() == length * model.description.kv_bytes_per_token


def test_capture_without_interval_keeps_no_state(models, make_workload):
    model = models["random-nemotron-h"]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=40, seed=3)
    cached = capture_prompt(model, tokens)
    assert cached.checkpoints == {} and cached.state_bytes() == 0
    assert cached.last_checkpoint_at_or_before(40) is None
    with pytest.raises(ValueError):
        capture_prompt(model, tokens, checkpoint_interval=0)


def test_last_checkpoint_at_or_before(models, make_workload):
    model = models["random-nemotron-h"]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=50, seed=4)
    cached = capture_prompt(model, tokens, checkpoint_interval=16)
    for position in range(0, 60):
        expected = max((p for p in (16, 32, 48) if p <= position), default=None)
        assert cached.last_checkpoint_at_or_before(position) == expected


def _single_pass(model, tokens: torch.Tensor, logits_to_keep: int = 0):
    cache = model.new_cache()
    logits = model.forward(tokens, cache, start=0, logits_to_keep=logits_to_keep)
    return cache, logits


# glm5's sparse attention is chunk-invariant only up to index_topk = 256 tokens: stay below.
CAPTURE_LEN = 200
INTERVAL = 48


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_equal_single_pass_prefill_states(models, make_workload, name):
    model = models[name]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=CAPTURE_LEN, seed=5)
    cached = capture_prompt(model, tokens, checkpoint_interval=INTERVAL)
    assert sorted(cached.checkpoints) == [48, 96, 144, 192]
    for position, states in cached.checkpoints.items():
        cache, _ = _single_pass(model, tokens[:position])
        reference = read_states(model.description, cache)
        assert states.keys() == reference.keys()
        for layer in reference:
            assert states[layer].tensors.keys() == reference[layer].tensors.keys()
            for part in reference[layer].tensors:
                got, want = states[layer][part], reference[layer][part]
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the chunked capture's attention KV is the one-pass KV too (up to float reassociation)
    cache, _ = _single_pass(model, tokens)
    one_pass = read_kv(model.description, cache)
    for layer, tensors in one_pass.items():
        for tensor_name, want in tensors.items():
            torch.testing.assert_close(cached.attention[layer][tensor_name], want, atol=1e-4, rtol=1e-4)


def test_checkpoints_are_snapshots_not_live_references(models, make_workload):
    model = models["random-qwen3-next"]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=96, seed=6)
    cached = capture_prompt(model, tokens, checkpoint_interval=32)
    first, last = cached.checkpoints[32], cached.checkpoints[96]
    assert any(not torch.equal(first[i]["recurrent.0"], last[i]["recurrent.0"]) for i in first)


@pytest.mark.parametrize("name", NAMES)
def test_continuing_from_cached_checkpoint_equals_one_pass(models, make_workload, name):
    model = models[name]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=CAPTURE_LEN, seed=7)
    cached = capture_prompt(model, tokens, checkpoint_interval=INTERVAL)
    _, reference = _single_pass(model, tokens, logits_to_keep=CAPTURE_LEN)
    for position in (48, 144):
        before = {i: s.clone() for i, s in cached.checkpoints[position].items()}
        cache = assemble_cache(model, cached.kv_prefix(position), cached.checkpoints[position])
        assert cache.get_seq_length() == position
        logits = model.forward(tokens[position:], cache, start=position, logits_to_keep=CAPTURE_LEN - position)
        torch.testing.assert_close(logits, reference[position:], atol=1e-4, rtol=0)
        # the stored checkpoint is left untouched by the assembly and the continued forward
        for i, state in before.items():
            assert cached.checkpoints[position][i].equal(state)


@pytest.mark.parametrize("name", NAMES)
def test_continuing_from_exact_state_at_any_position_equals_one_pass(models, make_workload, name):
    """Not only on the checkpoint grid: exact KV + exact states at p resume exactly."""
    model = models[name]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=150, seed=8)
    _, reference = _single_pass(model, tokens, logits_to_keep=150)
    position = 61
    prefix_cache, _ = _single_pass(model, tokens[:position])
    kv = read_kv(model.description, prefix_cache).clone()
    states = read_states(model.description, prefix_cache)
    cache = assemble_cache(model, kv, states)
    logits = model.forward(tokens[position:], cache, start=position, logits_to_keep=150 - position)
    torch.testing.assert_close(logits, reference[position:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_assembled_empty_cache_equals_fresh_cache(models, make_workload, name):
    """Zero states loaded by hand behave as a fresh sequence start."""
    model = models[name]
    tokens, _ = make_workload(matched=0, prompt_len=1, cached_len=60, seed=9)
    _, reference = _single_pass(model, tokens, logits_to_keep=60)
    logits = model.forward(tokens, assemble_cache(model, None, None), start=0, logits_to_keep=60)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Budget parsing.


@pytest.mark.parametrize(
    ("text", "fraction", "tokens"),
    [("0.05", 0.05, None), ("1", 1.0, None), ("0", 0.0, None), ("256tok", None, 256), (" 0.5 ", 0.5, None)],
)
def test_budget_parse_accepts(text, fraction, tokens):
    budget = Budget.parse(text)
    assert budget.fraction == fraction
    assert budget.tokens == tokens


@pytest.mark.parametrize(("text", "problem"), [("1.5", "outside"), ("-0.1", "outside"), ("abc", "not a number")])
def test_budget_parse_rejects(text, problem):
    with pytest.raises(HybridKVError) as info:
        Budget.parse(text)
    message = str(info.value)
    assert text in message
    assert problem in message


@pytest.mark.parametrize("text", ["nan", "inf", "-5tok", "5 toks", ""])
def test_budget_parse_rejects_other_garbage(text):
    with pytest.raises(HybridKVError):
        Budget.parse(text)


def test_budget_tail_tokens():
    for matched in (0, 1, 7, 100, 1000):
        assert Budget(fraction=1.0).tail_tokens(matched) == matched
        assert Budget(fraction=0.0).tail_tokens(matched) == 0
        assert Budget(tokens=256).tail_tokens(matched) == min(256, matched)
        for fraction in (0.05, 0.3, 0.5):
            t = Budget(fraction=fraction).tail_tokens(matched)
            assert 0 <= t <= matched
            assert abs(t - fraction * matched) <= 0.5
