"""`hybridkv validate`: every method against full prefill on a prefix-hit workload.

Workload, for each matched length L: a cached prompt C and a new prompt P (seeded random
tokens) that share exactly their first L tokens, then diverge, each with S more tokens. C is
prefilled and cached (with state checkpoints every B tokens if asked); P is looked up, hits C
at exactly L, and each method resumes P from that hit.

Reference: full prefill of P in one pass, from an empty cache. Fidelity is measured over the S
suffix positions. Beside every method we also report the *split noise*: the same model run as
"P[:L] in one pass, then P[L:] from that exactly kept cache" against the one-pass reference.
For most architectures it is ~1e-12 nats; for glm5_next with contexts longer than its DSA
`index_topk` transformers' outputs depend on how the prompt is split, and this is the floor
below which no method's KL means anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from hybridkv.cache import CHECKPOINT_INTERVAL, CachedMatch, CachedPrompt, PrefixCache, capture_prompt
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.errors import HybridKVError
from hybridkv.eval.decode import greedy_continue
from hybridkv.eval.metrics import greedy_agreement, kl_mean, top1_agreement
from hybridkv.methods import METHODS, Budget, RecoveryMethod, dropped_state_bound, execute, get_method
from hybridkv.methods.full import Full
from hybridkv.models import BUILTIN_MODELS, DEFAULT_MODEL, HybridModel
from hybridkv.models.cost import CostModel
from hybridkv.models.meta import cost_model
from hybridkv.store import GuardedStore, open_store


@dataclass
class ValidateConfig:
    """What `hybridkv validate` measures. A field's `help` is its flag's text: `hybridkv.cli` makes one
    flag per field that has one, with the field's default."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": f"built-in model ({', '.join(BUILTIN_MODELS)}) or a checkpoint directory"},
    )
    prefix_lengths: list[int] = field(
        default_factory=lambda: [1000, 2048], metadata={"help": "matched prefix lengths L"}
    )
    suffix_length: int = field(default=64, metadata={"help": "new tokens after the match (fidelity positions)"})
    budgets: list[Budget] = field(
        default_factory=lambda: [Budget(fraction=0.05), Budget(fraction=0.1)],
        metadata={"help": "replay budgets: fractions of L in [0, 1], or token counts like 256tok"},
    )
    methods: list[str] = field(
        default_factory=lambda: list(METHODS), metadata={"help": f"comma list of methods: {', '.join(METHODS)}"}
    )
    checkpoint_interval: int | None = field(
        default=CHECKPOINT_INTERVAL,
        metadata={"help": "store linear-state checkpoints every B tokens (0: none)"},
    )
    seed: int = field(default=0, metadata={"help": "seed for the tiny model's weights and the prompts"})
    repeats: int = field(default=3, metadata={"help": "timing repeats (TTFT is the median)"})
    greedy_tokens: int = field(default=16, metadata={"help": "G, tokens of greedy continuation compared"})
    store: str | None = field(  # None keeps cached prompts in this process only
        default=None,
        metadata={
            "help": "put the cached prompt through this store and serve the hit from it: memory://, file:///DIR, "
            "redis://HOST:PORT, valkey://HOST:PORT, lmcache://… (default: keep it in this process)"
        },
    )
    cache_salt: str = field(default="", metadata={"help": "tenant salt: prompts of one salt never hit another's"})

    def check(self, model: HybridModel | None = None) -> None:
        if not self.prefix_lengths or any(length < 1 for length in self.prefix_lengths):
            raise HybridKVError(f"prefix lengths must be positive token counts, got {self.prefix_lengths}")
        if self.suffix_length < 1:
            raise HybridKVError(f"suffix length must be at least 1 token (got {self.suffix_length})")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 1:
            raise HybridKVError(f"checkpoint interval must be a positive token count (got {self.checkpoint_interval})")
        if self.repeats < 1 or self.greedy_tokens < 1:
            raise HybridKVError("repeats and greedy tokens must be at least 1")
        for name in self.methods:
            get_method(name)
        if self.store:
            open_store(self.store).close()  # a malformed or unknown URL fails here, before any work
        if model is not None:
            limit = getattr(model.config, "max_position_embeddings", None)
            longest = max(self.prefix_lengths) + self.suffix_length + self.greedy_tokens
            if limit is not None and longest > limit:
                raise HybridKVError(f"prompt of {longest} tokens exceeds the model's max_position_embeddings ({limit})")


@dataclass(frozen=True)
class PromptPair:
    cached_prompt: torch.Tensor
    prompt: torch.Tensor
    prefix_length: int


