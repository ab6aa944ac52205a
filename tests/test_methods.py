"""Recovery methods against full prefill on every tiny architecture.

The oracle is an independent single pass over the new prompt on a fresh cache. Fidelity is
measured here (KL, top-1), not with the project's metric code. Prompts stay ≤ 256 tokens, where
glm5's sparse attention is chunk-invariant (see test_models).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.cache import CachedMatch, CachedPrompt, PrefixCache, capture_prompt
from hybridkv.methods import METHODS, Budget, PositionsMatch, Recipe, execute, get_method
from hybridkv.models import RANDOM_MODELS
from tests.helpers import greedy_decode

NAMES = list(RANDOM_MODELS)
# Architectures whose linear layers are delta-rule (GDN / KDA): slow-forgetting states.
DELTA_RULE = ["random-glm5-next", "random-qwen3-next", "random-kimi-linear", "random-olmo-hybrid"]

INTERVAL = 32  # checkpoint interval B
PROMPT_LEN = 192
CACHED_LEN = 200
EXACT_KL = 1e-6
TOP1_NOISE = 1e-4  # float32 logit noise between exact methods computed by different code paths


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference ‖ other) of the next-token distributions."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


@dataclass
class Scenario:
    model: object
    cached: CachedPrompt
    prompt: torch.Tensor
    hit: CachedMatch
    matched: int
    reference: torch.Tensor  # single-pass logits of the suffix positions
    reference_cache: object

    @property
    def suffix(self) -> int:
        return self.prompt.numel() - self.matched

    def run(self, method_name: str, budget: Budget | None = None):
        method = get_method(method_name)
        return execute(self.model, self.prompt, self.hit, method.recipe(self.hit, budget), logits_to_keep=self.suffix)


@pytest.fixture(scope="module")
def scenario(models, make_workload):
    """scenario(name, matched, interval) -> Scenario, built once per combination."""
    built: dict[tuple, Scenario] = {}

    def get(name: str, matched: int, interval: int | None = INTERVAL) -> Scenario:
        key = (name, matched, interval)
        if key not in built:
            model = models[name]
            cached_tokens, prompt = make_workload(matched, PROMPT_LEN, CACHED_LEN, seed=matched)
            cached = capture_prompt(model, cached_tokens, checkpoint_interval=interval)
            store = PrefixCache()
            store.add(cached)
            hit = store.lookup(prompt)
            assert hit is not None and hit.length == matched  # the workload diverges exactly at L
            reference_cache = model.new_cache()
            reference = model.forward(prompt, reference_cache, start=0, logits_to_keep=PROMPT_LEN - matched)
            built[key] = Scenario(model, cached, prompt, hit, matched, reference, reference_cache)
        return built[key]

    return get


def assert_exact(s: Scenario, logits: torch.Tensor) -> None:
    assert logits.shape == s.reference.shape
    kl = mean_kl(s.reference, logits)
    assert kl < EXACT_KL, kl
    # Same argmax wherever the reference is not a near-tie: float32 noise (~1e-5 in a logit) may flip
    # a near-uniform random-weight distribution's top-1 only where its lead is below twice that.
    top2 = s.reference.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * TOP1_NOISE
    assert clear.any()
    assert torch.equal(s.reference.argmax(-1)[clear], logits.argmax(-1)[clear])


# ---------------------------------------------------------------------------------------------
# Exactness.


@pytest.mark.parametrize("name", NAMES)
def test_full_equals_single_pass(scenario, name):
    s = scenario(name, 128)
    outcome = s.run("full")
    assert_exact(s, outcome.logits)
    torch.testing.assert_close(outcome.logits, s.reference, atol=1e-4, rtol=0)
    # also without any hit at all
    alone = execute(s.model, s.prompt, None, Recipe(0, 0), logits_to_keep=s.suffix)
    assert_exact(s, alone.logits)
    assert alone.reused_tokens == 0 and alone.replayed_tokens == 0 and alone.recomputed_tokens == PROMPT_LEN


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("method_name", ["tail-replay", "tail-replay-recompute"])
def test_replay_of_the_whole_match_is_exact(scenario, name, method_name):
    s = scenario(name, 140)
    for budget in (Budget(fraction=1.0), Budget(tokens=10_000)):
        outcome = s.run(method_name, budget)
        assert_exact(s, outcome.logits)
        assert outcome.replayed_tokens == s.matched


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_at_matched_length_is_exact(scenario, name):
    s = scenario(name, 128)  # 128 = 4 × B: a checkpoint sits exactly at L
    assert 128 in s.cached.checkpoints
    outcome = s.run("checkpoint")
    assert_exact(s, outcome.logits)
    assert outcome.reused_tokens == 128
    assert outcome.replayed_tokens == 0
    assert outcome.recomputed_tokens == PROMPT_LEN - 128


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_off_grid_is_exact_but_reuses_only_the_grid(scenario, name):
    s = scenario(name, 140)
    outcome = s.run("checkpoint")
    assert_exact(s, outcome.logits)
    assert outcome.reused_tokens == 128  # the last checkpoint ≤ 140
    assert outcome.recomputed_tokens == PROMPT_LEN - 128


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_without_a_checkpoint_falls_back_to_full(scenario, name):
    s = scenario(name, 140, interval=None)
    outcome = s.run("checkpoint")
    assert_exact(s, outcome.logits)
    assert outcome.reused_tokens == 0 and outcome.recomputed_tokens == PROMPT_LEN


@pytest.mark.parametrize("name", NAMES)
def test_seeded_replay_with_checkpoint_in_window_is_exact_and_cheaper(scenario, name):
    s = scenario(name, 140)  # checkpoint at 128; budget 0.25 → t = 35, window [105, 140]
    budget = Budget(fraction=0.25)
    t = budget.tail_tokens(s.matched)
    assert s.matched - t <= 128
    seeded = s.run("seeded-replay", budget)
    tail = s.run("tail-replay", budget)
    assert_exact(s, seeded.logits)
    assert seeded.reused_tokens == s.matched
    assert seeded.replayed_tokens == s.matched - 128
    assert tail.replayed_tokens == t
    assert seeded.replayed_tokens < tail.replayed_tokens
    assert mean_kl(s.reference, seeded.logits) <= mean_kl(s.reference, tail.logits) + 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_seeded_replay_without_checkpoint_in_window_is_tail_replay(scenario, name):
    s = scenario(name, 140)  # checkpoint at 128; budget 0.05 → t = 7, window [133, 140]
    budget = Budget(fraction=0.05)
    assert s.matched - budget.tail_tokens(s.matched) > 128
    seeded = s.run("seeded-replay", budget)
    tail = s.run("tail-replay", budget)
    assert torch.equal(seeded.logits, tail.logits)
    assert (seeded.reused_tokens, seeded.replayed_tokens, seeded.recomputed_tokens) == (
        tail.reused_tokens,
        tail.replayed_tokens,
        tail.recomputed_tokens,
    )
    # with no checkpoints stored at all, the same holds at any budget
    bare = scenario(name, 140, interval=None)
    for b in (Budget(fraction=0.25), Budget(fraction=1.0)):
        assert torch.equal(bare.run("seeded-replay", b).logits, bare.run("tail-replay", b).logits)


@pytest.mark.parametrize("name", NAMES)
def test_tail_replay_with_zero_budget_is_zero_state(scenario, name):
    s = scenario(name, 140)
    zero = s.run("zero-state")
    for method_name in ("tail-replay", "seeded-replay"):
        assert torch.equal(s.run(method_name, Budget(fraction=0.0)).logits, zero.logits)


@pytest.mark.parametrize("name", NAMES)
def test_zero_state_is_detectably_inexact(scenario, name):
    """The exactness checks above can fail: losing the linear state shows in the KL."""
    s = scenario(name, 140)
    zero = s.run("zero-state")
    assert zero.reused_tokens == s.matched
    assert mean_kl(s.reference, zero.logits) > 1e-4


@pytest.mark.parametrize("name", DELTA_RULE)
def test_short_tail_replay_is_detectably_inexact_on_delta_rule_models(scenario, name):
    """GDN/KDA states forget slowly: a 5% tail does not rebuild them (Mamba-2 may, so not tested)."""
    s = scenario(name, 140)
    for method_name in ("tail-replay", "tail-replay-recompute"):
        small = s.run(method_name, Budget(fraction=0.05))
        assert mean_kl(s.reference, small.logits) > 1e-4, method_name


# ---------------------------------------------------------------------------------------------
# Token accounting.

BUDGETS = [Budget(fraction=0.0), Budget(fraction=0.05), Budget(fraction=0.3), Budget(fraction=1.0), Budget(tokens=20)]


@pytest.mark.parametrize("name", ["random-glm5-next", "random-nemotron-h"])
@pytest.mark.parametrize("matched", [128, 140])
def test_token_counts(scenario, name, matched):
    s = scenario(name, matched)
    L, n = s.matched, PROMPT_LEN
    c = s.cached.last_checkpoint_at_or_before(L)
    for method_name, method in METHODS.items():
        for budget in BUDGETS if method.uses_budget else [None]:
            outcome = s.run(method_name, budget)
            label = f"{method_name} {budget}"
            assert outcome.reused_tokens + outcome.recomputed_tokens == n, label
            assert 0 <= outcome.replayed_tokens <= L, label
            assert outcome.logits.shape == (n - L, s.reference.shape[-1]), label
            assert outcome.cache.get_seq_length() == n, label
            t = budget.tail_tokens(L) if budget is not None else None
            if budget is not None and budget.fraction is not None:
                assert t == min(L, round(budget.fraction * L)), label
            if budget is not None and budget.tokens is not None:
                assert t == min(L, budget.tokens), label
            if method_name == "full":
                assert outcome.reused_tokens == 0
            elif method_name == "zero-state":
                assert (outcome.reused_tokens, outcome.replayed_tokens) == (L, 0)
            elif method_name == "tail-replay":
                assert (outcome.reused_tokens, outcome.replayed_tokens) == (L, t), label
            elif method_name == "tail-replay-recompute":
                assert (outcome.reused_tokens, outcome.replayed_tokens) == (L - t, t), label
            elif method_name == "checkpoint":
                assert outcome.reused_tokens == c
            elif method_name == "seeded-replay":
                assert outcome.reused_tokens == L
                expected = L - c if c >= L - t else t
                assert outcome.replayed_tokens == expected, label
            elif method_name == "adaptive-replay":
                assert outcome.reused_tokens == L, label
                assert 0 <= outcome.replayed_tokens <= t, label  # the budget caps the tail
            else:  # a new method must get its own accounting check
                pytest.fail(f"no accounting check for method {method_name}")


# ---------------------------------------------------------------------------------------------
# The returned cache: decoding continues exactly, and the store is never modified.


EXACT_CASES = [
    ("full", None),
    ("tail-replay", Budget(fraction=1.0)),
    ("tail-replay-recompute", Budget(fraction=1.0)),
    ("checkpoint", None),
    ("seeded-replay", Budget(fraction=0.25)),
]


@pytest.mark.parametrize("name", NAMES)
def test_decoding_from_an_exact_outcome_matches_full_prefill(scenario, name):
    s = scenario(name, 140)
    steps = 4
    ref_cache = s.model.new_cache()
    ref_last = s.model.forward(s.prompt, ref_cache, start=0, logits_to_keep=1)[0]
    ref_tokens, ref_logits = greedy_decode(s.model, ref_cache, ref_last, PROMPT_LEN, steps)
    for method_name, budget in EXACT_CASES:
        outcome = s.run(method_name, budget)
        torch.testing.assert_close(outcome.logits[-1], ref_last, atol=1e-4, rtol=0, msg=method_name)
        _, logits = greedy_decode(s.model, outcome.cache, outcome.logits[-1], PROMPT_LEN, steps, follow=ref_tokens)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0, msg=method_name)


@pytest.mark.parametrize("name", ["random-glm5-next", "random-qwen3-next", "random-nemotron-h"])
def test_execute_leaves_the_cached_prompt_untouched(scenario, name):
    s = scenario(name, 140)
    kv_before = s.cached.attention.clone()
    states_before = {p: {i: st.clone() for i, st in states.items()} for p, states in s.cached.checkpoints.items()}
    runs = [
        ("seeded-replay", Budget(fraction=0.25)),
        ("checkpoint", None),
        ("tail-replay", Budget(fraction=0.3)),
        ("tail-replay-recompute", Budget(fraction=0.3)),
        ("zero-state", None),
    ]
    first = {m: s.run(m, b).logits for m, b in runs}
    for i, tensors in kv_before.items():
        for k, v in tensors.items():
            assert torch.equal(s.cached.attention[i][k], v), (i, k)
    for p, states in states_before.items():
        for i, state in states.items():
            assert s.cached.checkpoints[p][i].equal(state)
    # and running again gives bitwise the same answer
    for m, b in runs:
        assert torch.equal(s.run(m, b).logits, first[m]), m


@pytest.mark.parametrize("name", NAMES)
def test_exact_kv_replay_keeps_the_cached_kv_and_leaves_a_plain_cache(scenario, name):
    """Replay and suffix run in one pass, yet attention ends up holding the cached KV of [0, L)."""
    s = scenario(name, 140)
    outcome = s.run("tail-replay", Budget(fraction=0.3))
    recompute = s.run("tail-replay-recompute", Budget(fraction=0.3))
    for index, tensors in s.cached.attention.items():
        layer = outcome.cache.layers[index]
        assert not layer.pending  # every splice was consumed, none is left for decoding
        for tensor_name, dim in s.model.description.token_tensors(index).items():
            held = getattr(layer, tensor_name)
            assert held.shape[dim] == PROMPT_LEN
            assert torch.equal(held.narrow(dim, 0, s.matched), tensors[tensor_name].narrow(dim, 0, s.matched))
            # the recompute variant's tail KV differs: the splice is what keeps it exact
            tail = recompute.cache.layers[index]
            assert held.numel() == 0 or not torch.equal(
                getattr(tail, tensor_name).narrow(dim, 0, s.matched), tensors[tensor_name].narrow(dim, 0, s.matched)
            )


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_hit_not_shorter_than_prompt_is_refused(models, make_workload):
    model = models["random-nemotron-h"]
    tokens, _ = make_workload(0, 1, 40, seed=1)
    cached = capture_prompt(model, tokens)
    for length in (40, 41):
        hit = CachedMatch(cached, length)
        with pytest.raises(HybridKVError):
            execute(model, tokens, hit, Recipe(0, 0), logits_to_keep=1)
    longer = torch.cat([tokens, tokens[:5]])
    with pytest.raises(HybridKVError):  # claims more than the cached prompt holds
        execute(model, longer, CachedMatch(cached, 41), Recipe(0, 0), logits_to_keep=1)


def test_hit_with_other_tokens_is_refused(models, make_workload):
    model = models["random-nemotron-h"]
    cached_tokens, prompt = make_workload(20, 40, 40, seed=2)
    cached = capture_prompt(model, cached_tokens)
    with pytest.raises(HybridKVError, match="mismatch"):
        execute(model, prompt, CachedMatch(cached, 25), get_method("zero-state").recipe(CachedMatch(cached, 25), None))
    other = prompt.clone()
    other[0] = 3 + (int(other[0]) - 3 + 1) % 509  # differs at the very first token
    with pytest.raises(HybridKVError, match="mismatch"):
        execute(model, other, CachedMatch(cached, 20), get_method("full").recipe(CachedMatch(cached, 20), None))
    # the true prefix is accepted
    execute(model, prompt, CachedMatch(cached, 20), get_method("zero-state").recipe(CachedMatch(cached, 20), None))


def test_unknown_method():
    with pytest.raises(HybridKVError, match="nope"):
        get_method("nope")
    for name, method in METHODS.items():
        assert get_method(name) is method and method.name == name


def test_recipe_validation():
    with pytest.raises(ValueError):
        Recipe(exact_kv_tokens=5, state_position=6)
    with pytest.raises(ValueError):
        Recipe(exact_kv_tokens=5, state_position=-1)


def test_recipe_beyond_the_match_is_refused(models, make_workload):
    model = models["random-nemotron-h"]
    cached_tokens, prompt = make_workload(20, 40, 40, seed=3)
    cached = capture_prompt(model, cached_tokens, checkpoint_interval=8)
    with pytest.raises(ValueError):
        execute(model, prompt, CachedMatch(cached, 20), Recipe(exact_kv_tokens=24, state_position=24))
    with pytest.raises(ValueError):  # no checkpoint stored at 20
        execute(model, prompt, CachedMatch(cached, 20), Recipe(exact_kv_tokens=20, state_position=20, state_seed=True))
    with pytest.raises(ValueError):  # more logits than computed positions
        execute(model, prompt, CachedMatch(cached, 20), Recipe(20, 20), logits_to_keep=21)


@pytest.mark.parametrize("method_name", list(METHODS))
def test_each_methods_declared_flags_agree_with_its_recipes(method_name):
    """The flags callers act on (`reuses_kv`: build and count KV; `uses_checkpoints`: store states;
    `uses_budget`: sweep budgets) say what the recipes really do."""
    method = METHODS[method_name]
    budgets = [Budget(tokens=16), Budget(tokens=64)] if method.uses_budget else [None]
    bare, gridded = PositionsMatch(100), PositionsMatch(100, (32, 64, 96))
    recipes = [method.recipe(match, budget) for match in (bare, gridded) for budget in budgets]
    assert any(recipe.exact_kv_tokens > 0 for recipe in recipes) == method.reuses_kv
    with_grid = [method.recipe(gridded, budget) for budget in budgets]
    without = [method.recipe(bare, budget) for budget in budgets]
    assert (with_grid != without) == method.uses_checkpoints
    if method.uses_budget:
        assert any(method.recipe(match, budgets[0]) != method.recipe(match, budgets[1]) for match in (bare, gridded))
