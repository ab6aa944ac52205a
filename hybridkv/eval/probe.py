"""`hybridkv probe`: does a model read its answer from the attention KV or from the linear states?

A recovery method keeps the attention KV exact and rebuilds (or drops) the linear states, so what it
keeps depends on where the model reads the answer. This is measured, not looked up, on samples the
model answers correctly with full prefill:

- **swap test**: a counterfactual context is the same text with every answer value changed (each digit
  shifted by 5, letters rotated: same length, same character classes). With the true context's KV
  and the counterfactual's states, does the answer follow the states (the other value)? With the
  counterfactual's KV and the true states, does it follow the KV? For a record set several times
  (`updates`: the latest setting asked) the counterfactual keeps every value and exchanges the
  latest setting with the first: the swap then asks where the *order* is read from. A counterfactual
  that tokenizes to another length than the true context (a BPE tokenizer may merge the changed
  characters otherwise) is refused for that sample: the swapped parts would not line up.
- **per linear layer**: that layer's state alone zeroed (is the answer kept?) or alone taken from
  the counterfactual (does the answer move to the other value?);
- **zero-state**: every state zeroed, the true KV kept;
- **retention vs needle position**: tail-replay at each budget, the answer kept or not, against how
  far the needle lies before the match end L (inside the replayed tail or not).

Every condition resumes the question at L from a cache assembled from those pieces; answers are
greedy, to the task's answer length, scored by the workload's own scorer against the true and the
counterfactual values.

The verdict (`verdict`) reads the swaps with zero-state and per-layer zeroing: an answer that follows
the KV in the swaps but is lost when the states are zeroed reads its value from attention and needs
the states to do it ("attention, with states"); `mixed` says which case it is (both parts carry the
answer, neither swap moves it, or the samples split between them); fewer solved samples than
`min_solved` give "too few solved". Every share comes with its count (`counts`: successes, samples),
from which reports print a 95% Wilson interval.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean

import torch
from tqdm import tqdm

from hybridkv.cache import (
    CachedMatch,
    CachedPrompt,
    LinearStates,
    PromptKV,
    assemble_cache,
    capture_prompt,
    zero_states,
)
from hybridkv.errors import HybridKVError
from hybridkv.eval.decode import greedy_continue
from hybridkv.eval.workloads import get_workload
from hybridkv.eval.workloads.base import Sample
from hybridkv.methods import METHODS, Budget, execute
from hybridkv.models import HybridModel

# A share at or above this decides a verdict: the answer follows the swapped part in at least half of
# the samples the model solves, so it reads from there more often than not.
VERDICT_SHARE = 0.5
PROBE_FILE = "hybridkv-probe.json"  # a probe kept beside a checkpoint, for model cards and arena reports


@dataclass
class ProbeConfig:
    """What `hybridkv probe` measures on. A field's `help` is its flag's text (`hybridkv.cli`)."""

    workload: str = field(default="ruler", metadata={"help": "workload whose samples are probed"})
    tasks: list[str] = field(
        default_factory=lambda: ["niah_single_1", "niah_single_2"],
        metadata={"help": "tasks whose answers appear verbatim in the context (the needle tasks, vt)"},
    )
    length: int = field(default=4096, metadata={"help": "sample length in tokens"})
    samples: int = field(default=10, metadata={"help": "samples per task (only those full prefill solves count)"})
    budgets: list[Budget] = field(
        default_factory=lambda: [Budget(fraction=f) for f in (0.02, 0.05, 0.1, 0.2, 0.5)],
        metadata={"help": "tail-replay budgets for the retention-vs-needle-position curve"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the samples"})
    min_solved: int = field(
        default=5, metadata={"help": "a task with fewer samples full prefill solves gets 'too few solved', no verdict"}
    )

    def check(self) -> None:
        if self.samples < 1 or self.length < 64:
            raise HybridKVError(f"probe needs at least 1 sample and 64 tokens (got {self.samples}, {self.length})")
        if not self.tasks:
            raise HybridKVError("probe needs at least one task")


def counterfactual(value: str) -> str:
    """`value` with every digit shifted by 5 and every letter rotated (hex digits within a-f for a
    hex-like value, such as a uuid): a different value of the same length and character classes."""
    hexlike = bool(re.fullmatch(r"[0-9a-f-]+", value)) and any(c in "abcdef" for c in value)
    out = []
    for c in value:
        if c.isascii() and c.isdigit():
            out.append(str((int(c) + 5) % 10))
        elif hexlike and c in "abcdef":
            out.append("abcdef"[("abcdef".index(c) + 3) % 6])
        elif c.isascii() and c.isalpha():
            base = ord("a") if c.islower() else ord("A")
            out.append(chr(base + (ord(c) - base + 13) % 26))
        else:
            out.append(c)
    return "".join(out)


@dataclass(frozen=True)
class Pieces:
    """A prefilled context: its attention KV and every linear layer's state at its end."""

    kv: PromptKV
    states: LinearStates


