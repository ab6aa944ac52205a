"""`hybridkv arena run`: task-level validation of methods through the contract.

One row per (sample, method, budget) is appended to `results.jsonl` as soon as it is scored, so
a killed run resumes where it stopped: rows already present (same sample id, method, budget)
are skipped, never duplicated. Scores are recomputed from the stored predictions by
`hybridkv arena score`, never trusted from a method.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from hybridkv.errors import HybridKVError
from hybridkv.eval.contract import ArenaConfig, Built, CaptureCache, get_arena_method
from hybridkv.eval.jsonl import read_jsonl
from hybridkv.methods import Budget
from hybridkv.models import HybridModel


@dataclass
class ArenaPlan:
    """Which methods `hybridkv arena run` answers a workload with. A field's `help` is its flag's
    text (`hybridkv.cli`)."""

    workload: str = field(
        default="ruler",
        metadata={
            "help": "ruler (generated), longbench (needs --data), prefix (shared documents, diverging questions), "
            "multi-turn (each turn extends the last), rag (retrieved passages, each cached alone), "
            "agent-reports (sub-agents' reports, each cached alone; the answer needs two), "
            "kvsharearena (KVShareArena's frozen querysets, one cache per declared chunk; needs --data), "
            "updates (records set again later, the latest asked: order known only through the linear states)"
        },
    )
    methods: list[str] = field(
        default_factory=lambda: ["no-context", "full", "zero-state", "checkpoint", "tail-replay"],
        metadata={
            "help": "methods (no-context is the PGR floor, full the oracle; entry-point methods work too); "
            "NAME@BUDGET runs a budgeted method at that budget only, e.g. tail-replay-recompute@0.05; "
            "ATTENTION+LINEAR runs a position-independent pair over separately encoded chunks, e.g. epic+linearkv "
            "(attention: naive, position-corrected, epic, cacheblend, prophet; "
            "linear: zero, linearkv, linearkv-relevant, compose)"
        },
    )
    budgets: list[Budget] = field(
        default_factory=lambda: [Budget(fraction=0.05), Budget(fraction=0.1)],
        metadata={"help": "budgets for methods that take one"},
    )


def row_key(sample_id: str, method: str, budget) -> tuple[str, str, str]:
    return sample_id, method, str(budget)


# A served run's shadow checks (the connector's `shadow_log`), one JSON line per checked request,
# beside its results.jsonl
SHADOW_CHECKS = "shadow-checks.jsonl"


def read_rows(path: Path) -> list[dict]:
    """Rows of a results file. A last line cut short by a kill is dropped (its sample reruns); any
    other unreadable line is refused with its line number (HybridKVError), never skipped."""
    return read_jsonl(path, torn_tail_ok=True) if path.exists() else []


def method_grid(plan: ArenaPlan) -> list[tuple[str, Budget | None]]:
    """(method, budget) settings: each budgeted method at every plan budget, or at the one its
    entry pins (`tail-replay-recompute@0.05`), so a table need not be a full product."""
    from hybridkv.methods import recovery_methods

    methods = recovery_methods()
    grid = []
    for entry in plan.methods:
        name, _, pinned = entry.partition("@")
        uses_budget = methods[name].uses_budget if name in methods else False
        if pinned and not uses_budget:
            raise HybridKVError(f"method {name!r} takes no budget, so {entry!r} names none to run")
        for budget in ([Budget.parse(pinned)] if pinned else plan.budgets) if uses_budget else [None]:
            grid.append((name, budget))
    return grid


def answer_budget(sample, default: int, cap: int | None) -> int:
    """Tokens to generate for `sample`: its own budget (RULER sets one per task) or `default`,
    capped by `cap` when given."""
    budget = sample.meta.get("tokens_to_generate", default)
    return budget if cap is None else min(budget, cap)


def scored_row(workload: str, sample, method: str, budget: Budget | None, prediction: str, score) -> dict:
    """The part of a results row that names the sample and the method and scores the prediction
    (the harness and the served arena add their own cost fields)."""
    return {
        "workload": workload,
        "id": sample.id,
        "task": sample.task,
        "length": sample.length,
        "method": method,
        "budget": budget.label() if budget else None,
        "prediction": prediction,
        "golds": sample.golds,
        "score": score(sample.task, prediction, sample.golds, sample.meta),
        "score_meta": {k: sample.meta[k] for k in ("all_classes", "stale") if sample.meta.get(k)},
    }


def needle_distance(sample, tokenizer, context_tokens: int) -> int | None:
    """Tokens from where the answer's source starts (`meta["answer_offset"]`, a character offset into
    the context: `updates`' latest setting) to the context's end (`context_tokens` long), for a
    one-piece context; None when the workload marks no such place. A tail replay holds the source
    when it is at most its length."""
    offset = sample.meta.get("answer_offset")
    if offset is None or sample.chunks:
        return None
    return context_tokens - len(tokenizer.encode(sample.context[:offset]))


def run_arena(
    model: HybridModel,
    tokenizer,
    samples: Iterable,
    plan: ArenaPlan,
    config: ArenaConfig,
    out_dir: Path,
    score,
    show_progress: bool = True,
    max_new_tokens: int | None = None,
) -> Path:
    """Answer every sample with every (method, budget); append scored rows to out_dir/results.jsonl.

    Each answer may use the sample's own generation budget (`meta["tokens_to_generate"]`, as RULER
    sets per task), capped by `max_new_tokens` when given.
    """
    config = dataclasses.replace(config, captures=CaptureCache())  # this run's captures, shared by its methods
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    existing = read_rows(results)
    # Rewrite without any torn last line, so appends start on a clean line.
    results.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in existing))
    done = {row_key(row["id"], row["method"], row["budget"]) for row in existing}
    grid = method_grid(plan)
    methods = {}
    for name, budget in grid:
        method = get_arena_method(name, budget)
        method.setup(model, config)
        methods[(name, str(budget))] = method
    samples = list(samples)
    todo = [(s, n, b) for s in samples for n, b in grid if row_key(s.id, n, b.label() if b else None) not in done]
    with results.open("a") as sink, tqdm(total=len(todo), desc="arena", disable=not show_progress) as progress:
        for sample, name, budget in todo:
            method = methods[(name, str(budget))]
            # Each separately cached piece is tokenised alone: the prompt is their tokens end to end.
            pieces = [tokenizer.encode(segment) for segment in sample.segments()]
            context = [token for piece in pieces for token in piece]
            question = tokenizer.encode(sample.question)
            caches, build_s = [], 0.0
            for piece in pieces:
                started = time.perf_counter()
                built = method.build_cache(piece)
                if not isinstance(built, Built):  # a method from outside hybridkv returns its bare handle
                    built = Built(built, time.perf_counter() - started)
                build_s += built.build_s
                if built.handle is not None:
                    caches.append(built.handle)
            budget_tokens = answer_budget(sample, config.max_new_tokens, max_new_tokens)
            sample_config = dataclasses.replace(config, max_new_tokens=budget_tokens)
            answer = method.answer(question, caches, sample_config)
            prediction = answer.text or tokenizer.decode(answer.tokens)
            row = {
                **scored_row(plan.workload, sample, name, budget, prediction, score),
                "context_tokens": len(context),
                "chunks": len(pieces),
                "question_tokens": len(question),
                "reused_tokens": answer.reused_tokens,
                "replayed_tokens": answer.replayed_tokens,
                "needle_distance": needle_distance(sample, tokenizer, len(context)),
                "recomputed_tokens": answer.recomputed_tokens,
                "recomputed_layer_tokens": answer.recomputed_layer_tokens,
                "dense_layer_tokens": (len(context) + len(question)) * model.description.num_layers,
                "kv_bytes": answer.kv_bytes,
                "state_bytes": answer.state_bytes,
                "ttft_s": answer.ttft_s,
                "build_s": build_s,
                "cache_model": None if config.cache_model is None else config.cache_model.name,
            }
            sink.write(json.dumps(row, sort_keys=True) + "\n")
            sink.flush()
            progress.update()
    return results
