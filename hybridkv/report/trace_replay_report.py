"""`hybridkv trace-replay`'s tables and plot: measured hit shares beside the simulator's, and TTFT."""

from __future__ import annotations

from pathlib import Path

TOLERANCE = 0.02  # the bound on |measured - simulated| for both shares


def replay_tables(summary: dict) -> list[str]:
    """Markdown: per capacity the two shares simulated and measured; per run the shares and TTFT."""
    lines = [
        f"Trace `{summary['config']['trace']}`, first {summary['config']['requests']} requests scaled down "
        f"{summary['config']['scale']}x ({summary['block_tokens']}-token blocks): {summary['requests']} requests, "
        f"{summary['input_tokens']:,} input tokens; model `{Path(summary['model']).name}`; store rule "
        f"`{summary['config']['policy']}`, replay budget {summary['config']['budget']}.",
        "",
        "| capacity | token hit share, simulated | measured | exact-hit share, simulated | measured | within "
        f"{TOLERANCE} |",
        "|---:|---:|---:|---:|---:|:---:|",
    ]
    shares = ("token_hit_share", "exact_hit_share")
    for row in summary["agreement"]:
        within = all(abs(row[f"measured_{s}"] - row[f"simulated_{s}"]) <= TOLERANCE for s in shares)
        cells = [f"{row[f'{side}_{s}']:.4f}" for s in shares for side in ("simulated", "measured")]
        lines.append(f"| {row['capacity_mb']:g} MB | {' | '.join(cells)} | {'yes' if within else 'no'} |")
    base = next(m for m in summary["measured"] if m["config"] == "no-cache")
    lines += [
        "",
        "| run | token hit share | exact-hit share | median TTFT (s) | mean TTFT (s) | mean TTFT vs no cache |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in summary["measured"]:
        label = run["config"] if run["capacity_mb"] is None else f"{run['config']} @ {run['capacity_mb']:g} MB"
        lines.append(
            f"| {label} | {run['token_hit_share']:.4f} | {run['exact_hit_share']:.4f} | {run['ttft_median_s']:.3f} | "
            f"{run['ttft_mean_s']:.3f} | {run['ttft_mean_s'] / base['ttft_mean_s']:.2f}x |"
        )
    return lines


def plot_replay(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["agreement"]
    capacities = [r["capacity_mb"] for r in rows]
    fig, (shares, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for share, colour in (("token_hit_share", "tab:blue"), ("exact_hit_share", "tab:orange")):
        name = share.replace("_", " ")
        shares.plot(capacities, [r[f"simulated_{share}"] for r in rows], "--", color=colour, label=f"{name}, simulated")
        shares.plot(capacities, [r[f"measured_{share}"] for r in rows], "o", color=colour, label=f"{name}, measured")
    shares.set_xscale("log")
    shares.set_xlabel("store capacity (MB)")
    shares.set_ylabel("share of input tokens")
    shares.set_title("trace-sim's prediction vs vllm serve")
    shares.legend(fontsize=8)
    runs = summary["measured"]
    labels = [r["config"] if r["capacity_mb"] is None else f"hybridkv\n{r['capacity_mb']:g} MB" for r in runs]
    ttft.bar(range(len(runs)), [r["ttft_mean_s"] for r in runs], color="tab:gray")
    ttft.set_xticks(range(len(runs)), labels, fontsize=8)
    ttft.set_ylabel("mean TTFT (s)")
    ttft.set_title("time to first token, one request at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_replay(summary: dict, out: Path) -> list[Path]:
    report = out / "report.md"
    report.write_text("# trace-replay\n\n" + "\n".join(replay_tables(summary)) + "\n\n![shares and TTFT](replay.png)\n")
    return [report, plot_replay(summary, out / "replay.png"), out / "summary.json"]
