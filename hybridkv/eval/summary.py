"""`hybridkv arena score`: summary.json rebuilt from results.jsonl (scores recomputed from predictions).

For each (workload, task, length, method, budget): n, mean score, retention against full
prefill and PGR — (method − floor) / (oracle − floor) with the no-context floor and the
full-prefill oracle on the same samples — each with a paired bootstrap 95% CI; where the workload
marks the answer's source (`updates`), the needle-in-tail split of a replaying method; how far into full
prefill's answer each method agrees with it (`agreement_with_full`), the share of answers equal
to full prefill's to the last token (`same_as_full`: a task score that credits any answer holding
the gold misses an answer that runs on past its end), plus the cost means
(token and byte counts) and medians (times).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

from hybridkv.eval.stats import (
    bootstrap_mean_ci,
    paired_bootstrap_pgr_ci,
    paired_bootstrap_retention_ci,
    pgr,
    retention,
)

COSTS = ("recomputed_layer_tokens", "dense_layer_tokens", "kv_bytes", "state_bytes")
TIMES = ("ttft_s", "build_s")  # medians: one slow outlier on a shared machine should not move them


def rescore(rows: list[dict], score: Callable[[dict], float]) -> list[dict]:
    """The rows with `score(row)` recomputed from each stored prediction."""
    return [{**row, "score": score(row)} for row in rows]


def agreement(prediction: str, reference: str) -> float:
    """The share of `reference` that `prediction` reproduces before their first difference (1.0 if equal)."""
    if prediction == reference:
        return 1.0
    same = next((i for i, (a, b) in enumerate(zip(prediction, reference, strict=False)) if a != b), None)
    if same is None:
        same = min(len(prediction), len(reference))
    return same / len(reference) if reference else 0.0


OVERALL = "overall"


def needle_split(samples: dict[str, dict], oracle: dict[str, dict], matched: list[str]) -> dict | None:
    """On the samples full prefill solves, the share a method keeps when the answer's source (`updates`'
    latest setting) lies inside the tail it replayed against when it lies before it: whether a tail
    recovers what it re-reads or more. None for rows without a marked source or without a replay."""

    def replays_a_tail(row: dict) -> bool:  # full prefill "replays" the whole context: no tail
        return row.get("needle_distance") is not None and 0 < (row.get("replayed_tokens") or 0) < row["context_tokens"]

    solved = [i for i in matched if oracle[i]["score"] > 0 and replays_a_tail(samples[i])]
    if not solved:
        return None
    inside = [samples[i]["score"] for i in solved if samples[i]["needle_distance"] <= samples[i]["replayed_tokens"]]
    outside = [samples[i]["score"] for i in solved if samples[i]["needle_distance"] > samples[i]["replayed_tokens"]]
    return {
        "inside_n": len(inside),
        "inside_kept": statistics.fmean(inside) if inside else None,
        "outside_n": len(outside),
        "outside_kept": statistics.fmean(outside) if outside else None,
    }


def _over_known(statistic: Callable, samples: dict[str, dict], ids: list[str], field: str) -> float | None:
    """`statistic` of a cost over the rows that report it (a served run has no byte counts), else None."""
    known = [samples[i][field] for i in ids if samples[i].get(field) is not None]
    return statistic(known) if known else None


def summarise(rows: list[dict]) -> dict:
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        key = (row["workload"], row["task"], row["length"], row["method"], row["budget"])
        groups[key][row["id"]] = row  # a resumed run never holds two rows per id; keep the last
    # Where a run holds several tasks at one length, an "overall" row pools their samples (each task
    # weighs by its sample count), with its own paired bootstrap CI over the pooled samples.
    tasks_at: dict[tuple, set[str]] = defaultdict(set)
    for workload, task, length, _, _ in groups:
        tasks_at[(workload, length)].add(task)
    for (workload, task, length, method, budget), samples in list(groups.items()):
        if len(tasks_at[(workload, length)]) > 1:
            pooled = groups[(workload, OVERALL, length, method, budget)]
            pooled.update({f"{task}|{i}": row for i, row in samples.items()})
    by_setting: dict[tuple, dict[str, dict[str, dict]]] = defaultdict(dict)
    for (workload, task, length, method, budget), samples in groups.items():
        by_setting[(workload, task, length)][f"{method}|{budget}"] = samples
    summary = []
    for (workload, task, length, method, budget), samples in sorted(groups.items(), key=lambda kv: str(kv[0])):
        setting = by_setting[(workload, task, length)]
        oracle = setting.get("full|None", {})
        floor = setting.get("no-context|None", {})
        ids = sorted(samples)
        scores = [samples[i]["score"] for i in ids]
        mean = statistics.fmean(scores)
        paired = [i for i in ids if i in oracle and i in floor]
        method_scores = [samples[i]["score"] for i in paired]
        oracle_scores = [oracle[i]["score"] for i in paired]
        floor_scores = [floor[i]["score"] for i in paired]
        oracle_mean = statistics.fmean(oracle_scores) if paired else None
        floor_mean = statistics.fmean(floor_scores) if paired else None
        matched = [i for i in ids if i in oracle]  # samples full prefill also answered
        summary.append(
            {
                "workload": workload,
                "task": task,
                "length": length,
                "method": method,
                "budget": budget,
                "n": len(ids),
                "score": mean,
                "score_ci95": list(bootstrap_mean_ci(scores)),
                "retention": retention(mean, statistics.fmean(oracle[i]["score"] for i in matched))
                if matched
                else None,
                "retention_ci95": list(ci)
                if matched
                and (
                    ci := paired_bootstrap_retention_ci(
                        [samples[i]["score"] for i in matched], [oracle[i]["score"] for i in matched]
                    )
                )  # fmt: skip
                else None,
                "pgr": pgr(statistics.fmean(method_scores), floor_mean, oracle_mean) if paired else None,
                # How far into full prefill's answer the method agrees with it: telling even where
                # the task scores sit at the floor (the random-weight tiny models).
                "agreement_with_full": statistics.fmean(
                    agreement(samples[i]["prediction"], oracle[i]["prediction"]) for i in matched
                )
                if matched
                else None,
                "same_as_full": statistics.fmean(samples[i]["prediction"] == oracle[i]["prediction"] for i in matched)
                if matched
                else None,
                "pgr_ci95": list(ci)
                if paired and (ci := paired_bootstrap_pgr_ci(method_scores, floor_scores, oracle_scores))
                else None,
                "needle_in_tail": needle_split(samples, oracle, matched),
                **{cost: _over_known(statistics.fmean, samples, ids, cost) for cost in COSTS},
                **{time: _over_known(statistics.median, samples, ids, time) for time in TIMES},
            }
        )
    return {"rows": summary}
