"""The arena's method contract (KVShareArena's shape) and its registry.

A method is benchmarked through three calls:

    setup(model, config)                 once per run
    build_cache(source) -> Built         question-blind; its cost is reported apart
    answer(question, caches, config)     -> Answer: the text, its tokens and cost telemetry

Every recovery method of `hybridkv.methods` (built in, or registered under `hybridkv.recipes`) is
offered through `RecoveryArenaMethod`, plus the `no-context` floor. A method that needs its own
cache or answer loop, living outside this project, registers a factory under the entry point group
`hybridkv.methods` (in its own pyproject: `[project.entry-points."hybridkv.methods"]
my-method = "my_pkg.module:factory"`); the factory takes the budget (or None) and returns an
object with the three calls. `hybridkv arena run --methods my-method` then benchmarks it
without any edit here. (A method outside hybridkv may return its bare handle from build_cache: the
runner then reports the call's wall time as its cost.)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

import torch

from hybridkv.cache import CHECKPOINT_INTERVAL, CachedMatch, CachedPrompt, capture_prompt
from hybridkv.cache.chunks import EncodedChunk, encode_chunk
from hybridkv.cache.keys import model_fingerprint
from hybridkv.errors import HybridKVError
from hybridkv.eval.decode import greedy_continue
from hybridkv.methods import Budget, RecoveryMethod, execute, recovery_methods
from hybridkv.methods.chunked import PAIRS, execute_chunks, parse_pair
from hybridkv.models import HybridModel

ENTRY_POINT_GROUP = "hybridkv.methods"


@dataclass(frozen=True)
class Built:
    """What `build_cache` returns: the handle `answer` gets, and what building it cost."""

    handle: Any
    build_s: float  # a build served from an identical earlier one reports that one's cost


class CaptureCache:
    """Captures shared by the methods of one arena run; the runner owns one per run.

    Methods asking for the same capture of the same source share it, so a sample-major run
    prefills each document once per kind of capture (checkpoint interval), not once per method,
    and questions on one shared document reuse it. Keyed by the model's fingerprint (config and
    weights; never `id(model)`, which a freed model hands on to the next one), the checkpoint
    interval and the source tokens; the latest `capacity` captures are kept.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int | None, tuple[int, ...]], Built] = OrderedDict()

    def capture(self, model: HybridModel, fingerprint: str, source: list[int], interval: int | None) -> Built:
        key = (fingerprint, interval, tuple(source))
        if (built := self._entries.get(key)) is not None:
            self._entries.move_to_end(key)
            return built
        started = time.perf_counter()
        cached = capture_prompt(model, torch.tensor(source, dtype=torch.long), interval)
        built = Built(cached, time.perf_counter() - started)
        self._entries[key] = built
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return built


@dataclass
class ArenaConfig:
    max_new_tokens: int = 32  # the runner sets it per sample (the task's answer budget, capped by the user)
    checkpoint_interval: int | None = field(
        default=CHECKPOINT_INTERVAL,
        metadata={"help": "state checkpoints for checkpoint methods, every B tokens (0: none)"},
    )
    extra: dict[str, Any] = field(default_factory=dict)
    # The run's shared captures: `run_arena` gives each run its own. None: every build captures anew.
    captures: CaptureCache | None = field(default=None, repr=False, compare=False)
    # Cross-checkpoint reuse (KVShareArena's second axis): caches are built by this checkpoint of
    # the same family and the answers by the run's model. None: the run's model builds them.
    cache_model: HybridModel | None = field(default=None, repr=False, compare=False)


def cache_builder(model: HybridModel, config: ArenaConfig) -> HybridModel:
    """The model that builds a run's caches: `config.cache_model` when named (its cache layout must
    be the answering model's), else the answering model."""
    builder = config.cache_model
    if builder is None:
        return model
    if (difference := model.description.layout_difference(builder.description)) is not None:
        raise HybridKVError(
            f"caches built by {builder.name} do not fit {model.name} ({difference}): cross-checkpoint reuse "
            "needs two checkpoints of one architecture and size"
        )
    return builder


@dataclass
class Answer:
    text: str  # may be left "" by a method that only returns tokens; the runner decodes them
    tokens: list[int]
    ttft_s: float  # cache in hand -> first-token logits
    reused_tokens: int = 0
    replayed_tokens: int = 0
    recomputed_tokens: int = 0
    recomputed_layer_tokens: int = 0  # tokens pushed through the model × layers
    kv_bytes: int = 0
    state_bytes: int = 0


class ArenaMethod(Protocol):
    name: str
    budget: Budget | None

    def setup(self, model: HybridModel, config: ArenaConfig) -> None: ...

    def build_cache(self, source: list[int]) -> Built: ...

    def answer(self, question: list[int], caches: list[Any], config: ArenaConfig) -> Answer: ...


