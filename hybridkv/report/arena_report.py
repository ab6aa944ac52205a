"""`hybridkv arena report DIR`: report.md and report.html with plots, from DIR/summary.json."""

from __future__ import annotations

import base64
import html
import json
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

from hybridkv.eval.arena import SHADOW_CHECKS
from hybridkv.eval.jsonl import read_jsonl
from hybridkv.eval.probe import find_probe
from hybridkv.eval.stats import Excess
from hybridkv.eval.summary import OVERALL  # noqa: E402
from hybridkv.methods.chunked import ATTENTION, LINEAR
from hybridkv.report.probe_report import probe_paragraph

COLUMNS = ["task", "length", "method", "budget", "n", "score", "score_ci95", "retention", "retention_ci95", "pgr",
           "pgr_ci95", "agreement_with_full", "same_as_full", "ttft_s", "build_s", "recomputed_layer_tokens",
           "kv_bytes", "state_bytes"]  # fmt: skip


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
        if ax.get_legend_handles_labels()[0]:
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


def _pair_grids(rows: list[dict]) -> dict[tuple[str, int], dict[tuple[str, str], dict]]:
    """Rows of ATTENTION+LINEAR methods, by (task, length), then by (attention, linear)."""
    grids: dict[tuple[str, int], dict[tuple[str, str], dict]] = defaultdict(dict)
    for row in rows:
        attention, plus, linear = row["method"].partition("+")
        if plus:
            grids[(row["task"], row["length"])][(attention, linear)] = row
    return grids


def _axes_of(grid: dict[tuple[str, str], dict]) -> tuple[list[str], list[str]]:
    """The grid's attention and linear policies, each in the methods' own order (cheapest repair first)."""

    def ordered(names: set[str], known: list[str]) -> list[str]:
        return sorted(names, key=lambda n: (known.index(n) if n in known else len(known), n))

    return ordered({a for a, _ in grid}, list(ATTENTION)), ordered({b for _, b in grid}, list(LINEAR))


def _reference(rows: list[dict], task: str, length: int, method: str) -> dict | None:
    return next((r for r in rows if (r["task"], r["length"], r["method"]) == (task, length, method)), None)