@dataclass
class SampleProbe:
    """One sample's answers under every condition: (score against the true values, against the
    counterfactual ones), each in [0, 1]."""

    id: str
    task: str
    kind: str  # "value" (every answer value changed) or "order" (the latest setting exchanged with the first)
    context_tokens: int
    needle_distance: int | None  # tokens from the farthest answer value's start to L
    full: float  # full prefill's score (the sample counts only when it is 1)
    conditions: dict[str, tuple[float, float]] = field(default_factory=dict)
    layers: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)  # layer -> zeroed / swapped
    replays: list[dict] = field(default_factory=list)  # per budget: tail tokens, needle inside it, kept


class Prober:
    def __init__(self, model: HybridModel, tokenizer, config: ProbeConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.workload = get_workload(config.workload)

    def _prefill(self, tokens: list[int]) -> tuple[CachedPrompt, Pieces]:
        """The context prefilled once: as a cached prompt (tail-replay's hit) and as its pieces."""
        cached = capture_prompt(self.model, torch.tensor(tokens, dtype=torch.long), len(tokens))
        return cached, Pieces(cached.attention, cached.checkpoints[len(tokens)])

    def _answer(self, kv: PromptKV | None, states: LinearStates, question: list[int], steps: int) -> list[int]:
        cache = assemble_cache(self.model, kv, states)
        start = len(kv) if kv else 0
        logits = self.model.forward(torch.tensor(question, dtype=torch.long), cache, start, 1)
        return greedy_continue(self.model, cache, logits[-1], start + len(question), steps, self.model.eos_ids)

    def _scores(self, sample: Sample, tokens: list[int], other: tuple[list[str], dict]) -> tuple[float, float]:
        text = self.tokenizer.decode(tokens)
        return (
            self.workload.score(sample.task, text, sample.golds, sample.meta),
            self.workload.score(sample.task, text, *other),
        )

    @staticmethod
    def counterfactual_of(sample: Sample) -> tuple[str, str, list[str], dict, list[str]] | None:
        """(kind, counterfactual context, its golds, the meta they are scored with, the values swapped),
        or None when no answer value occurs in the context (nothing to swap)."""
        stale = sample.meta.get("stale")
        if stale and len(sample.golds) == 1 and sample.golds[0] in sample.context:
            # order: the latest value and the first are exchanged, every value stays in the text
            gold, first = sample.golds[0], stale[0]
            marker = "\x00"
            swapped = sample.context.replace(gold, marker).replace(first, gold).replace(marker, first)
            return "order", swapped, [first], {**sample.meta, "stale": [gold, *stale[1:]]}, [first, gold]
        values = sorted({g for g in sample.golds if g and g in sample.context}, key=len, reverse=True)
        if not values:
            return None
        swapped = sample.context
        for value in values:  # longest first, so a value inside another is not half-replaced
            swapped = swapped.replace(value, counterfactual(value))
        return "value", swapped, [counterfactual(g) for g in sample.golds], sample.meta, values

    def probe(self, sample: Sample) -> SampleProbe | str:
        """Every condition on one sample, or why it was skipped ("no value in context": nothing to swap;
        "counterfactual length": the counterfactual context tokenizes to another length)."""
        made = self.counterfactual_of(sample)
        if made is None:
            return "no value in context"
        kind, swapped, other_golds, other_meta, values = made
        other = (other_golds, other_meta)
        context = self.tokenizer.encode(sample.context)
        if len(self.tokenizer.encode(swapped)) != len(context):
            return "counterfactual length"
        question = self.tokenizer.encode(sample.question)
        steps = sample.meta.get("tokens_to_generate", 32)
        # the farthest value an answer needs; for an order probe, where the latest setting starts
        first = sample.meta["answer_offset"] if kind == "order" else min(sample.context.index(v) for v in values)
        result = SampleProbe(
            id=sample.id,
            task=sample.task,
            kind=kind,
            context_tokens=len(context),
            needle_distance=len(context) - len(self.tokenizer.encode(sample.context[:first])),
            full=0.0,
        )
        prompt = torch.tensor(context + question, dtype=torch.long)
        full = execute(self.model, prompt, None, METHODS["full"].recipe(None, None))
        tokens = greedy_continue(self.model, full.cache, full.logits[-1], len(prompt), steps, self.model.eos_ids)
        result.full = self._scores(sample, tokens, other)[0]
        if result.full < 1.0:
            return result  # the model does not solve it: nothing to attribute
        (cached, true), (_, fake) = self._prefill(context), self._prefill(self.tokenizer.encode(swapped))
        zero = zero_states(self.model)
        runs = {
            "resumed": (true.kv, true.states),
            "kv_swap": (fake.kv, true.states),
            "state_swap": (true.kv, fake.states),
            "zero_state": (true.kv, zero),
        }
        for name, (kv, states) in runs.items():
            result.conditions[name] = self._scores(sample, self._answer(kv, states, question, steps), other)
        for layer in self.model.description.linear_layers:
            result.layers[layer] = {
                "zeroed": self._scores(
                    sample, self._answer(true.kv, {**true.states, layer: zero[layer]}, question, steps), other
                ),
                "swapped": self._scores(
                    sample, self._answer(true.kv, {**true.states, layer: fake.states[layer]}, question, steps), other
                ),
            }
        hit = CachedMatch(cached, len(context))
        replay = METHODS["tail-replay"]
        for budget in self.config.budgets:
            recipe = replay.recipe(hit, budget)
            outcome = execute(self.model, prompt, hit, recipe)
            tokens = greedy_continue(
                self.model, outcome.cache, outcome.logits[-1], len(prompt), steps, self.model.eos_ids
            )
            tail = len(context) - recipe.state_position
            result.replays.append(
                {
                    "budget": budget.label(),
                    "tail_tokens": tail,
                    "needle_in_tail": result.needle_distance <= tail,
                    "kept": self._scores(sample, tokens, other)[0],
                }
            )
        return result


def find_probe(model: str, run_dir: Path | None = None) -> dict | None:
    """The probe of `model` (a built-in name or a checkpoint directory): `run_dir/probe.json` when a
    probe was written there, else the one kept beside the checkpoint (built-in trained models ship
    theirs); None when there is none. An unreadable one is refused, never taken for none."""
    from hybridkv.models.tiny import TRAINED_MODELS

    candidates = [run_dir / "probe.json"] if run_dir is not None else []
    model_dir = TRAINED_MODELS.get(model) or (Path(model) if Path(model).is_dir() else None)
    if model_dir is not None:
        candidates.append(model_dir / PROBE_FILE)
    for path in candidates:
        if path.is_file():
            try:
                summary = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise HybridKVError(f"{path}: not a hybridkv probe ({err})") from None
            if not isinstance(summary, dict) or not {"reads_from", "tasks", "config"} <= summary.keys():
                raise HybridKVError(f"{path}: not a hybridkv probe (no verdict, tasks and config)")
            return summary
    return None


def _share(values: list[float]) -> float | None:
    return mean(values) if values else None


def _layers(word: str, layers: list[int]) -> str:
    return f"{word}, layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}" if layers else word


def verdict(
    follows_kv: float | None,
    follows_states: float | None,
    zero_state_kept: float | None = None,
    state_layers: list[int] = (),
    needed_layers: list[int] = (),
    kind: str = "value",
) -> str:
    """Where the answer is read from, over the solved samples:

    - 'attention': it follows the KV in the swaps and survives zeroed states;
    - 'attention, with states[, layer N]': it follows the KV but is lost when every state is zeroed
      (the layers whose zeroing alone loses it named): the value is in attention, reading it needs
      the states, so a recovered state is at stake though the needle is not in one;
    - 'states[, layer N]': it follows the states (the layers whose state alone carries it named);
    - 'mixed: both' (each swap moves it), 'mixed: neither' (no swap moves it in as many as half),
      'mixed: split' (some samples follow one part, some the other, neither in half);
    - 'unmeasured' (no sample solved).
    An order probe (kind "order") says the same of the order: 'order from attention', 'order from states'.
    """
    if follows_kv is None or follows_states is None:
        return "unmeasured"
    if follows_states >= VERDICT_SHARE > follows_kv:
        found = _layers("states", list(state_layers))
    elif follows_kv >= VERDICT_SHARE > follows_states:
        needs = zero_state_kept is not None and zero_state_kept < VERDICT_SHARE
        found = _layers("attention, with states", list(needed_layers)) if needs else "attention"
    elif follows_kv >= VERDICT_SHARE and follows_states >= VERDICT_SHARE:
        found = "mixed: both"
    elif follows_kv + follows_states < VERDICT_SHARE:
        found = "mixed: neither"
    else:
        found = "mixed: split"
    return f"order from {found}" if kind == "order" else found


def summarise_task(
    task: str, probes: list[SampleProbe], linear_layers: list[int], budgets: list[Budget], min_solved: int = 1
) -> dict:
    solved = [p for p in probes if p.full >= 1.0]
    counts: dict[str, list[int]] = {}  # share name -> [successes, samples], for its interval

    def share(name: str, which: int) -> float | None:
        values = [p.conditions[name][which] for p in solved]
        counts[f"{name}_{('kept', 'follows')[which]}"] = [round(sum(values)), len(values)]
        return _share(values)

    layers = []
    for layer in linear_layers:
        layers.append(
            {
                "layer": layer,
                "zeroed_kept": _share([p.layers[layer]["zeroed"][0] for p in solved]),
                "swapped_follows_other": _share([p.layers[layer]["swapped"][1] for p in solved]),
            }
        )
    carrying = [row["layer"] for row in layers if (row["swapped_follows_other"] or 0.0) >= VERDICT_SHARE]
    needed = [row["layer"] for row in layers if row["zeroed_kept"] is not None and row["zeroed_kept"] < VERDICT_SHARE]
    follows_kv, follows_states, zero_kept = share("kv_swap", 1), share("state_swap", 1), share("zero_state", 0)
    kind = "order" if solved and all(p.kind == "order" for p in solved) else "value"
    if 0 < len(solved) < min_solved:
        found = f"too few solved ({len(solved)} < {min_solved})"
    else:
        found = verdict(follows_kv, follows_states, zero_kept, carrying, needed, kind)
    replay = []
    for budget in budgets:
        points = [r for p in solved for r in p.replays if r["budget"] == budget.label()]
        inside = [r["kept"] for r in points if r["needle_in_tail"]]
        outside = [r["kept"] for r in points if not r["needle_in_tail"]]
        replay.append(
            {
                "budget": budget.label(),
                "tail_tokens_mean": _share([r["tail_tokens"] for r in points]),
                "kept": _share([r["kept"] for r in points]),
                "needle_in_tail_kept": _share(inside),
                "needle_in_tail_n": len(inside),
                "needle_outside_kept": _share(outside),
                "needle_outside_n": len(outside),
            }
        )
    return {
        "task": task,
        "samples": len(probes),
        "solved": len(solved),
        "probe": kind,
        "reads_from": found,
        "resumed_kept": share("resumed", 0),
        "kv_swap_follows_kv": follows_kv,
        "kv_swap_kept": share("kv_swap", 0),
        "state_swap_follows_states": follows_states,
        "state_swap_kept": share("state_swap", 0),
        "zero_state_kept": zero_kept,
        "counts": counts,
        "layers": layers,
        "replay": replay,
    }


def overall_verdict(tasks: list[dict]) -> str:
    """One phrase for the model: the tasks' shared verdict, or each task's where they differ."""
    measured = {t["task"]: t["reads_from"] for t in tasks if t["reads_from"] != "unmeasured"}
    if measured and all(found.startswith("too few solved") for found in measured.values()):
        return "too few solved"
    if not measured:
        return "unmeasured"
    if len(set(measured.values())) == 1:
        return next(iter(measured.values()))
    return "; ".join(f"{task}: {found}" for task, found in measured.items())


def run_probe(model: HybridModel, tokenizer, config: ProbeConfig, show_progress: bool = True) -> dict:
    """Probe `config.samples` samples of each task; the summary `hybridkv probe` writes (probe.json)."""
    config.check()
    workload = get_workload(config.workload)
    if unknown := [t for t in config.tasks if t not in workload.tasks]:
        known = ", ".join(workload.tasks)
        raise HybridKVError(f"unknown {config.workload} task(s) {', '.join(unknown)}; known: {known}")
    prober = Prober(model, tokenizer, config)
    samples = []
    for task in config.tasks:
        try:
            samples += workload.generate(task, config.length, config.samples, tokenizer, config.seed, None)
        except ValueError as err:  # a generator's refusal (a length too short for the task)
            raise HybridKVError(f"probe: {config.workload} {task} at {config.length} tokens: {err}") from None
    probes: dict[str, list[SampleProbe]] = {task: [] for task in config.tasks}
    skipped: dict[str, dict[str, int]] = {task: {} for task in config.tasks}
    for sample in tqdm(samples, desc="probe", disable=not show_progress):
        found = prober.probe(sample)
        if isinstance(found, str):
            skipped[sample.task][found] = skipped[sample.task].get(found, 0) + 1
        else:
            probes[sample.task].append(found)
    linear = model.description.linear_layers
    tasks = [summarise_task(task, probes[task], linear, config.budgets, config.min_solved) for task in config.tasks]
    for row in tasks:
        row["skipped"] = skipped[row["task"]]  # reason -> samples: none to swap, or a counterfactual of other length
    return {
        "model": model.name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "config": {**asdict(config), "budgets": [b.label() for b in config.budgets]},
        "linear_layers": linear,
        "attention_layers": model.description.attention_layers,
        "reads_from": overall_verdict(tasks),
        "tasks": tasks,
        "samples": [asdict(p) for task in config.tasks for p in probes[task]],
    }
