"""Position-independent pairs (attention policy × linear policy) and their one executor.

Invariants on every built-in family: with one chunk and nothing to repair, every pair that
uses the chunk's linear state equals full prefill; recomputing every token is full prefill
whatever the linear policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.cache.chunks import encode_chunk
from hybridkv.methods.chunked import ATTENTION, LINEAR, PAIRS, execute_chunks, parse_pair
from hybridkv.methods.chunked.base import WARMUP, runs, top_within_budget, with_warmup
from hybridkv.methods.chunked.cacheblend import NOTHING_TO_REPAIR, CacheBlend, deviations
from hybridkv.methods.chunked.linearkv import most_relevant
from hybridkv.methods.chunked.prophet import Prophet, relevance
from tests.conftest import random_tokens

NAMES = ["random-glm5-next", "random-qwen3-next", "random-kimi-linear", "random-olmo-hybrid", "random-nemotron-h"]
STATEFUL = [name for name, policy in LINEAR.items() if policy.stores_states]  # zero drops them by design


@dataclass(frozen=True)
class RecomputeAll:
    name: str = "recompute-all"
    corrects_positions: bool = False

    def recompute(self, model, chunks, question):
        return [list(range(len(chunk))) for chunk in chunks]

    def selection_layer_tokens(self, model, chunks, question):
        return 0


def full_prefill(model, tokens: torch.Tensor) -> torch.Tensor:
    return model.forward(tokens, model.new_cache(), start=0, logits_to_keep=1)


@pytest.mark.parametrize("name", NAMES)
def test_one_chunk_with_nothing_to_repair_is_full_prefill(models, name):
    model = models[name]
    vocab = model.config.vocab_size
    chunk_tokens, question = random_tokens(40, seed=1, vocab=vocab), random_tokens(6, seed=2, vocab=vocab)
    full = full_prefill(model, torch.cat([chunk_tokens, question]))
    chunk = encode_chunk(model, chunk_tokens)
    for attention in ATTENTION.values():
        for linear in STATEFUL:
            outcome = execute_chunks(model, [chunk], question, attention, LINEAR[linear])
            torch.testing.assert_close(outcome.logits, full, atol=1e-4, rtol=0, msg=f"{attention.name}+{linear}")


@pytest.mark.parametrize("name", NAMES)
def test_recomputing_every_token_is_full_prefill_whatever_the_linear_policy(models, name):
    model = models[name]
    vocab = model.config.vocab_size
    parts = [random_tokens(n, seed=n, vocab=vocab) for n in (21, 34, 17)]
    question = random_tokens(5, seed=3, vocab=vocab)
    full = full_prefill(model, torch.cat([*parts, question]))
    chunks = [encode_chunk(model, part, seam=4) for part in parts]
    for linear in LINEAR.values():
        outcome = execute_chunks(model, chunks, question, RecomputeAll(), linear)
        torch.testing.assert_close(outcome.logits, full, atol=1e-4, rtol=0, msg=linear.name)
        assert outcome.reused_tokens == 0 and outcome.recomputed_tokens == 21 + 34 + 17 + 5


@pytest.mark.parametrize("name", ["random-qwen3-next", "random-glm5-next"])
def test_cacheblend_picks_the_most_deviating_tokens_and_the_leading_chunk_never_deviates(models, name):
    model = models[name]
    vocab = model.config.vocab_size
    chunks = [encode_chunk(model, random_tokens(n, seed=70 + n, vocab=vocab), with_maps=False) for n in (30, 26, 33)]
    per_chunk = deviations(model, chunks)
    # the first chunk sits where it was encoded, after nothing: its stored KV is what the context gives
    assert per_chunk[0].max() < NOTHING_TO_REPAIR
    assert all(d.max() > 1e-4 for d in per_chunk[1:])
    picks = CacheBlend(ratio=0.2).recompute(model, chunks, torch.tensor([5]))
    chosen = torch.cat([d[p] for d, p in zip(per_chunk, picks, strict=True) if p])
    left = torch.cat([d[[i for i in range(d.numel()) if i not in p]] for d, p in zip(per_chunk, picks, strict=True)])
    assert float(chosen.max()) == float(torch.cat(per_chunk).max()) and len(left) > 0  # the most deviating first
    spent = sum(end - start for p in picks for start, end in with_warmup(runs(p), WARMUP))
    assert 0 < spent <= math.ceil(0.2 * (30 + 26 + 33))  # with the executor's warm-up, within the budget
    first_attention = model.description.attention_layers[0]
    assert CacheBlend().selection_layer_tokens(model, chunks, torch.tensor([5])) == (30 + 26 + 33) * (
        first_attention + 1
    )


def test_pairs_differ_where_they_should(models):
    """Several chunks: the stored pieces are not the prompt's, so only recomputation is exact, and
    the policies give different answers (the pairs are really different methods)."""
    # OLMo-Hybrid: RoPE attention (position correction does something) and random GDN gates that carry
    # a state across a chunk (random Qwen3-Next's forget it within a few tokens: linearkv = compose)
    model = models["random-olmo-hybrid"]
    vocab = model.config.vocab_size
    # long enough that cacheblend's and prophet's budgets reach past a mid-chunk run's warm-up
    parts = [random_tokens(n, seed=40 + n, vocab=vocab) for n in (130, 150, 140)]
    question = parts[0][5:11]  # quotes the first chunk: linearkv-relevant takes its state, linearkv the last's
    full = full_prefill(model, torch.cat([*parts, question]))
    chunks = [encode_chunk(model, part) for part in parts]
    assert most_relevant(chunks, question) == 0
    logits = {pair: execute_chunks(model, chunks, question, *parse_pair(pair)).logits for pair in PAIRS}
    assert all((value - full).abs().max() > 1e-3 for value in logits.values())
    assert len({round(float((value - full).abs().max()), 6) for value in logits.values()}) == len(PAIRS)
    outcome = execute_chunks(model, chunks, question, *parse_pair("epic+compose"))
    # epic recomputes 32 tokens of each later chunk (covering compose's 8-token seams); compose alone
    # recomputes the seams of all three
    assert outcome.recomputed_tokens == 8 + 32 + 32 + 6 and outcome.reused_tokens == 420 - 72
    assert execute_chunks(model, chunks, question, *parse_pair("naive+compose")).recomputed_tokens == 3 * 8 + 6


def test_runs_and_relevance():
    assert runs([5, 1, 2, 3, 9, 10, 3]) == [(1, 4), (5, 6), (9, 11)] and runs([]) == []

    class Chunk:
        def __init__(self, ids):
            self.tokens = torch.tensor(ids)

    chunks = [Chunk([1, 2, 3, 4, 5]), Chunk([9, 8, 7, 6, 5, 4]), Chunk([1, 2, 3, 4, 5])]
    assert most_relevant(chunks, torch.tensor([7, 6, 5, 4])) == 1
    assert most_relevant(chunks, torch.tensor([1, 2, 3, 4])) == 2  # a tie goes to the later chunk


def test_unknown_pairs_are_refused_in_one_line():
    for bad in ("epic", "epic+", "bogus+zero", "naive+bogus"):
        with pytest.raises(HybridKVError, match="ATTENTION\\+LINEAR") as refusal:
            parse_pair(bad)
        assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("name", ["random-qwen3-next", "random-nemotron-h"])
def test_prophet_recomputes_what_the_question_attends_to(models, name):
    """Relevance is the attention the question pays each context token, read off transformers'
    own (eager) attention weights; the top 20% of the later chunks' tokens are recomputed."""
    model = models[name]
    vocab = model.config.vocab_size
    chunks = [encode_chunk(model, random_tokens(n, seed=80 + n, vocab=vocab), with_maps=False) for n in (125, 130, 135)]
    question = random_tokens(6, seed=8, vocab=vocab)
    scores = relevance(model, chunks, question)
    assert [s.numel() for s in scores] == [125, 130, 135] and all(bool((s >= 0).all()) for s in scores)
    # each layer's softmax is taken over the context's keys (ProphetKV's per-layer score), so every layer, and
    # their mean, gives the context one unit per head and question token
    heads = model.config.num_attention_heads
    assert float(torch.cat(scores).sum()) == pytest.approx(heads * question.numel(), rel=1e-4)
    picks = Prophet().recompute(model, chunks, question)
    assert picks[0] == [] and sum(map(len, picks)) > 0
    later = torch.cat(scores[1:])
    chosen = torch.cat([s[p] for s, p in zip(scores[1:], picks[1:], strict=True)])
    assert float(later.max()) in chosen.tolist()  # the best-scored token costs at most 1 + WARMUP: it fits
    # what the executor recomputes for them (each mid-chunk run with its warm-up) fits 20% of 265 tokens
    spent = sum(end - start for p in picks[1:] for start, end in with_warmup(runs(p), WARMUP))
    assert spent == math.ceil(0.2 * 265)  # and the budget is used up: one-token additions always exist
    outcome = execute_chunks(model, chunks, question, Prophet(), LINEAR["linearkv"])
    assert outcome.recomputed_tokens == spent + 6 and outcome.selection_layer_tokens == 6 * model.description.num_layers


