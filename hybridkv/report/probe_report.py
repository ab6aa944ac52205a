"""`hybridkv probe`'s table and plot: probe.md and probe.png from a probe summary (`hybridkv.eval.probe`)."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

from hybridkv.eval.stats import wilson

DISTANCE_BINS = 10  # bins of the needle's distance from L (as a fraction of L) on the retention plot


def _fmt(value) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _counted(task: dict, share: str, count: str) -> str:
    """A share with its count and 95% Wilson interval: 0.80 (8/10) [0.49, 0.94]; the bare share for a
    probe written before counts were kept."""
    if (kn := task.get("counts", {}).get(count)) is None or task[share] is None:
        return _fmt(task[share])
    low, high = wilson(*kn)
    return f"{task[share]:.2f} ({kn[0]}/{kn[1]}) [{low:.2f}, {high:.2f}]"


def probe_tables(summary: dict) -> list[str]:
    """The per-task table (swaps, zero-state, each linear layer) and the retention table, in markdown."""
    layers = summary["linear_layers"]
    head = ["task", "solved", "reads from", "KV swap: follows KV", "state swap: follows states", "zero-state kept"]
    head += [f"layer {i}: zeroed kept / swapped follows" for i in layers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in summary["tasks"]:
        cells = [
            task["task"],
            f"{task['solved']}/{task['samples']}",
            f"**{task['reads_from']}**",
            _counted(task, "kv_swap_follows_kv", "kv_swap_follows"),
            _counted(task, "state_swap_follows_states", "state_swap_follows"),
            _counted(task, "zero_state_kept", "zero_state_kept"),
        ]
        cells += [f"{_fmt(row['zeroed_kept'])} / {_fmt(row['swapped_follows_other'])}" for row in task["layers"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Tail-replay against the needle's position (the answer kept, on samples full prefill solves; the needle is "
        "inside the replayed tail when it starts at most `tail` tokens before L):",
        "",
        "| task | budget | tail tokens (mean) | kept | needle inside the tail: kept (n) | outside: kept (n) |",
        "|---|---|---|---|---|---|",
    ]
    for task in summary["tasks"]:
        for row in task["replay"]:
            lines.append(
                f"| {task['task']} | {row['budget']} | {_fmt(row['tail_tokens_mean'])} | {_fmt(row['kept'])} | "
                f"{_fmt(row['needle_in_tail_kept'])} ({row['needle_in_tail_n']}) | "
                f"{_fmt(row['needle_outside_kept'])} ({row['needle_outside_n']}) |"
            )
    return lines


def plot_probe(summary: dict, path: Path) -> None:
    """Left: per task, the share of answers following each swapped part and kept under zeroing. Right:
    tail-replay's kept share against the needle's distance from L, one line per budget, its tail
    marked where the same colour's dashed line stands."""
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    bars = [("kv_swap_follows_kv", "KV swap: follows KV"), ("state_swap_follows_states", "state swap: follows states"),
            ("zero_state_kept", "zero-state: kept")]  # fmt: skip
    layers = summary["tasks"][0]["layers"]
    bars += [(("layer", row["layer"]), f"layer {row['layer']} swapped: follows") for row in layers]
    tasks = summary["tasks"]
    width = 0.8 / len(bars)
    for index, (key, label) in enumerate(bars):
        values = []
        for task in tasks:
            if isinstance(key, tuple):
                row = next(r for r in task["layers"] if r["layer"] == key[1])
                values.append(row["swapped_follows_other"] or 0.0)
            else:
                values.append(task[key] or 0.0)
        left.bar([i + index * width for i in range(len(tasks))], values, width, label=label)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], [t["task"] for t in tasks], fontsize=8)
    left.set(ylim=(0, 1.4), ylabel="share of solved samples", title=f"{summary['model']}: {summary['reads_from']}")
    left.legend(fontsize=7, ncol=2, loc="upper center")
    budgets = summary["config"]["budgets"]
    points: dict = {b: [] for b in budgets}
    for sample in summary["samples"]:
        if sample["full"] < 1.0 or sample["needle_distance"] is None:
            continue
        for replay in sample["replays"]:
            points[replay["budget"]].append((sample["needle_distance"] / sample["context_tokens"], replay["kept"]))
    for index, budget in enumerate(budgets):
        color = f"C{index % 10}"
        bins: list[list[float]] = [[] for _ in range(DISTANCE_BINS)]
        for distance, kept in points[budget]:
            bins[min(int(distance * DISTANCE_BINS), DISTANCE_BINS - 1)].append(kept)
        xs = [(i + 0.5) / DISTANCE_BINS for i, b in enumerate(bins) if b]
        ys = [sum(b) / len(b) for b in bins if b]
        right.plot(xs, ys, marker="o", color=color, label=f"tail-replay @ {budget}")
        if isinstance(budget, float):
            right.axvline(budget, color=color, linestyle="--", linewidth=0.8)
    right.set(xlim=(0, 1), ylim=(-0.05, 1.05), xlabel="needle's distance before L (fraction of L)",
              ylabel="answer kept", title="Retention vs needle position (dashed: the replayed tail)")  # fmt: skip
    right.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def probe_markdown(summary: dict) -> str:
    config = summary["config"]
    return "\n".join(
        [
            f"# hybridkv probe — {summary['model']}",
            "",
            f"Reads its answer from: **{summary['reads_from']}** ({config['workload']} at {config['length']} tokens, "
            f"{config['samples']} samples per task, {summary['dtype']} on {summary['device']}).",
            "",
            "A counterfactual context changes every answer value (same length and character classes). *KV swap*: "
            "the counterfactual's attention KV with the true states; *state swap*: the true KV with the "
            "counterfactual's states; shares are over samples full prefill solves, with their count and 95% Wilson "
            "interval. A verdict needs the answer to follow one swapped part in at least half of them and the other "
            "in fewer; 'attention, with states' follows the KV but is lost when the states are zeroed; a layer is "
            "named when swapping (or, for 'with states', zeroing) its state alone moves (loses) the answer in at "
            "least half. An `updates` probe (order) exchanges the latest setting with the first instead of changing "
            "values: its verdict says where the order is read from.",
            "",
            "![probe](probe.png)",
            "",
            *probe_tables(summary),
            "",
        ]
    )


def write_probe(summary: dict, out: Path) -> tuple[Path, Path, Path]:
    """probe.json, probe.md and probe.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_probe(summary, out / "probe.png")
    (out / "probe.md").write_text(probe_markdown(summary))
    return out / "probe.json", out / "probe.md", out / "probe.png"


def probe_paragraph(summary: dict) -> list[str]:
    """A model's probe verdict in a few lines, for reports that show figures depending on it (arena)."""
    config = summary["config"]
    lines = [
        f"**Where {summary['model']} reads its answer: {summary['reads_from']}** (`hybridkv probe`: "
        f"{config['workload']} {', '.join(config['tasks'])} at {config['length']} tokens). A model that reads from "
        "its states keeps an answer under tail-replay only when the needle lies in the replayed tail; one that reads "
        "from attention keeps it at any budget, zero-state included.",
        "",
    ]
    for task in summary["tasks"]:
        replay = ", ".join(
            f"{row['budget']}: {_fmt(row['needle_in_tail_kept'])} inside / {_fmt(row['needle_outside_kept'])} outside"
            for row in task["replay"]
        )
        lines.append(
            f"- {task['task']} ({task['solved']} solved): zero-state keeps {_fmt(task['zero_state_kept'])}; "
            f"tail-replay keeps (needle inside / outside the tail) {replay or '—'}"
        )
    return [*lines, ""]