class RecoveryArenaMethod:
    """A prefix-reuse recovery method: the source is the cached prefix, the question follows it.

    Given several caches (a position-independent workload), the prompt is their tokens end to end
    and only the first is a prefix hit: the KV of the others was computed at other positions after
    other text, which a prefix method cannot use, so it recomputes them with the question.

    Captures come from the run's `CaptureCache` when the config has one; every method still
    reports the build time it would have paid.
    """

    def __init__(self, recovery: RecoveryMethod, budget: Budget | None) -> None:
        self.recovery = recovery
        self.budget = budget
        self.name = recovery.name

    def setup(self, model: HybridModel, config: ArenaConfig) -> None:
        self.model = model
        self.config = config
        self.builder = cache_builder(model, config)
        self.fingerprint = model_fingerprint(self.builder) if config.captures is not None else None

    def build_cache(self, source: list[int]) -> Built:
        if not self.recovery.reuses_kv:  # a method reusing no KV needs none built: keep the tokens
            return Built(CachedPrompt(torch.tensor(source, dtype=torch.long), {}), 0.0)
        interval = self.config.checkpoint_interval if self.recovery.uses_checkpoints else None
        if self.config.captures is not None:
            return self.config.captures.capture(self.builder, self.fingerprint, source, interval)
        started = time.perf_counter()
        cached = capture_prompt(self.builder, torch.tensor(source, dtype=torch.long), interval)
        return Built(cached, time.perf_counter() - started)

    def answer(self, question: list[int], caches: list[CachedPrompt], config: ArenaConfig) -> Answer:
        cached, *others = caches
        prompt = torch.cat(
            [cached.tokens, *(other.tokens for other in others), torch.tensor(question, dtype=torch.long)]
        )
        hit = CachedMatch(cached, len(cached))
        start = time.perf_counter()
        outcome = execute(self.model, prompt, hit, self.recovery.recipe(hit, self.budget), logits_to_keep=1)
        ttft = time.perf_counter() - start
        tokens = greedy_continue(
            self.model, outcome.cache, outcome.logits[-1], prompt.numel(), config.max_new_tokens, self.model.eos_ids
        )
        forwarded = prompt.numel() - hit.length + outcome.replayed_tokens  # everything after the state's position
        return Answer(
            text="",
            tokens=tokens,
            ttft_s=ttft,
            reused_tokens=outcome.reused_tokens,
            replayed_tokens=outcome.replayed_tokens,
            recomputed_tokens=outcome.recomputed_tokens,
            recomputed_layer_tokens=forwarded * self.model.description.num_layers,
            kv_bytes=cached.kv_bytes() if self.recovery.reuses_kv else 0,
            state_bytes=cached.state_bytes() if self.recovery.uses_checkpoints else 0,
        )


class NoContext:
    """The floor: answer the question without the cached material."""

    name = "no-context"
    budget = None

    def setup(self, model: HybridModel, config: ArenaConfig) -> None:
        self.model = model

    def build_cache(self, source: list[int]) -> Built:
        return Built(None, 0.0)

    def answer(self, question: list[int], caches: list[Any], config: ArenaConfig) -> Answer:
        prompt = torch.tensor(question, dtype=torch.long)
        cache = self.model.new_cache()
        start = time.perf_counter()
        logits = self.model.forward(prompt, cache, start=0, logits_to_keep=1)
        ttft = time.perf_counter() - start
        tokens = greedy_continue(
            self.model, cache, logits[-1], prompt.numel(), config.max_new_tokens, self.model.eos_ids
        )
        return Answer(
            text="",
            tokens=tokens,
            ttft_s=ttft,
            recomputed_tokens=prompt.numel(),
            recomputed_layer_tokens=prompt.numel() * self.model.description.num_layers,
        )


class ChunkedArenaMethod:
    """A position-independent pair (`ATTENTION+LINEAR`): every source is encoded on its own, from
    zero states, wherever it will sit (its build cost is reported apart), and the question is
    answered over the chunks in order by `execute_chunks`."""

    budget = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.attention, self.linear = parse_pair(name)

    def setup(self, model: HybridModel, config: ArenaConfig) -> None:
        self.model = model
        self.builder = cache_builder(model, config)

    def build_cache(self, source: list[int]) -> Built:
        started = time.perf_counter()
        chunk = encode_chunk(self.builder, torch.tensor(source, dtype=torch.long), with_maps=self.linear.needs_maps)
        return Built(chunk, time.perf_counter() - started)

    def answer(self, question: list[int], caches: list[EncodedChunk], config: ArenaConfig) -> Answer:
        start = time.perf_counter()
        outcome = execute_chunks(
            self.model, caches, torch.tensor(question, dtype=torch.long), self.attention, self.linear
        )
        ttft = time.perf_counter() - start
        length = sum(len(chunk) for chunk in caches) + len(question)
        tokens = greedy_continue(
            self.model, outcome.cache, outcome.logits[-1], length, config.max_new_tokens, self.model.eos_ids
        )
        parts = [chunk.nbytes() for chunk in caches]
        state_parts = (
            ("end_states", "conv_tails", "operators") if self.linear.needs_maps else ("end_states", "conv_tails")
        )
        return Answer(
            text="",
            tokens=tokens,
            ttft_s=ttft,
            reused_tokens=outcome.reused_tokens,
            recomputed_tokens=outcome.recomputed_tokens,
            recomputed_layer_tokens=outcome.recomputed_tokens * self.model.description.num_layers
            + outcome.selection_layer_tokens,
            kv_bytes=sum(part["attention_kv"] for part in parts),
            state_bytes=sum(part[k] for part in parts for k in state_parts) if self.linear.stores_states else 0,
        )


def available_methods() -> list[str]:
    return ["no-context", *recovery_methods(), *PAIRS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))]


def get_arena_method(name: str, budget: Budget | None) -> ArenaMethod:
    """A built-in method, the no-context floor, or one registered under the entry point group."""
    if name == "no-context":
        return NoContext()
    if "+" in name:
        return ChunkedArenaMethod(name)
    if (recovery := recovery_methods().get(name)) is not None:
        if recovery.uses_budget and budget is None:
            raise HybridKVError(f"method {name!r} needs a budget")
        return RecoveryArenaMethod(recovery, budget if recovery.uses_budget else None)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name == name:
            method = entry_point.load()(budget)
            for call in ("setup", "build_cache", "answer"):
                if not callable(getattr(method, call, None)):
                    raise HybridKVError(f"method {name!r} ({entry_point.value}) has no {call}() — see the contract")
            return method
    raise HybridKVError(f"unknown method {name!r}; known: {', '.join(available_methods())}")