def make_workload(model: HybridModel, prefix_length: int, suffix_length: int, seed: int) -> PromptPair:
    """Two prompts sharing exactly `prefix_length` seeded random tokens, then diverging."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + prefix_length)
    low, high = min(3, model.config.vocab_size - 2), model.config.vocab_size
    shared = torch.randint(low, high, (prefix_length,), generator=generator)
    suffix = torch.randint(low, high, (suffix_length,), generator=generator)
    other = torch.randint(low, high, (suffix_length,), generator=generator)
    if other[0] == suffix[0]:
        other[0] = low + (int(suffix[0]) - low + 1) % (high - low)
    return PromptPair(torch.cat([shared, other]), torch.cat([shared, suffix]), prefix_length)


def _plan(config: ValidateConfig) -> list[tuple[RecoveryMethod, Budget | None]]:
    rows = []
    for name in config.methods:
        method = get_method(name)
        for budget in config.budgets if method.uses_budget else [None]:
            rows.append((method, budget))
    return rows


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cost_model(model: HybridModel) -> CostModel | None:
    try:  # transformers computes DSA attention densely and masks it: bound what it runs
        return cost_model(model.config, dense_attention=True)
    except HybridKVError:  # no cost model for this architecture yet: no bound column
        return None


@dataclass
class _Hit:
    """The cached prompt as captured, how long capturing took, and what the new prompt's lookup hit."""

    cached: CachedPrompt
    build_s: float
    hit: CachedMatch


def _cache_and_look_up(
    model: HybridModel, work: PromptPair, config: ValidateConfig, stored: StoredPrefixCache | None
) -> _Hit:
    """Capture the cached prompt, add it to `stored` (a fresh in-memory cache without one) and look
    the new prompt up there."""
    started = time.perf_counter()
    cached = capture_prompt(model, work.cached_prompt, config.checkpoint_interval)
    build_s = time.perf_counter() - started
    prefix_cache = stored if stored is not None else PrefixCache()
    prefix_cache.add(cached)
    hit = prefix_cache.lookup(work.prompt) or CachedMatch.miss()
    if stored is None:
        assert hit.length == work.prefix_length, "workload prompts must share exactly L tokens"
    return _Hit(cached, build_s, hit)


@dataclass
class _Reference:
    """Full prefill's suffix logits and greedy continuation, and the split noise beside them."""

    logits: torch.Tensor
    greedy: list[int]
    split_noise: dict[str, float]


def _reference(model: HybridModel, work: PromptPair, hit: CachedMatch, config: ValidateConfig) -> _Reference:
    prompt, prefix_length, suffix = work.prompt, work.prefix_length, config.suffix_length
    # Reference: one pass over the whole prompt from an empty cache.
    reference = execute(model, prompt, hit, Full().recipe(hit, None), logits_to_keep=suffix)
    reference_greedy = greedy_continue(
        model, reference.cache, reference.logits[-1], prompt.numel(), config.greedy_tokens
    )
    # Split noise: prefix pass, then the suffix from that exactly kept cache.
    split_cache = model.new_cache()
    model.forward(prompt[:prefix_length], split_cache, start=0)
    split_logits = model.forward(prompt[prefix_length:], split_cache, start=prefix_length, logits_to_keep=suffix)
    split_noise = {
        "split_noise_kl": kl_mean(reference.logits, split_logits),
        "split_noise_top1": top1_agreement(reference.logits, split_logits),
        "split_noise_max_logit_diff": float((reference.logits - split_logits).abs().max()),
    }
    return _Reference(reference.logits, reference_greedy, split_noise)


def _fidelity_row(
    model: HybridModel,
    config: ValidateConfig,
    work: PromptPair,
    found: _Hit,
    reference: _Reference,
    method: RecoveryMethod,
    budget: Budget | None,
    costs: CostModel | None,
) -> dict:
    """One method's row against the reference, timing columns not yet filled."""
    prompt, hit, suffix = work.prompt, found.hit, config.suffix_length
    recipe = method.recipe(hit, budget)
    outcome = execute(model, prompt, hit, recipe, logits_to_keep=suffix)
    greedy = greedy_continue(model, outcome.cache, outcome.logits[-1], prompt.numel(), config.greedy_tokens)
    return {
        "method": method.name,
        "budget": budget.label() if budget is not None else None,
        "prefix_length": work.prefix_length,
        "suffix_length": suffix,
        "matched_length": hit.length,
        "reused_tokens": outcome.reused_tokens,
        "replayed_tokens": outcome.replayed_tokens,
        "recomputed_tokens": outcome.recomputed_tokens,
        # Tokens from the state position on go through the model (replay and suffix alike);
        # the cost model turns that into the speedup over full prefill that FLOPs allow.
        "state_position": recipe.state_position,
        "bound": costs.speedup_bound(prompt.numel(), recipe.state_position) if costs else None,
        # Share of the dropped linear states that can survive to the hit (decay summary).
        "decay_bound": dropped_state_bound(hit, recipe),
        "kl_mean": kl_mean(reference.logits, outcome.logits),
        "top1_agreement": top1_agreement(reference.logits, outcome.logits),
        "greedy_agreement": greedy_agreement(reference.greedy, greedy),
        **reference.split_noise,
        "state_bytes": found.cached.state_bytes() if method.uses_checkpoints else 0,
        "kv_bytes": found.cached.kv_bytes() if method.reuses_kv else 0,
        "cache_build_s": found.build_s,
    }


