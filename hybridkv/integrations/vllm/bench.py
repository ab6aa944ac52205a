"""`hybridkv vllm-bench`: what a server sees, through real `vllm serve` processes, three ways.

Every configuration is its own `vllm serve` process (the OpenAI server, `serve.Server`), started
once and sent every workload (`workloads.SERVER_WORKLOADS`) at every client count, the same
prompts in the same sessions:

- `no-cache`: vLLM without prefix caching; every prompt is a full prefill and the fidelity reference;
- `vllm-prefix-cache`: vLLM's own hybrid prefix cache (`align` mode): hits on its block grid only;
- `hybridkv`: vLLM with HybridKVConnector on a store: token-level match, tail replay within the
  budget (one row per budget).

Why not `vllm bench serve` alone: its prefix-sharing datasets need a client tokenizer (the bench
models have none), it sends independent requests (a conversation's turn must wait for the last),
and it reports no first-token logprobs to compare with the reference. The client here
(`serve.run_sessions`) adds those three; the timing is the same (request sent to first token).

Fidelity compares each prompt's first-token distribution with `no-cache`'s at the same client
count: top-1 agreement, and the KL divergence between the two distributions coarsened to the
reference's top k tokens plus one bucket for all others (a lower bound on the full KL).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import uuid
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.serve import ADAPTIVE, Reply, Server, ServerSpec, run_sessions
from hybridkv.integrations.vllm.workloads import SERVER_WORKLOADS, Shape, make_sessions

CONNECTOR_FIELDS = (
    "hook_ms_per_request", "wait_ms_per_request", "copy_ms_per_request", "lookup_ms_per_request", "write_ms_per_request"
)  # fmt: skip
SUMMARY_FIELDS = (
    "workload", "config", "clients", "budget", "block_size", "requests", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
    "throughput_rps", "reused_tokens_per_request", "replayed_tokens_per_request", "top1_agreement", "kl_mean",
)  # fmt: skip


@dataclass
class BenchPlan:
    model: str
    workloads: list[str] = field(default_factory=lambda: list(SERVER_WORKLOADS))
    clients: list[int] = field(default_factory=lambda: [1, 4, 16])
    budgets: list[str] = field(default_factory=lambda: ["0.05"])  # or "adaptive": the calibrated horizon
    shape: Shape = field(default_factory=Shape)
    store: str | None = None  # default: a file store under the output folder, emptied first
    top_logprobs: int = 20
    seed: int = 0
    engines: int = 1  # vllm serve processes per configuration, on one store; sessions move between them


def first_token_fidelity(reference: dict[int, float], got: dict[int, float]) -> tuple[float, float]:
    """(top-1 agreement, coarsened KL(reference || got)) from two top-k logprob dicts."""
    agree = float(max(reference, key=reference.get) == max(got, key=got.get))
    floor = min(got.values())  # a token outside `got`'s top k has at most its smallest logprob
    p = [math.exp(v) for v in reference.values()]
    q = [math.exp(got.get(t, floor)) for t in reference]
    p_rest, q_rest = max(0.0, 1.0 - sum(p)), max(1e-12, 1.0 - sum(q))
    kl = sum(a * math.log(a / max(b, 1e-12)) for a, b in zip(p, q, strict=True) if a > 0)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return agree, max(0.0, kl)


def _runs(plan: BenchPlan) -> list[tuple[str, str | None]]:
    """(config, budget) pairs, one `vllm serve` process each."""
    return [("no-cache", None), ("vllm-prefix-cache", None), *(("hybridkv", b) for b in plan.budgets)]


def ensure_calibrated(model: str) -> dict:
    """The model's calibration (`hybridkv calibrate`), measured now if it has none beside it."""
    from hybridkv.eval.calibrate import CALIBRATION_FILE, Calibration, calibrate

    path = Path(model) / CALIBRATION_FILE
    if not path.exists():
        from hybridkv.models import load_model

        calibrate(load_model(model)).write(path)  # float32: the gates' own precision
    return asdict(Calibration.read(path))


