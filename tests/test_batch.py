"""Batched resumes: several requests in one forward must answer exactly as each would alone.

Rows differ in matched length, cached-KV length (so the batch left-pads), method (exact-KV
replay, recompute, seeded from a checkpoint, zero state, a miss) and prompt; they share only
the number of tokens to compute.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.cache import CachedMatch, PrefixCache, capture_prompt
from hybridkv.methods import Recipe, execute, execute_batch
from hybridkv.models import RANDOM_MODELS
from tests.helpers import greedy_decode

SPAN = 100  # tokens each request computes
KEEP = 4
# (matched length L, recipe (n, s, seeded)) with prompt length s + SPAN
ROWS = [
    (100, (100, 50, False)),  # tail-replay, exact KV
    (140, (140, 90, False)),  # tail-replay, longest KV
    (120, (80, 80, False)),  # tail-replay-recompute
    (130, (130, 96, True)),  # seeded-replay from the checkpoint at 96
    (70, (70, 70, False)),  # zero-state
    (0, (0, 0, False)),  # a miss: full prefill
]


@pytest.mark.parametrize("name", list(RANDOM_MODELS))
def test_a_batch_answers_as_each_request_alone(models, make_workload, name):
    model = models[name]
    prompts, hits, recipes = [], [], []
    for seed, (matched, (n, s, seeded)) in enumerate(ROWS):
        cached_tokens, prompt = make_workload(matched, s + SPAN, 200, seed=seed + 11)
        if matched:
            store = PrefixCache()
            store.add(capture_prompt(model, cached_tokens, checkpoint_interval=16))
            hit = store.lookup(prompt)
            assert hit.length == matched
        else:
            hit = CachedMatch.miss()
        prompts.append(prompt)
        hits.append(hit)
        recipes.append(Recipe(n, s, seeded))
    batched = execute_batch(model, prompts, hits, recipes, logits_to_keep=KEEP)
    for prompt, hit, recipe, together in zip(prompts, hits, recipes, batched, strict=True):
        alone = execute(model, prompt, hit, recipe, logits_to_keep=KEEP)
        label = f"{name} {recipe}"
        torch.testing.assert_close(together.logits, alone.logits, atol=2e-4, rtol=0, msg=label)
        assert (together.reused_tokens, together.replayed_tokens, together.recomputed_tokens) == (
            alone.reused_tokens,
            alone.replayed_tokens,
            alone.recomputed_tokens,
        )
        assert together.cache.get_seq_length() == prompt.numel()  # padding dropped
        tokens_a, logits_a = greedy_decode(model, alone.cache, alone.logits[-1], prompt.numel(), 3)
        _, logits_b = greedy_decode(model, together.cache, together.logits[-1], prompt.numel(), 3, follow=tokens_a)
        torch.testing.assert_close(logits_b, logits_a, atol=2e-4, rtol=0, msg=label)


def test_a_batch_refuses_rows_of_different_spans(models, make_workload):
    model = models["random-qwen3-next"]
    cached_tokens, prompt = make_workload(50, 80, 100, seed=1)
    store = PrefixCache()
    store.add(capture_prompt(model, cached_tokens))
    hit = store.lookup(prompt)
    with pytest.raises(HybridKVError, match="same number of tokens"):
        execute_batch(model, [prompt, prompt], [hit, hit], [Recipe(50, 40), Recipe(50, 30)])
    with pytest.raises(HybridKVError, match="one hit and one recipe"):
        execute_batch(model, [prompt], [hit, hit], [Recipe(50, 40)])