def plot_pair_grid(rows: list[dict], path: Path) -> None:
    """One heat map per task and length: attention policy × linear policy, coloured by PGR (the
    score where PGR is undefined), each cell also giving the score."""
    grids = _pair_grids(rows)
    fig = Figure(figsize=(5.5 * len(grids), 4.2))
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    for ax, ((task, length), grid) in zip(axes, sorted(grids.items()), strict=True):
        attention, linear = _axes_of(grid)
        use_pgr = all(r.get("pgr") is not None for r in grid.values())
        key = "pgr" if use_pgr else "score"
        values = [[grid[(a, b)][key] if (a, b) in grid else float("nan") for b in linear] for a in attention]
        image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        for i, a in enumerate(attention):
            for j, b in enumerate(linear):
                if (a, b) in grid:
                    cell = grid[(a, b)]
                    text = f"{cell[key]:.2f}" + (f"\n({cell['score']:.2f})" if use_pgr else "")
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, color="w" if cell[key] < 0.6 else "k")
        ax.set_xticks(range(len(linear)), linear, rotation=20, fontsize=7)
        ax.set_yticks(range(len(attention)), attention, fontsize=7)
        full, floor = _reference(rows, task, length, "full"), _reference(rows, task, length, "no-context")
        anchors = ", ".join(f"{r['method']} {r['score']:.2f}" for r in (full, floor) if r)
        ax.set_title(f"{task} @ {length}: {'PGR (score)' if use_pgr else 'score'}\n{anchors}", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pair_tables(rows: list[dict]) -> list[str]:
    """Markdown: per task and length, attention policies down, linear policies across, each cell
    'PGR [95% CI]' (or the score where PGR is undefined)."""
    lines = []
    for (task, length), grid in sorted(_pair_grids(rows).items()):
        attention, linear = _axes_of(grid)
        lines += [f"**{task} @ {length}** (PGR [95% CI]; score where PGR is undefined)", ""]
        lines += ["| attention \\ linear | " + " | ".join(linear) + " |", "|---|" + "---|" * len(linear)]
        for a in attention:
            cells = []
            for b in linear:
                row = grid.get((a, b))
                if row is None:
                    cells.append("")
                elif row.get("pgr") is None:
                    cells.append(f"score {_fmt(row['score'])}")
                else:
                    cells.append(f"{row['pgr']:.2f} {_fmt(row.get('pgr_ci95'))}")
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


PLOTS = {
    "quality_vs_budget.png": plot_quality_vs_budget,
    "pgr.png": plot_pgr,
    "ttft_speedup.png": plot_speedup,
    "bytes.png": plot_bytes,
}
PAIR_PLOT = "pairs.png"  # only for runs with ATTENTION+LINEAR methods


def _engine(out_dir: Path) -> str:
    run = json.loads((out_dir / "run.json").read_text()) if (out_dir / "run.json").is_file() else {}
    return "vllm serve" if run.get("engine") == "vllm" else "harness"


# A served method's counterpart in the harness where the names differ: the connector replaying the
# calibrated horizon is tail-replay at that many tokens; vLLM's prefix cache recomputes exactly what
# it does not reuse, so its counterpart is full prefill.
COUNTERPARTS = {"horizon-replay": "tail-replay", "vllm-prefix-cache": "full"}


def beside_table(rows: list[dict], out_dir: Path, other_dir: Path) -> list[str]:
    """Markdown: this run's score per (task, length, method, budget) (`rows`, its summary) beside
    another run's on the same settings (a served run beside the harness's), with both CIs and
    whether they overlap."""
    other = {_key(r): r for r in json.loads((other_dir / "summary.json").read_text())["rows"]}
    this_name, other_name = _engine(out_dir), _engine(other_dir)
    lines = [
        f"## {this_name} beside {other_name} (`{other_dir}`)",
        "",
        f"| task | length | method | budget | n | {this_name} score [95% CI] | {other_name} score [95% CI] | "
        f"CIs overlap | {this_name} same_as_full | {other_name} same_as_full |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = [f"{a} is set beside {other_name}'s {b}" for a, b in COUNTERPARTS.items()]
    for row in rows:
        there = other.get(_key(row)) or other.get(_key({**row, "method": COUNTERPARTS.get(row["method"])}))
        if there is None:
            continue
        overlap = None
        if row.get("score_ci95") and there.get("score_ci95"):
            (a, b), (c, d) = row["score_ci95"], there["score_ci95"]
            overlap = "yes" if a <= d and c <= b else "**no**"
        lines.append(
            f"| {row['task']} | {row['length']} | {row['method']} | {_fmt(row['budget'])} | {row['n']} | "
            f"{_fmt(row['score'])} {_fmt(row.get('score_ci95'))} | {_fmt(there['score'])} "
            f"{_fmt(there.get('score_ci95'))} | {_fmt(overlap)} | {_fmt(row['same_as_full'])} | "
            f"{_fmt(there['same_as_full'])} |"
        )
    return [*lines, "", f"({'; '.join(notes)}.)", ""]


def shadow_table(rows: list[dict], out_dir: Path) -> list[str]:
    """Markdown: a served run's shadow checks per (method, budget) (OUT/shadow.json) beside the
    score that setting lost against full prefill on the same samples (`rows`, its summary; the
    pooled rows where there are several tasks): does the live signal predict the loss?"""
    path = out_dir / "shadow.json"
    if not path.exists():
        return []
    shadow = json.loads(path.read_text())
    rows = [r for r in rows if r["task"] == OVERALL] or rows
    full = {r["length"]: r["score"] for r in rows if r["method"] == "full"}
    lines = [
        "## Shadow checks beside the score lost",
        "",
        "Per served setting: the zero-state first-token checks (the share whose top-1 flipped, mean KL(exact || "
        "served recipe)); the served answers teacher-forced through exact full prefill, per kind of resume, that "
        "left exact greedy before their end (and where, on average); and the score lost against full prefill. "
        "The excess over the engine's own noise is in the next table, against the run's full-prefill answers "
        "(a setting's own full prefills here are its contexts' one-token first requests)."
        + (
            " One server answers every length, so a setting's shadow figures (here and in the next "
            "table) pool its lengths."
            if len(full) > 1
            else ""
        ),
        "",
        "| method | budget | length | first-token checks | flip rate | mean KL | answers diverged (kind) | "
        "score | full | score lost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        figures = shadow.get(f"{row['method']}@{row['budget']}")
        if figures is None or row["length"] not in full:
            continue
        answers = figures.get("shadow_answers", {})
        loaded = {kind: f for kind, f in answers.items() if kind != "full"}
        first_token_checks = figures.get("shadow_first_token_checks", figures["shadow_checks"])  # older runs
        diverged = (
            "; ".join(
                f"{f['divergences']}/{f['answers']} ({kind}"
                + (f", at {f['mean_divergence_position']:.1f} on average)" if f["divergences"] else ")")
                for kind, f in loaded.items()
            )
            or "—"
        )
        lines.append(
            f"| {row['method']} | {_fmt(row['budget'])} | {row['length']} | {first_token_checks} | "
            f"{_fmt(figures['shadow_disagreement_rate'])} | {_fmt(figures['shadow_kl_mean'])} | {diverged} | "
            f"{_fmt(row['score'])} | {_fmt(full[row['length']])} | {_fmt(full[row['length']] - row['score'])} |"
        )
    return [*lines, ""]


def shadow_prediction_table(out_dir: Path) -> list[str]:
    """Markdown from the served run's shadow log joined to its rows (by the id the arena sent, which
    the engine's id holds): per setting and kind of resume, the answers that left exact greedy before
    their end, where, and the excess over the control (the run's answers computed by full prefill,
    pooled over its settings: the same prompts, answered the same way, so the same engine noise);
    then whether a verdict predicts a changed answer: flagged against differs (the prediction is not
    the `full` row's of the same sample, served by vLLM without a cache), with precision and recall."""
    path = out_dir / SHADOW_CHECKS
    if not path.exists():
        return []
    verdicts = {}
    for check in read_jsonl(path, torn_tail_ok=True):
        if check.get("answer_length"):
            # vLLM's engine id: "cmpl-" + the id sent + "-<prompt index>-<random suffix>"
            verdicts[check["request_id"].removeprefix("cmpl-").rsplit("-", 2)[0]] = check
    rows = read_jsonl(out_dir / "results.jsonl", torn_tail_ok=True)
    full = {r["id"]: r["prediction"] for r in rows if r["method"] == "full"}
    checked = [(row, verdicts[row["request_id"]]) for row in rows if row.get("request_id") in verdicts]
    if not checked:
        return []

    def named(row: dict) -> str:
        return row["method"] if row["budget"] is None else f"{row['method']}@{_fmt(row['budget'])}"

    control = [check["diverged_at"] is not None for _, check in checked if check["kind"] == "full"]
    answers: dict[tuple[str, str], list[int | None]] = defaultdict(list)  # -> diverged_at per answer
    cells: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # flagged&differs, flagged, differs, neither
    for row, check in checked:
        answers[(named(row), check["label"])].append(check["diverged_at"])
        if row["method"] == "full" or row["id"] not in full:
            continue
        flagged, differs = check["diverged_at"] is not None, row["prediction"] != full[row["id"]]
        for setting in (named(row), "all"):
            cells[setting][0 if flagged and differs else 1 if flagged else 2 if differs else 3] += 1
    lines = [
        "## Served answers against exact greedy, per setting and kind of resume",
        "",
        f"Each answer teacher-forced through exact full prefill in the shadow; diverged: a served token that is not "
        f"the exact argmax before the answer's end, at the mean first such position. Excess: over the run's answers "
        f"computed by full prefill ({sum(control)}/{len(control)} diverged: the engine's own distance from "
        f"transformers), with its 95% interval.",
        "",
        "| setting | kind | answers | diverged | mean position | excess over full [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for (setting, kind), positions in answers.items():
        diverged = [p for p in positions if p is not None]
        excess = Excess.of(len(diverged), len(positions), sum(control), len(control)) if kind != "full" else None
        lines.append(
            f"| {setting} | {kind} | {len(positions)} | {len(diverged)} | "
            f"{_fmt(sum(diverged) / len(diverged)) if diverged else '—'} | "
            f"{'—' if excess is None else f'{_fmt(excess.excess)} [{_fmt(excess.low)}, {_fmt(excess.high)}]'} |"
        )
    lines += [
        "",
        "## Does the shadow's verdict predict a changed answer?",
        "",
        "Per served request: flagged = the shadow found its answer leaving exact greedy before its end; differs = "
        "its prediction is not what vLLM without a cache answered on the same sample. Precision: of the flagged, "
        "the share that differ; recall: of those that differ, the share flagged.",
        "",
        "| setting | flagged, differs | flagged, same | unflagged, differs | unflagged, same | precision | recall |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting, (both, flagged_only, differs_only, neither) in sorted(cells.items(), key=lambda kv: kv[0] == "all"):
        precision = both / (both + flagged_only) if both + flagged_only else None
        recall = both / (both + differs_only) if both + differs_only else None
        lines.append(
            f"| {setting} | {both} | {flagged_only} | {differs_only} | {neither} | {_fmt(precision)} | {_fmt(recall)} |"
        )
    return [*lines, ""]


def needle_table(rows: list[dict]) -> list[str]:
    """Where the workload marks the answer's source (`updates`' latest setting): per replaying method,
    the share of full prefill's solved answers kept with the source inside the replayed tail and
    before it. A tail that keeps answers whose source it never re-read recovers more than it re-reads."""
    split = [row for row in rows if row.get("needle_in_tail")]
    if not split:
        return []
    lines = [
        "## The answer's source inside the replayed tail or before it",
        "",
        "On the samples full prefill solves: kept = the share the method still solves (count in brackets).",
        "",
        "| task | length | method | inside the tail: kept (n) | before it: kept (n) |",
        "|---|---|---|---|---|",
    ]
    for row in split:
        cell = row["needle_in_tail"]
        lines.append(
            f"| {row['task']} | {row['length']} | {_label(row)} | {_fmt(cell['inside_kept'])} ({cell['inside_n']}) | "
            f"{_fmt(cell['outside_kept'])} ({cell['outside_n']}) |"
        )
    return [*lines, ""]


def _key(row: dict) -> tuple:
    return row["task"], row["length"], row["method"], str(row["budget"])


def write_arena_report(out_dir: Path, beside: Path | None = None) -> tuple[Path, Path]:
    summary = json.loads((out_dir / "summary.json").read_text())
    rows = summary["rows"]
    # The plots average over tasks themselves; the pooled "overall" rows stay in the tables only.
    per_task = [row for row in rows if row["task"] != OVERALL]
    plots = dict(PLOTS)
    if _pair_grids(per_task):
        plots[PAIR_PLOT] = plot_pair_grid
    for name, plot in plots.items():
        plot(per_task, out_dir / name)
    table_md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table_md += ["| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    run = json.loads((out_dir / "run.json").read_text()) if (out_dir / "run.json").is_file() else {}
    probe = find_probe(run["model"], out_dir) if run.get("model") else None
    reads = probe_paragraph(probe) if probe is not None else []
    md = [
        f"# hybridkv arena — {out_dir}",
        "",
        *reads,
        "Scores are recomputed from the stored predictions. Retention = method / full prefill; PGR = (method − "
        "no-context floor) / (full − floor), undefined when full does not beat the floor by 1e-3; CIs are paired "
        "bootstrap 95%; agreement_with_full is the share of full prefill's answer a method reproduces before its "
        "first difference; same_as_full the share of answers equal to full prefill's to the end.",
        "",
        *(f"![{name}]({name})" for name in plots),
        "",
        *pair_tables(per_task),
        *needle_table(rows),
        *(beside_table(rows, out_dir, beside) if beside is not None else []),
        *shadow_table(rows, out_dir),
        *shadow_prediction_table(out_dir),
        *table_md,
        "",
    ]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(md))
    images = "".join(
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode((out_dir / name).read_bytes()).decode()}">'
        for name in plots
    )
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(row.get(c)))}</td>" for c in COLUMNS) + "</tr>" for row in rows
    )
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    html_path = out_dir / "report.html"
    html_path.write_text(
        f"<!doctype html><meta charset=utf-8><title>hybridkv arena</title>"
        f"<style>body{{font-family:sans-serif}}img{{max-width:48%}}td,th{{padding:2px 6px;border:1px solid #ccc}}"
        f"table{{border-collapse:collapse;font-size:12px}}</style><h1>hybridkv arena</h1>"
        f"{''.join(f'<p>{html.escape(line)}</p>' for line in reads if line)}{images}"
        f"<table><tr>{head}</tr>{cells}</table>"
    )
    return md_path, html_path
