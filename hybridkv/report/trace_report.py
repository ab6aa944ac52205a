"""`hybridkv trace-sim`'s tables and plots: report.md and one plot per measure, from a sweep summary
(`hybridkv.eval.trace_sim.run_sweep`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

from hybridkv.eval.trace_sim import capacity_for

MEASURES = (
    ("token_hit_share", "token hit share"),
    ("exact_hit_share", "exact-hit share"),
    ("compute_saved_share", "prefill compute saved"),
)


def _capacity(gb: float | None) -> str:
    if gb is None:
        return "not reached"
    if gb == math.inf:
        return "unbounded"
    return f"{gb / 1000:.3g} TB" if gb >= 1000 else f"{gb:.3g} GB"


def _by_policy(summary: dict) -> dict[str, list[dict]]:
    policies: dict[str, list[dict]] = {}
    for row in summary["points"]:
        policies.setdefault(row["policy"], []).append(row)
    return {p: sorted(rows, key=lambda r: r["capacity_gb"]) for p, rows in policies.items()}


def sweep_tables(summary: dict) -> list[str]:
    """The headline (capacity for half the compute) and one row per policy and capacity, in markdown."""
    policies = _by_policy(summary)
    copies = summary["replicate"]
    largest = _capacity(max(r["capacity_gb"] for r in summary["points"]))
    lines = [
        f"{summary['trace']}: {summary['requests']:,} requests"
        + (f" × {copies} disjoint copies" if copies > 1 else "")
        + f"; {summary['model']}: KV {summary['kv_bytes_per_token']:,} B/token, linear states "
        f"{summary['state_bytes_per_checkpoint']:,} B per checkpoint; align block {summary['align_block']:,} tokens; "
        f"replay tail {summary['tail']:g} of the matched prefix",
        f"direct count of prefix hits (every earlier prompt's blocks kept): {summary['direct_prefix_hit_share']:.4f} "
        f"of input tokens; wall time {summary['wall_seconds']:.1f} s with {summary['workers']} workers",
        "",
        f"| policy | compute saved, {largest} | capacity to save 50% of prefill | capacity to save half its "
        + ("unbounded saving |" if largest == "unbounded" else f"saving at {largest} |"),
        "|---|---|---|---|",
    ]
    for policy, rows in policies.items():
        top = rows[-1]["compute_saved_share"]  # at the sweep's largest capacity, which the header names
        half, own_half = capacity_for(rows, 0.5), capacity_for(rows, top / 2)
        lines.append(f"| {policy} | {top:.3f} | {_capacity(half)} | {_capacity(own_half)} |")
    lines += [
        "",
        "| policy | capacity | token hit share | exact-hit share | compute saved | hits | exact hits | TB written "
        "| of it states | TB read | evicted | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, rows in policies.items():
        lines += [
            f"| {policy} | {_capacity(r['capacity_gb'])} | {r['token_hit_share']:.3f} | {r['exact_hit_share']:.3f} | "
            f"{r['compute_saved_share']:.3f} | {r['hits']:,} | {r['exact_hits']:,} | {r['bytes_written'] / 1e12:.2f} | "
            f"{r['state_bytes_written'] / 1e12:.2f} | {r['bytes_read'] / 1e12:.2f} | {r['evicted']:,} | "
            f"{r['seconds']:.1f} |"
            for r in rows
        ]
    return lines


def plot_sweep(summary: dict, path: Path) -> Path:
    """One panel per measure against capacity (log scale; the unbounded store drawn as a dashed level)."""
    policies = _by_policy(summary)
    finite_sweep = any(r["capacity_gb"] not in (0, math.inf) for r in summary["points"])
    figure = Figure(figsize=(15, 4.2))
    axes = figure.subplots(1, len(MEASURES) + 1)
    for ax, (key, title) in zip(axes, MEASURES, strict=False):
        for index, (policy, rows) in enumerate(policies.items()):
            finite = [r for r in rows if r["capacity_gb"] not in (0, math.inf)]
            color = f"C{index}"
            ax.plot([r["capacity_gb"] for r in finite], [r[key] for r in finite], "o-", color=color, label=policy)
            for r in rows:
                if r["capacity_gb"] == math.inf:
                    ax.axhline(r[key], color=color, linestyle=":", linewidth=1)
        if finite_sweep:
            ax.set_xscale("log")
        ax.set_xlabel("store capacity (GB)")
        ax.set_title(title + " (dotted: unbounded)")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for index, (policy, rows) in enumerate(policies.items()):
        finite = [r for r in rows if r["capacity_gb"] not in (0, math.inf)]
        ax.plot(
            [r["capacity_gb"] for r in finite],
            [r["bytes_written"] / 1e12 for r in finite],
            "o-",
            color=f"C{index}",
            label=policy,
        )
    if finite_sweep:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("store capacity (GB)")
    ax.set_title("TB written")
    ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(Path(summary["trace"]).name + f" on {summary['model']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def write_sweep(summary: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "report.md").write_text(
        "\n".join(["# Trace simulation", "", *sweep_tables(summary), "", "![sweep](sweep.png)"]) + "\n"
    )
    return [out / "summary.json", out / "report.md", plot_sweep(summary, out / "sweep.png")]
