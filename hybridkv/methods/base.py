"""The recovery-method protocol and the one executor every method shares.

A prefix hit hands us a cached prompt that shares the new prompt's first L tokens. To resume
there, a hybrid model needs two things, and a method is a choice for each — the same split
vLLM makes with one cache manager per layer kind:

* **attention side**: exact cached KV for tokens [0, n) (n ≤ L);
* **linear side**: the state at some position s ≤ n — zero, or a stored checkpoint — and
  the tokens [s, n) *replayed* through the whole model to carry it forward to n (attention
  layers use and keep the exact cached KV for them, not the KV the replay computes).

Then [n, end) is computed normally. Every method is a `Recipe` (n, s, seed) built from the hit
and a budget; `execute` turns any recipe into logits, so methods differ only in that choice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from hybridkv.cache import CachedMatch, LinearStates, PromptKV, assemble_cache
from hybridkv.errors import HybridKVError
from hybridkv.models import HybridModel
from hybridkv.models.adapter import exact_kv_for_first_tokens
from hybridkv.models.decay import DecaySummary


@dataclass(frozen=True)
class Budget:
    """A replay budget: a fraction of the matched prefix, or a token count."""

    fraction: float | None = None
    tokens: int | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        text = text.strip()
        if match := re.fullmatch(r"(\d+)\s*tok(?:ens)?", text):
            return cls(tokens=int(match.group(1)))
        try:
            value = float(text)
        except ValueError:
            raise HybridKVError(
                f"budget {text!r} is not a number (a fraction like 0.05, or a count like 256tok)"
            ) from None
        if not 0.0 <= value <= 1.0:
            raise HybridKVError(
                f"budget {text} is outside [0, 1] (a fraction of the matched prefix; use 256tok for a token count)"
            )
        return cls(fraction=value)

    def tail_tokens(self, matched: int) -> int:
        """Tokens t to replay for a matched prefix of `matched` tokens (never more than it)."""
        if self.tokens is not None:
            return min(self.tokens, matched)
        return min(matched, round(self.fraction * matched))

    def label(self) -> str | float:
        return f"{self.tokens}tok" if self.tokens is not None else self.fraction

    def __str__(self) -> str:
        return str(self.label())


@dataclass(frozen=True)
class Recipe:
    """How a method resumes a prompt from a hit.

    exact_kv_tokens  n: attention KV of [0, n) comes from the cache.
    state_position   s: linear states are known at s (s ≤ n) ...
    state_seed       ... from a stored checkpoint at s (True) or as zero (False).
    Tokens [s, n) are replayed for the linear states; [n, end) run as a normal prefill.
    """

    exact_kv_tokens: int
    state_position: int
    state_seed: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.state_position <= self.exact_kv_tokens:
            raise ValueError(f"invalid recipe: state position {self.state_position} > KV tokens {self.exact_kv_tokens}")


class Match(Protocol):
    """What a recipe may know of a hit: how long it is, where exact states are stored, how the gates decayed.

    A `CachedMatch` on cached prompts is one; so is a `PositionsMatch`, which the vLLM block store and the
    planner build from block metadata or arithmetic alone: a method decides from these, never
    from tensors.
    """

    @property
    def length(self) -> int: ...

    @property
    def decay(self) -> DecaySummary | None: ...

    def checkpoint_at_or_before(self, position: int) -> int | None: ...


@dataclass(frozen=True)
class PositionsMatch:
    """A match known by its length and checkpoint positions only."""

    length: int
    checkpoints: tuple[int, ...] = ()
    decay: DecaySummary | None = None

    def checkpoint_at_or_before(self, position: int) -> int | None:
        return max((p for p in self.checkpoints if p <= position), default=None)


class RecoveryMethod(Protocol):
    """A recovery method: its name is for display and keys; what it does is declared by its flags."""

    name: str
    uses_budget: bool  # its recipe depends on the replay budget
    uses_checkpoints: bool  # its recipe reads stored linear-state checkpoints
    reuses_kv: bool  # its recipe loads cached attention KV (False: the whole prompt is recomputed)
    # Its recipe may run as an engine (vLLM, through the connector) resumes a prompt: the KV of
    # [0, s) loaded, the linear states at s zero or a stored checkpoint, and [s, end) prefilled by
    # the engine, so the KV of [s, n) is recomputed rather than loaded (the recipe's
    # tail-replay-recompute form). False for a method whose point is that KV, or whose recipe needs
    # what pages alone cannot tell (the connector refuses it at start).
    engine_resumable: bool

    def recipe(self, hit: Match, budget: Budget | None) -> Recipe: ...


@dataclass(frozen=True)
class Outcome:
    logits: torch.Tensor  # float32 [logits_to_keep, vocab] for the last prompt positions
    cache: DynamicCache  # ready to decode after the prompt
    reused_tokens: int  # prompt tokens whose attention KV came from the cache
    replayed_tokens: int  # matched-prefix tokens pushed through the model
    recomputed_tokens: int  # prompt tokens whose attention KV was computed here


def dropped_state_bound(hit: CachedMatch | None, recipe: Recipe) -> float | None:
    """Bound on how much of the linear states lost by `recipe` can still be present at the hit.

    0 when the states are exact (seeded from a checkpoint, or started at position 0); otherwise
    the decay summary's bound over [state position, matched length), 1 meaning no guarantee;
    None when the cached prompt has no decay summary.
    """
    if hit is None or recipe.state_seed or recipe.state_position == 0:
        return 0.0
    if hit.cached.decay is None:
        return None
    return hit.cached.decay.bound(recipe.state_position, hit.length)


def check_hit(prompt: torch.Tensor, hit: CachedMatch | None) -> None:
    if hit is None:
        return
    if hit.length >= prompt.numel():
        raise HybridKVError(
            f"matched prefix ({hit.length} tokens) is not shorter than the prompt ({prompt.numel()} tokens); "
            "at least one token must be left to compute"
        )
    if hit.length > len(hit.cached):
        raise HybridKVError(
            f"matched prefix ({hit.length} tokens) is longer than the cached prompt ({len(hit.cached)})"
        )
    if not torch.equal(hit.cached.tokens[: hit.length], prompt[: hit.length]):
        raise HybridKVError("cache mismatch: the cached prompt does not share the claimed prefix with this prompt")


@dataclass(frozen=True)
class ResumePieces:
    """What one resume takes from its hit: KV before s, seed states at s, exact KV of the tail [s, n)."""

    kv: PromptKV | None
    seed: LinearStates | None
    tail_kv: PromptKV | None


def resume_pieces(
    model: HybridModel, prompt: torch.Tensor, hit: CachedMatch | None, recipe: Recipe, logits_to_keep: int
) -> ResumePieces:
    """Check `recipe` against `prompt` and `hit`, and take the cached pieces it needs (views, no copies)."""
    check_hit(prompt, hit)
    n, s = recipe.exact_kv_tokens, recipe.state_position
    matched = hit.length if hit is not None else 0
    if n > matched:
        raise ValueError(f"recipe reuses {n} KV tokens but only {matched} are matched")
    if logits_to_keep > prompt.numel() - n:
        raise ValueError(f"{logits_to_keep} logits asked but only {prompt.numel() - n} positions are computed")
    seed = None
    if recipe.state_seed:
        seed = hit.cached.checkpoints.get(s)
        if seed is None:
            raise ValueError(f"no stored checkpoint at position {s}")
    return ResumePieces(
        kv=hit.cached.kv_prefix(s) if s > 0 else None,
        seed=seed,
        tail_kv=hit.cached.kv_range(s, n) if n > s else None,
    )


def outcome(
    prompt: torch.Tensor, hit: CachedMatch | None, recipe: Recipe, logits: torch.Tensor, cache: DynamicCache
) -> Outcome:
    return Outcome(
        logits=logits,
        cache=cache,
        reused_tokens=recipe.exact_kv_tokens,
        replayed_tokens=(hit.length if hit is not None else 0) - recipe.state_position,
        recomputed_tokens=prompt.numel() - recipe.exact_kv_tokens,
    )


def execute(
    model: HybridModel, prompt: torch.Tensor, hit: CachedMatch | None, recipe: Recipe, logits_to_keep: int = 1
) -> Outcome:
    """Resume `prompt` from `hit` as `recipe` says and return the last positions' logits."""
    prompt = prompt.reshape(-1)
    pieces = resume_pieces(model, prompt, hit, recipe, logits_to_keep)
    cache = assemble_cache(model, pieces.kv, pieces.seed)
    # Replay and suffix run as one forward over [s, end): the linear layers carry their states
    # through the tail, while the attention layers keep the exact cached KV of [s, n).
    with exact_kv_for_first_tokens(model.description, cache, [pieces.tail_kv]):
        logits = model.forward(prompt[recipe.state_position :], cache, recipe.state_position, logits_to_keep)
    return outcome(prompt, hit, recipe, logits, cache)