def test_budgeted_selection_counts_the_warmup_and_passes_over_what_does_not_fit():
    assert with_warmup([(0, 8), (20, 22), (30, 31), (100, 110)], 16) == [(0, 31), (84, 110)]
    assert with_warmup([(40, 41)], 16) == [(24, 41)] and with_warmup([(5, 6)], 16) == [(0, 6)]
    # chunk 1's best token sits mid-chunk: it costs itself plus WARMUP tokens before it
    scores = [torch.tensor([9.0, 0.0]), torch.zeros(100), torch.zeros(100)]
    scores[1][60], scores[1][61], scores[2][0], scores[2][50] = 5.0, 4.0, 3.0, 2.0
    assert top_within_budget(scores, budget=WARMUP + 3, skip_chunks=1) == [[], [60, 61], [0]]
    # chunk 2's index 50 would cost WARMUP + 1 more: passed over, while the zeros next to picked runs
    # (chunk 2's index 1, then chunk 1's 59, ...) cost one each and fill the budget
    picked = top_within_budget(scores, budget=WARMUP + 3 + WARMUP, skip_chunks=1)
    spent = sum(end - start for p in picked for start, end in with_warmup(runs(p), WARMUP))
    assert 50 not in picked[2] and {60, 61} <= set(picked[1]) and spent == WARMUP + 3 + WARMUP
    assert top_within_budget(scores, budget=2 * WARMUP + 4, skip_chunks=1) == [[], [60, 61], [0, 50]]
    # the best token costs more than the whole budget: cheaper ones are taken instead
    assert top_within_budget(scores, budget=3, skip_chunks=1) == [[], [0, 1], [0]]  # ties: earlier chunk first
    scores[2][0] = float("-inf")  # never picked
    assert top_within_budget(scores, budget=1000, skip_chunks=1)[2][:1] == [1]


