"""`hybridkv ttft`: measured TTFT speedups at long matched prefixes, beside the cost-model bound.

It is `hybridkv validate`'s measurement — each method timed beside full prefill in the same
process, medians over repeats — at 8K/16K/32K with a short suffix, reduced to the rows the
speed question needs, plus the FLOP bound (`hybridkv.models.cost`) for each method's recomputed
span and a plot of measured speedup against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.eval.validate import ValidateConfig, run_validate
from hybridkv.methods import Budget
from hybridkv.models import HybridModel

TTFT_METHODS = ["full", "tail-replay", "tail-replay-recompute", "adaptive-replay", "checkpoint", "seeded-replay"]


@dataclass
class TTFTConfig(ValidateConfig):
    """validate's measurement at long prefixes with a short suffix: the methods above, one greedy token."""

    prefix_lengths: list[int] = field(
        default_factory=lambda: [8192, 16384, 32768], metadata={"help": "matched prefix lengths"}
    )
    suffix_length: int = field(default=16, metadata={"help": "new tokens after the matched prefix"})
    budgets: list[Budget] = field(
        default_factory=lambda: [Budget(fraction=0.02), Budget(fraction=0.05), Budget(fraction=0.1)],
        metadata={"help": "tail budgets (fractions or e.g. 256tok)"},
    )
    methods: list[str] = field(default_factory=lambda: list(TTFT_METHODS))
    checkpoint_interval: int | None = field(default=1024, metadata={"help": "state checkpoints every B tokens"})
    greedy_tokens: int = 1


FIELDS = (
    "method",
    "budget",
    "prefix_length",
    "replayed_tokens",
    "ttft_s",
    "full_ttft_s",
    "speedup",
    "bound",
    "decay_bound",
    "kl_mean",
)


def run_ttft(model: HybridModel, config: ValidateConfig, out: Path, show_progress: bool = True) -> dict:
    results = run_validate(model, config, show_progress=show_progress)
    rows = [{name: row[name] for name in FIELDS} for row in results["rows"]]
    for row in rows:
        row["of_bound"] = row["speedup"] / row["bound"] if row["bound"] else None
    summary = {"model": results["model"]["name"], "config": results["config"], "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, out / "ttft.png")
    return summary


def table(rows: list[dict]) -> str:
    lines = [
        "| method | budget | prefix | replayed | TTFT s | full s | speedup | bound | of bound | decay bound | KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = f"{r['bound']:.1f}x" if r["bound"] else "—"
        share = f"{r['of_bound']:.0%}" if r["of_bound"] else "—"
        decay = f"{r['decay_bound']:.1e}" if r.get("decay_bound") is not None else "—"
        lines.append(
            f"| {r['method']} | {r['budget'] if r['budget'] is not None else '—'} | {r['prefix_length']} | "
            f"{r.get('replayed_tokens', '—')} | {r['ttft_s']:.3f} | {r['full_ttft_s']:.3f} | {r['speedup']:.2f}x | "
            f"{bound} | {share} | {decay} | {r['kl_mean']:.2e} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Measured speedup against the cost-model bound: lines over prefix lengths, or bars for one length."""
    from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

    labels = sorted({(r["method"], str(r["budget"])) for r in rows if r["method"] != "full"})
    names = [method if budget == "None" else f"{method} @ {budget}" for method, budget in labels]
    lengths = sorted({r["prefix_length"] for r in rows})
    if len(lengths) == 1:
        by_label = {(r["method"], str(r["budget"])): r for r in rows}
        fig = Figure(figsize=(7, 0.35 * len(labels) + 1.5))
        ax = fig.subplots()
        y = range(len(labels))
        ax.barh([i + 0.2 for i in y], [by_label[label]["speedup"] for label in labels], 0.4, label="measured")
        ax.barh([i - 0.2 for i in y], [by_label[label]["bound"] or 0 for label in labels], 0.4, label="FLOP bound",
                alpha=0.5)  # fmt: skip
        ax.set_yticks(list(y), names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT speedup over full prefill")
        ax.set_title(f"matched prefix {lengths[0]:,} tokens")
        ax.legend(fontsize=7)
    else:
        fig = Figure(figsize=(7, 4.5))
        ax = fig.subplots()
        for index, ((method, budget), name) in enumerate(zip(labels, names, strict=True)):
            group = sorted((r for r in rows if (r["method"], str(r["budget"])) == (method, budget)),
                           key=lambda r: r["prefix_length"])  # fmt: skip
            color = f"C{index % 10}"
            marker = "os^v<>"[index // 10 % 6]
            ax.plot([r["prefix_length"] for r in group], [r["speedup"] for r in group], marker + "-", color=color,
                    label=name)  # fmt: skip
            if all(r["bound"] for r in group):
                ax.plot([r["prefix_length"] for r in group], [r["bound"] for r in group], "--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("matched prefix length (tokens)")
        ax.set_ylabel("TTFT speedup over full prefill")
        ax.set_title("measured (solid) vs cost-model bound (dashed)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
