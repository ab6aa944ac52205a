"""adaptive-replay and the decay summary it reads, on every tiny architecture.

The summary claims: drop a linear layer's recurrent state at s, replay [s, n) from zero, and
the state at n is off by at most exp(Σ log-decay over the spans in [s, n)) times the dropped
state's norm (an equality for Mamba-2). The first decoder layer of every tiny model is a linear
layer whose inputs are exact during a replay, so there the claim is checked directly against
the states the model itself produces.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.cache import LinearState, PrefixCache, assemble_cache, capture_prompt
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.methods import Budget, dropped_state_bound, execute, get_method
from hybridkv.methods.adaptive_replay import AdaptiveReplay
from hybridkv.models import RANDOM_MODELS
from hybridkv.models.adapter import read_kv, read_states
from hybridkv.models.decay import DECAY_SPAN, record_decay
from hybridkv.store import GuardedStore, open_store
from tests.conftest import random_tokens

NAMES = list(RANDOM_MODELS)
# Users' checkpoints of the families with a gate probe (tests/families.py). The random Mamba-2
# families forget within a span (bounds of e^-80 and below), so their probes are checked token by
# token instead (test_exact_decay_probes_match_the_state_error_token_by_token).
MAMBA2_FAMILIES = ["family:granitemoehybrid", "family:bamba", "family:falcon_h1", "family:zamba2"]
# Lightning attention (MiniMax) decays each head's state by a fixed exp(−slope) per token.
LIGHTNING_FAMILIES = ["family:minimax"]
PROBED = [*NAMES, "family:qwen3_5", *LIGHTNING_FAMILIES]
START, END = 2 * DECAY_SPAN, 6 * DECAY_SPAN  # a replay window on span boundaries


@pytest.fixture(scope="module")
def captured(models):
    built = {}

    def get(name: str):
        if name not in built:
            model = models[name]
            tokens = random_tokens(8 * DECAY_SPAN, seed=5, vocab=model.config.vocab_size)
            built[name] = (model, tokens, capture_prompt(model, tokens, checkpoint_interval=DECAY_SPAN))
        return built[name]

    return get


@pytest.mark.parametrize("name", PROBED)
def test_first_layer_state_error_obeys_the_decay_bound(captured, name):
    model, tokens, cached = captured(name)
    first = model.description.linear_layers[0]
    assert first == 0  # its inputs during the replay are exact, so only the dropped state differs
    true_start, true_end = cached.checkpoints[START], cached.checkpoints[END]
    # Drop only the recurrent state at START (keep the conv window), then replay [START, END).
    states = {
        index: LinearState(
            {name: torch.zeros_like(t) if name.startswith("recurrent") else t for name, t in s.tensors.items()}
        )
        for index, s in true_start.items()
    }
    cache = assemble_cache(model, cached.kv_prefix(START), states)
    model.forward(tokens[START:END], cache, start=START)
    replayed = read_states(model.description, cache)[first]["recurrent.0"]
    error = (true_end[first]["recurrent.0"] - replayed).double()[0]  # [H, ...]
    dropped = true_start[first]["recurrent.0"].double()[0]
    per_head_bound = cached.decay.log_decay[START // DECAY_SPAN : END // DECAY_SPAN, 0].double().sum(0).exp()
    ratio = error.flatten(1).norm(dim=1) / dropped.flatten(1).norm(dim=1)
    assert ratio.shape == per_head_bound.shape
    assert (ratio <= per_head_bound * (1 + 1e-4) + 1e-6).all(), (ratio, per_head_bound)
    assert (per_head_bound < 1).any()  # not vacuous: some head forgets measurably
    if name == "random-nemotron-h":  # Mamba-2 decays the whole state by exactly that factor
        torch.testing.assert_close(ratio, per_head_bound, rtol=1e-3, atol=1e-7)
    # the summary's bound is the worst head of the worst layer
    assert cached.decay.bound(START, END) >= float(per_head_bound.max()) * (1 - 1e-6)


@pytest.mark.parametrize("name", PROBED)
def test_adaptive_tail_is_the_shortest_under_the_tolerance(captured, name):
    model, tokens, cached = captured(name)
    store = PrefixCache()
    store.add(cached)
    prompt = torch.cat([tokens[: 7 * DECAY_SPAN + 10], torch.tensor([1, 2, 3])])
    hit = store.lookup(prompt)
    matched = hit.length
    for tolerance in (0.5, 0.1, 1e-2, 1e-3):
        method = AdaptiveReplay(tolerance=tolerance)
        recipe = method.recipe(hit, Budget(fraction=1.0))
        tail = matched - recipe.state_position
        assert recipe.exact_kv_tokens == matched
        assert recipe.state_position % DECAY_SPAN == 0
        bound = dropped_state_bound(hit, recipe)
        assert bound < tolerance or recipe.state_position == 0
        shorter = recipe.state_position + DECAY_SPAN
        if shorter <= matched:  # one span less would not have reached the tolerance
            assert cached.decay.bound(shorter, matched) >= tolerance
        capped = method.recipe(hit, Budget(tokens=DECAY_SPAN))
        assert matched - capped.state_position == min(tail, DECAY_SPAN)


@pytest.mark.parametrize("name", ["random-nemotron-h", *MAMBA2_FAMILIES, *LIGHTNING_FAMILIES])
def test_exact_decay_probes_match_the_state_error_token_by_token(models, name):
    """Mamba-2's state difference after t tokens is exactly Π exp(Δ·A) of the starting difference,
    per head: the probe (Falcon-H1's µP multipliers included) must read that Δ. Lightning
    attention's is exactly exp(−t·slope): the probe must read the layer's slope rates."""
    model = models[name]
    tokens = random_tokens(40, seed=3, vocab=model.config.vocab_size)
    first = model.description.linear_layers[0]
    assert first == 0  # its inputs are the embeddings, the same in both runs
    true = model.new_cache()
    model.forward(tokens[:32], true, start=0)
    kv, states = read_kv(model.description, true).clone(), read_states(model.description, true)
    zeroed = {
        i: LinearState({n: t if n.startswith("conv") else torch.zeros_like(t) for n, t in s.tensors.items()})
        for i, s in states.items()
    }
    wrong = assemble_cache(model, kv, zeroed)
    with record_decay(model) as gates:
        model.forward(tokens[32:35], wrong, start=32)
    model.forward(tokens[32:35], true, start=32)
    log_decay = torch.cat(gates[0]).double().sum(0)  # first linear layer, [heads]
    error = (
        read_states(model.description, true)[first]["recurrent.0"]
        - read_states(model.description, wrong)[first]["recurrent.0"]
    )
    ratio = error.double()[0].flatten(1).norm(dim=1) / states[first]["recurrent.0"].double()[0].flatten(1).norm(dim=1)
    assert (log_decay > -5).any()  # not vacuous: some head keeps over 1% of its state over 3 tokens
    torch.testing.assert_close(ratio, log_decay.exp(), rtol=1e-3, atol=1e-6)  # atol: float32 noise of a difference


@pytest.mark.parametrize("name", ["family:lfm2", "family:lfm2_vl"])
def test_a_short_conv_model_is_recovered_exactly_by_one_span(captured, name):
    """LFM2's layers keep only a K − 1 token window: adaptive-replay knows a whole span recovers them."""
    model, tokens, cached = captured(name)
    store = PrefixCache()
    store.add(cached)
    prompt = torch.cat([tokens[: 7 * DECAY_SPAN + 10], torch.tensor([7, 8, 9, 10])])
    hit = store.lookup(prompt)
    recipe = AdaptiveReplay(tolerance=1e-9).recipe(hit, Budget(fraction=1.0))
    assert hit.length - recipe.state_position < 2 * DECAY_SPAN  # the first whole span, not the prefix
    assert dropped_state_bound(hit, recipe) == 0.0
    reference = model.forward(prompt, model.new_cache(), start=0, logits_to_keep=4)
    outcome = execute(model, prompt, hit, recipe, logits_to_keep=4)
    torch.testing.assert_close(outcome.logits, reference, atol=1e-4, rtol=0)


def test_adaptive_replay_of_everything_is_exact(captured):
    model, tokens, cached = captured("random-glm5-next")
    store = PrefixCache()
    store.add(cached)
    prompt = torch.cat([tokens[:300], torch.tensor([7, 8, 9, 10])])
    hit = store.lookup(prompt)
    reference = model.forward(prompt, model.new_cache(), start=0, logits_to_keep=4)
    recipe = AdaptiveReplay(tolerance=0.0).recipe(hit, Budget(fraction=1.0))  # nothing is below 0: replay all
    assert recipe.state_position == 0
    outcome = execute(model, prompt, hit, recipe, logits_to_keep=4)
    torch.testing.assert_close(outcome.logits, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_tokens", [DECAY_SPAN, 48, 100, 3 * DECAY_SPAN])
def test_decay_summary_round_trips_through_a_store(captured, block_tokens):
    """Whatever the store's block size, the summary comes back whole (it used to be dropped, and
    adaptive-replay silently replayed the budget, when the size was not a multiple of 64)."""
    model, tokens, cached = captured("random-qwen3-next")
    stored = StoredPrefixCache(model, GuardedStore(open_store("memory://")), block_tokens=block_tokens)
    stored.add(cached)
    prompt = torch.cat([tokens[: 5 * DECAY_SPAN + 20], torch.tensor([1, 2])])
    hit = stored.lookup(prompt)
    assert hit.length == 5 * DECAY_SPAN + 20
    assert hit.cached.decay is not None
    rows = hit.cached.decay.log_decay
    assert rows.shape[0] >= hit.length // DECAY_SPAN
    assert torch.equal(rows, cached.decay.log_decay[: rows.shape[0]])
    method = get_method("adaptive-replay")
    local = PrefixCache()
    local.add(cached)
    local_recipe = method.recipe(local.lookup(prompt), Budget(fraction=0.5))
    assert method.recipe(hit, Budget(fraction=0.5)) == local_recipe
    assert local_recipe != get_method("tail-replay").recipe(hit, Budget(fraction=0.5))  # the summary mattered


def test_adaptive_replay_without_a_summary_replays_the_budget(captured):
    model, tokens, cached = captured("random-glm5-next")
    store = PrefixCache()
    store.add(type(cached)(cached.tokens, cached.attention))  # a cached prompt written without gates
    hit = store.lookup(torch.cat([tokens[:200], torch.tensor([1])]))
    budget = Budget(fraction=0.05)
    recipe = get_method("adaptive-replay").recipe(hit, budget)
    assert recipe == get_method("tail-replay").recipe(hit, budget)
    assert dropped_state_bound(hit, recipe) is None


def test_a_stored_block_with_a_malformed_decay_summary_is_rejected(captured):
    """A tampered summary (right checksum, wrong shape) ends the walk there, like any bad block."""
    from hybridkv.store.codec import Entry, decode, encode

    model, tokens, cached = captured("random-glm5-next")
    guarded = GuardedStore(open_store("memory://"))
    stored = StoredPrefixCache(model, guarded)
    stored.add(cached)
    prompt = torch.cat([tokens[: 5 * DECAY_SPAN], torch.tensor([1, 2])])
    key = stored.block_key(cached.tokens, 2)  # the third block
    entry = decode(guarded.get(key), key=key, fingerprint=stored.fingerprint)
    tensors = {**entry.tensors, "decay": entry.tensors["decay"][:, :1]}  # one linear layer instead of all
    guarded.put(key, encode(Entry(entry.kind, entry.fingerprint, key, entry.meta, tensors)))
    hit = stored.lookup(prompt)
    assert hit.length == 2 * DECAY_SPAN  # the walk stopped before the bad block
    assert hit.cached.decay.spans == 2
    assert guarded.stats()["corrupt"] == 1