def run_bench(plan: BenchPlan, out: Path, show_progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    calibration = ensure_calibrated(plan.model) if ADAPTIVE in plan.budgets else None
    max_model_len = plan.shape.max_prefix + 2048  # room for multi-turn's growth and every user turn
    warm_up = [[5] * 64]  # one-time start-up costs, outside every measurement
    sessions: dict[tuple[str, int], list] = {}
    measured: dict[tuple[str, str | None], dict] = {}
    per_run = len(plan.workloads) * plan.shape.requests * len(plan.clients)
    with tqdm(total=len(_runs(plan)) * per_run, desc="vllm-bench", disable=not show_progress) as progress:
        for config, budget in _runs(plan):
            store = plan.store
            if store is None:
                shutil.rmtree(out / "store", ignore_errors=True)
                store = f"file://{(out / 'store').resolve()}"
            label = config if budget is None else f"{config}@{budget}"
            # a namespace per run: a store given with --store starts empty for every budget and rerun
            namespace = f"vllm-bench:{label}:{uuid.uuid4().hex}"
            spec = ServerSpec(
                plan.model, config, max_model_len, store, budget or "0.05", plan.top_logprobs, plan.seed, namespace
            )
            progress.set_postfix_str(f"{label}: starting vllm serve")
            with ExitStack() as stack:
                servers = [
                    stack.enter_context(Server(spec, out / "logs" / f"{label}-{i}.log")) for i in range(plan.engines)
                ]
                urls = [server.url for server in servers]
                for server in servers:
                    _run([server.url], [warm_up], 1, plan)
                block_size = servers[0].block_size()
                if not sessions:  # grid-aligned puts its prefixes on the block vLLM chose for this model
                    shape = replace(plan.shape, block_size=block_size)
                    sessions = {
                        (w, c): make_sessions(w, shape, plan.seed, c) for w in plan.workloads for c in plan.clients
                    }
                    longest = max(len(p) for runs in sessions.values() for s in runs for p in s)
                    if longest > max_model_len:
                        raise HybridKVError(f"a workload prompt of {longest} tokens exceeds {max_model_len}")
                run = {"block_size": block_size, "results": {}}
                for (name, clients), runs in sessions.items():
                    progress.set_postfix_str(f"{label}: {name}, {clients} clients")
                    before = _connector_totals(servers) if config == "hybridkv" else None
                    replies, wall = _run(urls, runs, clients, plan, progress.update)
                    requests = sum(len(s) for s in runs)
                    spent = _connector_spent(servers, before, requests) if before is not None else None
                    run["results"][(name, clients)] = (replies, wall, spent)
            measured[(config, budget)] = run
    summary = summarise(plan, measured) | {"calibration": calibration}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(report(summary))
    for name in plan.workloads:
        plot(summary, name, out / f"ttft-{name}.png")
    return summary


_SECONDS = ("hook_seconds", "wait_seconds", "copy_seconds", "lookup_seconds", "write_seconds")


def _connector_totals(servers: list[Server]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for server in servers:
        for name, value in server.metrics().items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _connector_spent(servers: list[Server], before: dict[str, float], requests: int) -> dict[str, float] | None:
    """Milliseconds per request of the connector's hooks, copies and lookups over one run, from
    its counters on the servers' /metrics (read again for a few seconds, until every request's
    lookup is counted: the server records a step's figures just after answering)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        after = _connector_totals(servers)
        looked_up = after.get("vllm:hybridkv_lookups_total", 0) - before.get("vllm:hybridkv_lookups_total", 0)
        if looked_up >= requests:
            break
        if time.monotonic() > deadline:  # figures of a run the counters never fully showed: none
            return None
        time.sleep(0.2)
    return {
        f"{name.removesuffix('_seconds')}_ms_per_request": 1000
        * (after.get(f"vllm:hybridkv_{name}_total", 0) - before.get(f"vllm:hybridkv_{name}_total", 0))
        / requests
        for name in _SECONDS
    }


def _run(urls: list[str], sessions, clients: int, plan: BenchPlan, on_reply=None):
    import asyncio

    on = (lambda _reply: on_reply()) if on_reply else None
    return asyncio.run(run_sessions(urls, plan.model, sessions, clients, plan.top_logprobs, on))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)  # linear interpolation between closest ranks, as numpy's default
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(plan: BenchPlan, measured: dict) -> dict:
    rows = []
    for name in plan.workloads:
        for clients in plan.clients:
            reference, _, _ = measured[("no-cache", None)]["results"][(name, clients)]
            reference_flat = [r for session in reference for r in session]
            for (config, budget), run in measured.items():
                replies, wall, spent = run["results"][(name, clients)]
                flat: list[Reply] = [r for session in replies for r in session]
                ttfts = [r.ttft_s for r in flat]
                fidelity = [
                    first_token_fidelity(ref.logprobs, got.logprobs)
                    for ref, got in zip(reference_flat, flat, strict=True)
                ]
                rows.append(
                    {
                        "workload": name,
                        "config": config,
                        "clients": clients,
                        "engines": plan.engines,
                        "budget": budget,
                        "block_size": run["block_size"],
                        "requests": len(flat),
                        "ttft_mean_s": statistics.mean(ttfts),
                        "ttft_p50_s": _percentile(ttfts, 50),
                        "ttft_p99_s": _percentile(ttfts, 99),
                        "throughput_rps": len(flat) / wall,
                        "reused_tokens_per_request": statistics.mean(r.reused_tokens for r in flat),
                        "replayed_tokens_per_request": statistics.mean(r.replayed_tokens for r in flat),
                        "top1_agreement": statistics.mean(a for a, _ in fidelity),
                        "kl_mean": statistics.mean(k for _, k in fidelity),
                        # hybridkv only: the connector's milliseconds per request (hooks and lookup
                        # waits on the engine loop, page copies, lookups and writes on their threads)
                        **(spent or dict.fromkeys(CONNECTOR_FIELDS)),
                    }
                )
    return {"model": plan.model, "seed": plan.seed, "shape": asdict(plan.shape), "rows": rows}


def _label(row: dict) -> str:
    return row["config"] if row["budget"] is None else f"{row['config']}@{row['budget']}"


def plot(summary: dict, workload: str, path: Path) -> None:
    """Mean TTFT per configuration, grouped by client count, with reused tokens on each bar."""
    from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

    rows = [r for r in summary["rows"] if r["workload"] == workload]
    clients = sorted({r["clients"] for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in rows))
    width = 0.8 / len(labels)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for index, label in enumerate(labels):
        mine = {r["clients"]: r for r in rows if _label(r) == label}
        xs = [i + (index - (len(labels) - 1) / 2) * width for i in range(len(clients))]
        bars = ax.bar(xs, [mine[c]["ttft_mean_s"] for c in clients], width, label=label)
        for bar, c in zip(bars, clients, strict=True):
            ax.annotate(f"{mine[c]['reused_tokens_per_request']:.0f}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(clients)), [f"{c} clients" for c in clients])
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(f"vllm serve, {workload}: mean TTFT (labels: reused tokens per request)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(summary: dict) -> str:
    shape = summary["shape"]
    blocks = sorted({r["block_size"] for r in summary["rows"]})
    lines = [
        "# vllm-bench",
        "",
        f"Model `{summary['model']}` through `vllm serve`; vLLM's attention block: {', '.join(map(str, blocks))} "
        f"tokens. Prefixes {shape['min_prefix']}-{shape['max_prefix']} tokens, {shape['requests']} requests per "
        "workload and client count. TTFT: request sent to first token (`max_tokens=1`); fidelity of the first "
        "token against `no-cache` at the same client count. The connector's milliseconds per request, from its "
        "counters on the servers' `/metrics`: hooks on the engine loop (everything but moving pages), the engine "
        "loop's waits for a lookup to answer (at most 50 ms a request, so a hit loads in that step), page copies "
        "into and out of vLLM's cache, lookups (key hashing, store reads, checksums) on their own thread, "
        "before a request's load, and writes (hashing, encoding, store puts) on the writer thread, after its answer.",
        "",
    ]
    if calibration := summary.get("calibration"):
        lines += [
            f"`hybridkv@adaptive` replays the model's calibrated forgetting horizon, {calibration['horizon']} tokens "
            f"(`hybridkv calibrate`: tolerance {calibration['tolerance']}, quantile {calibration['quantile']}, "
            f"{calibration['samples']} prompts of {calibration['tokens']} {calibration['text']}).",
            "",
        ]
    for workload in dict.fromkeys(r["workload"] for r in summary["rows"]):
        lines += [
            f"## {workload}",
            "",
            f"![TTFT, {workload}](ttft-{workload}.png)",
            "",
            "| clients | config | TTFT mean s | p50 | p99 | req/s | reused / req | replayed / req | top-1 | KL mean "
            "| connector ms / req: hooks / waits / copies / lookup / writes |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in (r for r in summary["rows"] if r["workload"] == workload):
            lines.append(
                f"| {row['clients']} | {_label(row)} | {row['ttft_mean_s']:.3f} | {row['ttft_p50_s']:.3f} | "
                f"{row['ttft_p99_s']:.3f} | {row['throughput_rps']:.2f} | {row['reused_tokens_per_request']:.0f} | "
                f"{row['replayed_tokens_per_request']:.0f} | {row['top1_agreement']:.3f} | {row['kl_mean']:.2e} | "
                + (
                    " / ".join(f"{row[f]:.1f}" for f in CONNECTOR_FIELDS) + " |"
                    if row["hook_ms_per_request"] is not None
                    else "— |"
                )
            )
        lines.append("")
    lines += [
        "## hybridkv against vLLM's align mode",
        "",
        "Mean TTFT and throughput of each hybridkv budget divided by `vllm-prefix-cache`'s, same workload and "
        "client count (issue 15's targets: TTFT ≤ 0.6 off the grid and on multi-turn, ≤ 1.05 on grid-aligned; "
        "throughput at 16 clients ≥ 1).",
        "",
        "| workload | clients | budget | TTFT / align mode | throughput / align mode |",
        "|---|---|---|---|---|",
    ]
    align = {(r["workload"], r["clients"]): r for r in summary["rows"] if r["config"] == "vllm-prefix-cache"}
    for row in summary["rows"]:
        if row["config"] == "hybridkv" and (base := align.get((row["workload"], row["clients"]))) is not None:
            lines.append(
                f"| {row['workload']} | {row['clients']} | {row['budget']} | "
                f"{row['ttft_mean_s'] / base['ttft_mean_s']:.2f} | "
                f"{row['throughput_rps'] / base['throughput_rps']:.2f} |"
            )
    lines.append("")
    return "\n".join(lines)