@pytest.mark.parametrize("name", ["tiny-nemotron-h", "tiny-qwen3-next"])
def test_prophets_relevance_lands_on_the_fact_the_question_asks_for(models, name):
    """On trained models that answer `rag`, the context tokens the question attends to most lie in
    the gold passage's fact sentence: relevance is read at the right tokens of the right chunks. (By
    chance about 0.25 of 10 would: the sentence is some 50 of the prompt's 2,048 tokens.)"""
    from hybridkv.eval.workloads import rag
    from hybridkv.models.tokenizer import load_tokenizer

    model, tokenizer = models[name], load_tokenizer(name)
    inside = []
    for sample in rag.generate("rag", 2048, 6, tokenizer):
        chunks = [encode_chunk(model, torch.tensor(tokenizer.encode(c)), with_maps=False) for c in sample.chunks]
        scores = relevance(model, chunks, torch.tensor(tokenizer.encode(sample.question)))
        gold = sample.meta["gold_chunk"]
        text = sample.chunks[gold]
        first = len(tokenizer.encode(text[: text.index("The registration number")]))  # byte tokens: exact
        last = len(tokenizer.encode(text[: text.index(sample.golds[0]) + len(sample.golds[0])]))
        offset = sum(len(chunk) for chunk in chunks[:gold])
        top = torch.topk(torch.cat(scores), 10).indices.tolist()
        inside.append(sum(offset + first <= t < offset + last for t in top))
    assert min(inside) >= 1 and sum(inside) >= 15, inside


def test_each_linear_policys_stores_states_says_whether_the_chunks_end_states_are_read(models):
    """`stores_states` is what the arena counts state bytes by: a policy declaring False must give the
    same answer whatever the chunks' end states hold, and one declaring True must read them."""
    model = models["random-olmo-hybrid"]
    vocab = model.config.vocab_size
    parts = [random_tokens(n, seed=60 + n, vocab=vocab) for n in (50, 40)]
    question = random_tokens(6, seed=3, vocab=vocab)
    chunks = [encode_chunk(model, part) for part in parts]
    moved = [
        replace(chunk, end_states={i: s.map(lambda t: t + 0.5) for i, s in chunk.end_states.items()})
        for chunk in chunks
    ]
    for name, policy in LINEAR.items():
        same = execute_chunks(model, chunks, question, ATTENTION["naive"], policy).logits
        other = execute_chunks(model, moved, question, ATTENTION["naive"], policy).logits
        assert bool((same - other).abs().max() > 1e-4) == policy.stores_states, name