def _time_ttft(
    model: HybridModel,
    prompt: torch.Tensor,
    hit: CachedMatch,
    plan: list[tuple[RecoveryMethod, Budget | None]],
    repeats: int,
    tick: Callable[[str], None],
) -> tuple[float, list[float]]:
    """Median TTFT (cache in hand -> first-token logits) of full prefill and of each planned method.
    Each repeat times full prefill and then every method back to back, so drift in machine load
    hits all of them alike."""
    full_recipe = Full().recipe(hit, None)
    full_times: list[float] = []
    method_times: list[list[float]] = [[] for _ in plan]
    for _ in range(repeats):
        full_times.append(_timed(lambda: execute(model, prompt, hit, full_recipe, logits_to_keep=1)))
        for times, (method, budget) in zip(method_times, plan, strict=True):
            recipe = method.recipe(hit, budget)
            times.append(_timed(lambda recipe=recipe: execute(model, prompt, hit, recipe, logits_to_keep=1)))
            tick(f"{method.name} timing")
    return statistics.median(full_times), [statistics.median(times) for times in method_times]


def validate_prefix(
    model: HybridModel,
    config: ValidateConfig,
    prefix_length: int,
    progress: tqdm | None = None,
    stored: StoredPrefixCache | None = None,
) -> list[dict]:
    """All rows for one matched prefix length.

    With `stored`, the cached prompt goes through that store and the hit is whatever comes back:
    a store that fails mid-run shortens or loses the hit, and the methods recompute the rest.
    """

    def tick(label: str) -> None:
        if progress is not None:
            progress.set_postfix_str(f"L={prefix_length} {label}")
            progress.update()

    work = make_workload(model, prefix_length, config.suffix_length, config.seed)
    found = _cache_and_look_up(model, work, config, stored)
    tick("cache built")
    reference = _reference(model, work, found.hit, config)
    tick("reference")

    plan = _plan(config)
    costs = _cost_model(model)
    rows = []
    for method, budget in plan:
        rows.append(_fidelity_row(model, config, work, found, reference, method, budget, costs))
        tick(f"{method.name} fidelity")

    full_ttft, method_ttfts = _time_ttft(model, work.prompt, found.hit, plan, config.repeats, tick)
    for row, ttft in zip(rows, method_ttfts, strict=True):
        row["ttft_s"] = ttft
        row["full_ttft_s"] = full_ttft
        row["speedup"] = full_ttft / row["ttft_s"]
    return rows


def steps_per_prefix(config: ValidateConfig) -> int:
    rows = len(_plan(config))
    return 2 + rows + rows * config.repeats


def run_validate(model: HybridModel, config: ValidateConfig, show_progress: bool = True) -> dict:
    config.check(model)
    torch.manual_seed(config.seed)
    store = GuardedStore(open_store(config.store)) if config.store else None
    stored = (
        StoredPrefixCache(model, store, config.cache_salt, checkpoint_interval=config.checkpoint_interval)
        if store is not None
        else None
    )
    total = steps_per_prefix(config) * len(config.prefix_lengths)
    rows: list[dict] = []
    try:
        with tqdm(total=total, desc="validate", disable=not show_progress, leave=False) as progress:
            for length in config.prefix_lengths:
                rows.extend(validate_prefix(model, config, length, progress, stored))
    finally:
        if store is not None:
            store.inner.close()
    return {
        "model": model.description.as_dict(),
        "config": {
            "prefix_lengths": config.prefix_lengths,
            "suffix_length": config.suffix_length,
            "budgets": [b.label() for b in config.budgets],
            "methods": config.methods,
            "checkpoint_interval": config.checkpoint_interval,
            "seed": config.seed,
            "repeats": config.repeats,
            "greedy_tokens": config.greedy_tokens,
            "torch_threads": torch.get_num_threads(),
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
        },
        "reference": f"full prefill of the new prompt in one pass from an empty cache, in "
        f"{str(model.dtype).removeprefix('torch.')} on {model.device}; fidelity over the suffix positions",
        "store": {"url": config.store, "events": store.stats()} if store is not None else None,
        "rows": rows,
    }
