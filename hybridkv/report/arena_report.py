"""`hybridkv arena report DIR`: report.md and report.html with plots, from DIR/summary.json."""

from __future__ import annotations

import base64
import html
import json
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

from hybridkv.eval.summary import OVERALL  # noqa: E402

COLUMNS = ["task", "length", "method", "budget", "n", "score", "retention", "pgr", "pgr_ci95", "agreement_with_full",
           "same_as_full", "ttft_s", "build_s", "recomputed_layer_tokens", "kv_bytes", "state_bytes"]  # fmt: skip


def _label(row: dict) -> str:
    return row["method"] if row["budget"] is None else f"{row['method']} @ {row['budget']}"


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _per_method(rows: list[dict], key: str) -> dict[str, float]:
    """Mean over tasks and lengths of `key`, per method label (None values left out)."""
    values: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get(key) is not None:
            values[_label(row)].append(row[key])
    return {label: _mean(v) for label, v in values.items()}


def plot_quality_vs_budget(rows: list[dict], path: Path) -> None:
    """Task score, and agreement with full prefill's answer, against the replay budget."""
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for ax, key, title in (
        (axes[0], "score", "Task score vs budget"),
        (axes[1], "agreement_with_full", "Agreement with full prefill's answer vs budget"),
    ):
        by_method: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        flat: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            if row.get(key) is None:
                continue
            if isinstance(row["budget"], int | float):
                by_method[row["method"]][row["budget"]].append(row[key])
            elif row["budget"] is None:
                flat[row["method"]].append(row[key])
        for method, points in sorted(by_method.items()):
            budgets = sorted(points)
            ax.plot(budgets, [_mean(points[b]) for b in budgets], marker="o", label=method)
        for index, (method, values) in enumerate(sorted(flat.items())):
            ax.axhline(_mean(values), linestyle="--", color=f"C{(index + 3) % 10}", label=method)
        ax.set(xlabel="replay budget (fraction of the matched prefix)", ylabel=f"mean {key}", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_pgr(rows: list[dict], path: Path) -> None:
    labels, values, low, high = [], [], [], []
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["pgr"] is not None:
            grouped[_label(row)].append(row)
    for label, group in sorted(grouped.items()):
        labels.append(label)
        value = _mean([r["pgr"] for r in group])
        cis = [r["pgr_ci95"] for r in group if r["pgr_ci95"]]
        values.append(value)
        low.append(value - _mean([c[0] for c in cis]) if cis else 0.0)
        high.append(_mean([c[1] for c in cis]) - value if cis else 0.0)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if labels:
        ax.bar(labels, values, yerr=[[max(v, 0) for v in low], [max(v, 0) for v in high]], capsize=4)
        ax.tick_params(axis="x", rotation=30, labelsize=7)
    else:
        ax.text(0.5, 0.5, "PGR undefined: full prefill does not beat the no-context floor", ha="center", fontsize=8)
    ax.set(ylabel="PGR (gap recovered)", title="PGR per method, 95% CI")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_speedup(rows: list[dict], path: Path) -> None:
    full = {(r["task"], r["length"]): r["ttft_s"] for r in rows if r["method"] == "full"}
    curves: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        reference = full.get((row["task"], row["length"]))
        if reference and row["method"] not in ("full", "no-context") and row["ttft_s"]:
            curves[_label(row)][row["length"]].append(reference / row["ttft_s"])
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, points in sorted(curves.items()):
        lengths = sorted(points)
        ax.plot(lengths, [_mean(points[n]) for n in lengths], marker="o", label=label)
    ax.set(xlabel="prompt length (tokens)", ylabel="TTFT speedup vs full prefill", title="TTFT speedup")
    if curves:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_bytes(rows: list[dict], path: Path) -> None:
    kv, state = _per_method(rows, "kv_bytes"), _per_method(rows, "state_bytes")
    labels = sorted(kv)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.bar(labels, [kv[l] / 2**20 for l in labels], label="attention KV")  # noqa: E741
    ax.bar(labels, [state[l] / 2**20 for l in labels], bottom=[kv[l] / 2**20 for l in labels], label="states")  # noqa: E741
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    ax.set(ylabel="MiB held per cached document", title="Bytes per method")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PLOTS = {
    "quality_vs_budget.png": plot_quality_vs_budget,
    "pgr.png": plot_pgr,
    "ttft_speedup.png": plot_speedup,
    "bytes.png": plot_bytes,
}


def write_arena_report(out_dir: Path) -> tuple[Path, Path]:
    summary = json.loads((out_dir / "summary.json").read_text())
    rows = summary["rows"]
    # The plots average over tasks themselves; the pooled "overall" rows stay in the tables only.
    per_task = [row for row in rows if row["task"] != OVERALL]
    for name, plot in PLOTS.items():
        plot(per_task, out_dir / name)
    table_md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table_md += ["| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    md = [
        f"# hybridkv arena — {out_dir}",
        "",
        "Scores are recomputed from the stored predictions. Retention = method / full prefill; PGR = (method − "
        "no-context floor) / (full − floor), undefined when full does not beat the floor by 1e-3; CIs are paired "
        "bootstrap 95%; agreement_with_full is the share of full prefill's answer a method reproduces before its "
        "first difference; same_as_full the share of answers equal to full prefill's to the end.",
        "",
        *(f"![{name}]({name})" for name in PLOTS),
        "",
        *table_md,
        "",
    ]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(md))
    images = "".join(
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode((out_dir / name).read_bytes()).decode()}">'
        for name in PLOTS
    )
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(row.get(c)))}</td>" for c in COLUMNS) + "</tr>" for row in rows
    )
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    html_path = out_dir / "report.html"
    html_path.write_text(
        f"<!doctype html><meta charset=utf-8><title>hybridkv arena</title>"
        f"<style>body{{font-family:sans-serif}}img{{max-width:48%}}td,th{{padding:2px 6px;border:1px solid #ccc}}"
        f"table{{border-collapse:collapse;font-size:12px}}</style><h1>hybridkv arena</h1>{images}"
        f"<table><tr>{head}</tr>{cells}</table>"
    )
    return md_path, html_path
