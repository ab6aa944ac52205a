"""`hybridkv vllm-bench`: what a server sees, through real `vllm serve` processes, three ways.

Every configuration is its own `vllm serve` process (the OpenAI server, `serve.Server`), started
once and sent every workload (`traffic.TRAFFIC`) at every client count, the same
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
reference's top k tokens plus one bucket for all others (a lower bound on the full KL). Raw top-1
agreement also counts flips that bf16 rounding alone makes where the reference's top two tokens
nearly tie (a random-weight model's distribution is near uniform), so each row also reports it
over the requests whose reference lead clears the run's measured split noise (`split_noise`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import uuid
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.config import DEFAULT_REPLAY_BUDGET
from hybridkv.serving.server import (
    ADAPTIVE,
    Reply,
    Server,
    ServerSpec,
    metric_totals,
    run_sessions,
    settle_shadow_checks,
)
from hybridkv.serving.traffic import TRAFFIC, Shape, Tokens, make_sessions

CONNECTOR_FIELDS = (
    "hook_ms_per_request", "wait_ms_per_request", "copy_ms_per_request", "lookup_ms_per_request", "write_ms_per_request"
)  # fmt: skip
# hybridkv with --shadow-rate only: the connector's shadow checks over one run (`shadow.py`)
SHADOW_FIELDS = (
    "shadow_checks", "shadow_top1_disagreements", "shadow_disagreement_rate", "shadow_kl_mean",
    "shadow_reproduced_rate", "shadow_dropped", "shadow_failed", "shadow_first_token_checks", "shadow_answers",
)  # fmt: skip
SUMMARY_FIELDS = (
    "workload", "config", "clients", "budget", "block_size", "requests", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
    "throughput_rps", "reused_tokens_per_request", "replayed_tokens_per_request", "top1_agreement", "kl_mean",
    "top1_clear", "clear_requests", "cold_requests", "ttft_cold_sum_s", "ttft_rest_mean_s",
    "computed_tokens_per_request", "unmatched_tokens_per_request",
)  # fmt: skip


@dataclass
class BenchPlan:
    """What `hybridkv vllm-bench` runs. A field's `help` is its flag's text (`hybridkv.cli`)."""

    model: str  # a checkpoint directory vLLM serves
    workloads: list[str] = field(
        default_factory=lambda: list(TRAFFIC), metadata={"help": "comma list of server workloads"}
    )
    clients: list[int] = field(default_factory=lambda: [1, 4, 16], metadata={"help": "concurrent client counts"})
    budgets: list[str] = field(
        default_factory=lambda: [str(DEFAULT_REPLAY_BUDGET), ADAPTIVE],
        metadata={
            "help": "hybridkv replay budgets: fractions, token counts (256tok), or adaptive (the horizon "
            "`hybridkv calibrate` measures on the model, written beside it on first use)"
        },
    )
    shape: Shape = field(default_factory=Shape)
    store: str | None = field(  # emptied first
        default=None, metadata={"help": "hybridkv store URL (default: a file store in OUT/store)"}
    )
    top_logprobs: int = 20
    seed: int = 0
    shadow_rate: float = field(
        default=0.0,
        metadata={
            "help": "share of hybridkv's requests whose served answers the connector checks against exact "
            "full prefill in a shadow process, by kind of resume (its shadow_rate; 0: off)"
        },
    )
    engines: int = field(
        default=1,
        metadata={
            "help": "vllm serve processes per configuration, on one store; each conversation moves to another at "
            "every turn"
        },
    )

    def __post_init__(self) -> None:
        if not 0 <= self.shadow_rate <= 1:  # refused before any server starts
            raise HybridKVError(f"--shadow-rate {self.shadow_rate}: a share of requests, from 0 to 1")


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


def top1_lead(logprobs: dict[int, float]) -> float:
    """How far the top token's logprob stands above the second's."""
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def logprob_gap(reference: dict[int, float], got: dict[int, float]) -> float:
    """The largest logprob difference over the tokens both top-k lists hold."""
    return max((abs(reference[t] - got[t]) for t in reference.keys() & got.keys()), default=math.inf)


@dataclass
class RequestFidelity:
    """One request's first token against the reference's (the same prompt on `no-cache`)."""

    agree: bool
    kl: float
    lead: float  # the reference's top-1 lead (`top1_lead`)
    gap: float  # `logprob_gap` from the reference

    @classmethod
    def of(cls, reference: dict[int, float], got: dict[int, float]) -> RequestFidelity:
        agree, kl = first_token_fidelity(reference, got)
        return cls(agree == 1.0, kl, top1_lead(reference), logprob_gap(reference, got))

    def clear(self, noise: float) -> bool:
        """Whether the reference's lead exceeds what noise of `noise` on each of its top two
        tokens could close: only then is a flip evidence against the computation."""
        return self.lead > 2 * noise


def split_noise(pairs: list[tuple[dict[int, float], dict[int, float]]]) -> float | None:
    """The largest `logprob_gap` between two computations of one prompt that are exact in
    principle: each pair is vLLM alone's reply and vLLM's own prefix cache's.

    vLLM's prefix cache changes no arithmetic but the prefill's split (on its block grid, where
    it holds exact states) and, under several clients, the batch each prompt shares a step with:
    what their replies differ by is bf16 rounding of differently shaped passes, the noise every
    configuration's first token carries against the reference. It is measured on the same
    server run, CPU and client count as the rows it filters, and without the connector, so a
    connector whose replayed state drifts cannot widen the band that excuses its own flips. The
    maximum, not a quantile: a lead only has to clear what noise was seen to do. None without a
    pair (the run had no vLLM prefix-cache configuration).

    A floor, not a bound: the cache splits a prefill only on its block grid (a multiple of 128
    tokens), and its replies stay within a few bf16 steps of one pass. A split off that grid, as
    every hybridkv resume is, can round much more differently: on the random-weight bench model,
    vLLM alone split by chunked prefill at the tokens hybridkv resumed from moved a first-token
    logprob by up to 0.23 for a few prompts in twenty, and flipped some top-1 tokens, as hybridkv
    did on the same prompts. A clear-lead flip is therefore to be checked against vLLM split at
    the same token before it is charged to the replayed state.
    """
    return max((logprob_gap(reference, got) for reference, got in pairs), default=None)


def top1_clear(fidelity: list[RequestFidelity], noise: float | None) -> tuple[float | None, int]:
    """(top-1 agreement over the requests whose reference lead clears `noise`, how many they are);
    agreement None where none does (or no noise was measured)."""
    if noise is None:
        return None, 0
    clear = [float(f.agree) for f in fidelity if f.clear(noise)]
    return (statistics.mean(clear) if clear else None), len(clear)


def _runs(plan: BenchPlan) -> list[tuple[str, str | None]]:
    """(config, budget) pairs, one `vllm serve` process each."""
    return [("no-cache", None), ("vllm-prefix-cache", None), *(("hybridkv", b) for b in plan.budgets)]


def ensure_calibrated(model: str) -> dict:
    """The model's calibration (`hybridkv calibrate`), measured now if it has none beside it."""
    from hybridkv.eval.calibrate import calibrate
    from hybridkv.models.calibration import CALIBRATION_FILE, Calibration

    path = Path(model) / CALIBRATION_FILE
    if not path.exists():
        from hybridkv.models import load_model

        calibrate(load_model(model)).write(path)  # float32: the gates' own precision
    return asdict(Calibration.read(path))


def prompt_tokens(model: str, shape: Shape) -> Tokens:
    """Stretches of the arena's pseudo-essay in the model's own tokens for a model that ships a
    tokenizer (a trained one), seeded random ids for one that does not (a random-weight bench model)."""
    from hybridkv.eval.workloads.essay import essay_words
    from hybridkv.models.tokenizer import TOKENIZER_FILES, load_tokenizer

    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        return Tokens()
    # every word is at least one token: longer than any prompt piece a workload cuts from it
    words = essay_words(2 * shape.max_prefix + 4096)
    return Tokens(text=tuple(load_tokenizer(model).encode(" ".join(words))))


def run_bench(plan: BenchPlan, out: Path, show_progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tokens = prompt_tokens(plan.model, plan.shape)
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
                plan.model, config, max_model_len, store, budget or str(DEFAULT_REPLAY_BUDGET), plan.top_logprobs,
                plan.seed, namespace, plan.shadow_rate,
            )  # fmt: skip
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
                        (w, c): make_sessions(w, shape, plan.seed, c, tokens)
                        for w in plan.workloads
                        for c in plan.clients
                    }
                    longest = max(len(p) for runs in sessions.values() for s in runs for p in s)
                    if longest > max_model_len:
                        raise HybridKVError(f"a workload prompt of {longest} tokens exceeds {max_model_len}")
                run = {"block_size": block_size, "results": {}}
                for (name, clients), runs in sessions.items():
                    progress.set_postfix_str(f"{label}: {name}, {clients} clients")
                    before = metric_totals(servers) if config == "hybridkv" else None
                    replies, wall = _run(urls, runs, clients, plan, progress.update)
                    requests = sum(len(s) for s in runs)
                    spent = _connector_spent(servers, before, requests) if before is not None else None
                    if before is not None and plan.shadow_rate > 0:  # checks finish after their answers
                        progress.set_postfix_str(f"{label}: {name}, {clients} clients: shadow checks")
                        spent = (spent or {}) | shadow_figures(before, settle_shadow_checks(servers))
                    run["results"][(name, clients)] = (replies, wall, spent)
            measured[(config, budget)] = run
    summary = summarise(plan, measured) | {"calibration": calibration, "prompts": tokens.kind}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "replies.json").write_text(json.dumps(reply_records(measured)) + "\n")
    (out / "report.md").write_text(report(summary))
    for name in plan.workloads:
        plot(summary, name, out / f"ttft-{name}.png")
    return summary


_SECONDS = ("hook_seconds", "wait_seconds", "copy_seconds", "lookup_seconds", "write_seconds")


def _connector_spent(servers: list[Server], before: dict[str, float], requests: int) -> dict[str, float] | None:
    """Milliseconds per request of the connector's hooks, copies and lookups over one run, from
    its counters on the servers' /metrics (read again for a few seconds, until every request's
    lookup is counted: the server records a step's figures just after answering)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        after = metric_totals(servers)
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


def shadow_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """The shadow checks between two readings of the servers' series (`Server.metrics`): how many;
    of the zero-state first-token checks, how many flipped the first token (and their share), the
    mean KL(exact || served recipe) and the share whose served token the shadow reproduced (greedy
    requests); and per kind of request (`shadow.py`), the served answers checked, how many diverged
    from exact greedy, the mean first diverging position, and the excess divergence rate over the
    full prefills' (the control) with its 95% interval."""
    from hybridkv.eval.stats import Excess
    from hybridkv.integrations.vllm.shadow import CONTROL

    def grew(name: str) -> float:
        return after.get(f"vllm:hybridkv_{name}", 0.0) - before.get(f"vllm:hybridkv_{name}", 0.0)

    checks, flips = int(grew("shadow_first_token_checks_total")), int(grew("shadow_top1_disagreements_total"))
    compared = grew("shadow_reproduced_checked_total")
    kinds = sorted(
        {m.group(1) for key in after if (m := re.fullmatch(r'vllm:hybridkv_shadow_answers_total\{kind="(.*)"\}', key))}
    )

    def answers(kind: str) -> tuple[int, int, float]:
        label = f'{{kind="{kind}"}}'
        return (
            int(grew(f"shadow_answers_total{label}")),
            int(grew(f"shadow_answer_divergences_total{label}")),
            grew(f"shadow_divergence_position_sum{label}"),
        )

    control = answers(CONTROL)
    per_kind = {}
    for kind in kinds:
        n, diverged, positions = answers(kind)
        if not n:
            continue
        excess = Excess.of(diverged, n, control[1], control[0]) if kind != CONTROL else None
        per_kind[kind] = {
            "answers": n,
            "divergences": diverged,
            "divergence_rate": diverged / n,
            "mean_divergence_position": positions / diverged if diverged else None,
            "excess": None if excess is None else excess.excess,
            "excess_ci95": None if excess is None else [excess.low, excess.high],
        }
    return {
        "shadow_checks": int(grew("shadow_checks_total")),
        "shadow_first_token_checks": checks,
        "shadow_top1_disagreements": flips,
        "shadow_disagreement_rate": flips / checks if checks else None,
        "shadow_kl_mean": grew("shadow_kl_sum") / checks if checks else None,
        "shadow_reproduced_rate": grew("shadow_reproduced_total") / compared if compared else None,
        "shadow_dropped": int(grew("shadow_dropped_total")),
        "shadow_failed": int(grew("shadow_failed_total")),
        "shadow_answers": per_kind,
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


@dataclass(frozen=True)
class _Cell:
    """One workload at one client count, as every configuration's row there is measured against:
    the reference's (`no-cache`) replies, the split noise at that client count, and the cold requests."""

    workload: str
    clients: int
    reference: list[tuple[int, int, Reply]]
    noise: float | None
    cold: set[int]


def _summary_row(
    plan: BenchPlan,
    cell: _Cell,
    config: str,
    budget: str | None,
    run: dict,
    flat: list[tuple[int, int, Reply]],
    fidelity: list[RequestFidelity],
) -> dict:
    """One configuration's row at `cell`: its TTFT, throughput, reuse, first-token fidelity and costs."""
    _, wall, spent = run["results"][(cell.workload, cell.clients)]
    ttfts = [r.ttft_s for _, _, r in flat]
    clear, clear_requests = top1_clear(fidelity, cell.noise)
    cold = cell.cold
    return {
        "workload": cell.workload,
        "config": config,
        "clients": cell.clients,
        "engines": plan.engines,
        "budget": budget,
        "block_size": run["block_size"],
        "requests": len(flat),
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "throughput_rps": len(flat) / wall,
        "reused_tokens_per_request": statistics.mean(r.reused_tokens for _, _, r in flat),
        "replayed_tokens_per_request": statistics.mean(r.replayed_tokens for _, _, r in flat),
        "top1_agreement": statistics.mean(float(f.agree) for f in fidelity),
        "kl_mean": statistics.mean(f.kl for f in fidelity),
        "top1_clear": clear,
        "clear_requests": clear_requests,
        # requests no cached configuration reused a token on (a prefix's first sight):
        # every configuration pays their whole prefill, so they bound what a cache can save
        "cold_requests": len(cold),
        "ttft_cold_sum_s": sum(ttfts[i] for i in cold),
        "ttft_rest_mean_s": _mean_or_none([t for i, t in enumerate(ttfts) if i not in cold]),
        # prompt tokens computed (not reused), and, for hybridkv, those no stored prefix
        # matched: every configuration computes them, whatever its budget
        "computed_tokens_per_request": statistics.mean(r.prompt_tokens - r.reused_tokens for _, _, r in flat),
        "unmatched_tokens_per_request": statistics.mean(r.prompt_tokens - r.hybridkv["matched"] for _, _, r in flat)
        if config == "hybridkv"
        else None,
        # hybridkv only: the connector's milliseconds per request (hooks and lookup
        # waits on the engine loop, page copies, lookups and writes on their threads)
        **dict.fromkeys(CONNECTOR_FIELDS),
        **dict.fromkeys(SHADOW_FIELDS),
        **(spent or {}),
    }


def _disagreements(
    cell: _Cell, config: str, budget: str | None, flat: list[tuple[int, int, Reply]], fidelity: list[RequestFidelity]
) -> list[dict]:
    """Every request of one configuration at `cell` whose first token differs from the reference's."""
    return [
        {
            "workload": cell.workload,
            "config": config,
            "clients": cell.clients,
            "budget": budget,
            "session": session,
            "turn": turn,
            "lead": f.lead,
            "gap": f.gap,
            "kl": f.kl,
            "clear": cell.noise is not None and f.clear(cell.noise),
            "reused": got.reused_tokens,
            "replayed": got.replayed_tokens,
            "exact_state": got.hybridkv.get("exact_state") if got.hybridkv else None,
        }
        for f, (session, turn, got) in zip(fidelity, flat, strict=True)
        if not f.agree
    ]


def summarise(plan: BenchPlan, measured: dict) -> dict:
    """One row per workload, client count and configuration; `split_noise` per client count; and
    every request whose first token differs from the reference's, with what tells a near-tie
    (a small reference lead) from a divergence (a lead the gap had to overcome)."""
    rows: list[dict] = []
    disagreements: list[dict] = []
    noise = {str(c): _split_noise_at(plan, measured, c) for c in plan.clients}
    for name in plan.workloads:
        for clients in plan.clients:
            reference = _flat(measured[("no-cache", None)]["results"][(name, clients)][0])
            cell = _Cell(name, clients, reference, noise[str(clients)], _cold_requests(measured, name, clients))
            for (config, budget), run in measured.items():
                flat = _flat(run["results"][(name, clients)][0])
                fidelity = [
                    RequestFidelity.of(ref.logprobs, got.logprobs)
                    for (_, _, ref), (_, _, got) in zip(reference, flat, strict=True)
                ]
                rows.append(_summary_row(plan, cell, config, budget, run, flat, fidelity))
                disagreements += _disagreements(cell, config, budget, flat, fidelity)
    return {
        "model": plan.model,
        "seed": plan.seed,
        "shape": asdict(plan.shape),
        "shadow_rate": plan.shadow_rate,
        "split_noise": noise,
        "rows": rows,
        "disagreements": disagreements,
    }


def _cold_requests(measured: dict, workload: str, clients: int) -> set[int]:
    """Indices (in `_flat`'s order) of the requests on which no configuration with a cache reused a
    token: what every configuration computes in full."""
    runs = [_flat(run["results"][(workload, clients)][0]) for key, run in measured.items() if key[0] != "no-cache"]
    count = len(_flat(measured[("no-cache", None)]["results"][(workload, clients)][0]))
    return {i for i in range(count) if all(run[i][2].reused_tokens == 0 for run in runs)}


def _mean_or_none(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _split_noise_at(plan: BenchPlan, measured: dict, clients: int) -> float | None:
    """`split_noise` at one client count, pooled over the workloads: what moves a logprob is the
    shape of the passes (the prefill's split, the step's batch), not which prompt it is, and
    every workload's requests add samples."""
    cache = measured.get(("vllm-prefix-cache", None))
    if cache is None:
        return None
    pairs = []
    for name in plan.workloads:
        alone = _flat(measured[("no-cache", None)]["results"][(name, clients)][0])
        cached = _flat(cache["results"][(name, clients)][0])
        pairs += [(ref.logprobs, got.logprobs) for (_, _, ref), (_, _, got) in zip(alone, cached, strict=True)]
    return split_noise(pairs)


def _flat(replies: list[list[Reply]]) -> list[tuple[int, int, Reply]]:
    """(session, turn, reply) in one order every configuration shares: session by session."""
    return [(s, t, r) for s, session in enumerate(replies) for t, r in enumerate(session)]


def reply_records(measured: dict) -> list[dict]:
    """Every request's reply, one record each, in `_flat`'s order: what the summary's rows
    average, kept so a row's figures can be traced to the requests behind them."""
    return [
        {
            "workload": name,
            "clients": clients,
            "config": config,
            "budget": budget,
            "session": session,
            "turn": turn,
            "ttft_s": r.ttft_s,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "hybridkv": r.hybridkv,
            "logprobs": {str(token): lp for token, lp in r.logprobs.items()},
        }
        for (config, budget), run in measured.items()
        for (name, clients), (replies, _, _) in run["results"].items()
        for session, turn, r in _flat(replies)
    ]


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


def _clear_cell(row: dict) -> str:
    agreement = "—" if row.get("top1_clear") is None else f"{row['top1_clear']:.3f}"
    return f"{agreement} ({row.get('clear_requests', 0)})"


def _cold_cells(row: dict, base: dict) -> str:
    """The cold-request columns of the align-mode table (— for a summary made before they existed)."""
    if row.get("cold_requests") is None:
        return "— | — | — | —"
    total = row["ttft_mean_s"] * row["requests"]
    share = row["ttft_cold_sum_s"] / total if total else 0.0
    cold = row["ttft_cold_sum_s"] / base["ttft_cold_sum_s"] if base["ttft_cold_sum_s"] else None
    rest = row["ttft_rest_mean_s"] / base["ttft_rest_mean_s"] if base.get("ttft_rest_mean_s") else None
    return " | ".join(
        [f"{row['cold_requests']}/{row['requests']}", f"{share:.0%}"]
        + ["—" if value is None else f"{value:.2f}" for value in (cold, rest)]
    )


def _token_cells(row: dict, base: dict) -> str:
    """Computed and unmatched tokens against align mode's computed tokens (— where not recorded)."""
    computed = base.get("computed_tokens_per_request")
    if not computed or row.get("unmatched_tokens_per_request") is None:
        return "— | —"
    return f"{row['computed_tokens_per_request'] / computed:.2f} | {row['unmatched_tokens_per_request'] / computed:.2f}"


_PROMPTS = {
    "text": "Prompts: stretches of the arena's pseudo-essay in the model's own tokens; a trained model's first "
    "token on text is decisive, so top-1 agreement and KL measure what recovery keeps.",
    "random ids": "Prompts: seeded random token ids, for a random-weight model: its first-token distribution is "
    "near uniform, so top-1 agreement is mostly tie-breaking (read `clear top-1`); these rows are for the block "
    "grid and timing, and quality comes from a trained model (the default, `tiny-qwen3-next-vllm`).",
}


def _report_head(summary: dict) -> list[str]:
    """The title, what was measured and how, and what the prompts were."""
    shape = summary["shape"]
    blocks = sorted({r["block_size"] for r in summary["rows"]})
    return [
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
        _PROMPTS.get(summary.get("prompts"), ""),
        "",
    ]


def _calibration_lines(summary: dict) -> list[str]:
    """The calibrated horizon `hybridkv@adaptive` replays, when the run had one."""
    if not (calibration := summary.get("calibration")):
        return []
    return [
        f"`hybridkv@adaptive` replays the model's calibrated forgetting horizon, {calibration['horizon']} tokens "
        f"(`hybridkv calibrate`: tolerance {calibration['tolerance']}, quantile {calibration['quantile']}, "
        f"{calibration['samples']} prompts of {calibration['tokens']} {calibration['text']}).",
        "",
    ]


def _noise_lines(noise: dict) -> list[str]:
    """The split noise by client count, and what `clear top-1` reads it for."""
    if not any(v is not None for v in noise.values()):
        return []
    return [
        "Split noise (the largest first-token logprob difference between `vllm-prefix-cache` and `no-cache` "
        "over every workload's requests, by client count): "
        + ", ".join(f"{c} clients {v:.4f}" for c, v in noise.items() if v is not None)
        + ". `clear top-1` is top-1 agreement over the requests (n) whose reference top-1 lead exceeds twice "
        "the noise. The noise is a floor: vLLM's cache splits a prefill only on its block grid; a split off the "
        "grid, as every hybridkv resume is, can move a logprob much more, in vLLM alone too (`split_noise`).",
        "",
    ]


def _workload_tables(summary: dict) -> list[str]:
    """Per workload: its plot and a row per client count and configuration."""
    lines: list[str] = []
    for workload in dict.fromkeys(r["workload"] for r in summary["rows"]):
        lines += [
            f"## {workload}",
            "",
            f"![TTFT, {workload}](ttft-{workload}.png)",
            "",
            "| clients | config | TTFT mean s | p50 | p99 | req/s | reused / req | replayed / req | top-1 "
            "| clear top-1 (n) | KL mean | connector ms / req: hooks / waits / copies / lookup / writes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in (r for r in summary["rows"] if r["workload"] == workload):
            lines.append(
                f"| {row['clients']} | {_label(row)} | {row['ttft_mean_s']:.3f} | {row['ttft_p50_s']:.3f} | "
                f"{row['ttft_p99_s']:.3f} | {row['throughput_rps']:.2f} | {row['reused_tokens_per_request']:.0f} | "
                f"{row['replayed_tokens_per_request']:.0f} | {row['top1_agreement']:.3f} | {_clear_cell(row)} | "
                f"{row['kl_mean']:.2e} | "
                + (
                    " / ".join(f"{row[f]:.1f}" for f in CONNECTOR_FIELDS) + " |"
                    if row["hook_ms_per_request"] is not None
                    else "— |"
                )
            )
        lines.append("")
    return lines


def _disagreement_lines(disagreements: list[dict] | None, noise: dict) -> list[str]:
    """Every request whose first token differs from `no-cache`'s, with its lead and gap."""
    if not disagreements:
        return []
    lines = [
        "## Top-1 disagreements",
        "",
        "Every request whose first token differs from `no-cache`'s: the reference's top-1 lead, the largest "
        "logprob difference from it over the tokens both top-k lists hold (the gap, also in units of the split "
        "noise), and what the request reused, replayed and resumed from (exact: a stored linear state computed "
        "from the prompt's start; inexact: zeroed states, or a stored state computed after a replay from "
        "zeroed states). A near-tie has a lead within twice the noise.",
        "",
        "| workload | clients | config | session / turn | lead | gap | gap / noise | KL | reused | replayed "
        "| state | flip |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in disagreements:
        at = noise.get(str(d["clients"]))
        state = "exact" if d["exact_state"] else "inexact" if d["exact_state"] is False and d["reused"] else "—"
        lines.append(
            f"| {d['workload']} | {d['clients']} | {_label(d)} | {d['session']} / {d['turn']} | {d['lead']:.4f} | "
            f"{d['gap']:.4f} | {d['gap'] / at if at else math.inf:.1f} | {d['kl']:.2e} | {d['reused']} | "
            f"{d['replayed']} | {state} | {'clear lead' if d['clear'] else 'near-tie'} |"
        )
    lines.append("")
    return lines


def _shadow_lines(summary: dict) -> list[str]:
    """The shadow checks' figures, per row that ran them."""
    if not (shadowed := [r for r in summary["rows"] if r.get("shadow_checks") is not None]):
        return []
    lines = [
        "## Shadow checks",
        "",
        f"The connector checked a share {summary.get('shadow_rate')} of its requests in a shadow process "
        "(`shadow_rate`), after each was answered. Served answers: teacher-forced through exact full prefill "
        "in transformers, per kind of request (`full`: nothing loaded, the control group; `exact`: an exact "
        "stored state; `zero@budget`: a zero-state tail), the share whose served tokens left exact greedy "
        "before the answer's end, and its excess over the full prefills' (the engine's own noise) with a 95% "
        "interval. First token: a zero-state resume's served recipe (the KV before the resume point, zeroed "
        "states there) against the exact one on one code path; flips: top-1 differs; KL(exact || served recipe) "
        "in nats; reproduced: the share whose served recipe's top-1 is the token vLLM served.",
        "",
        "| workload | clients | budget | answers diverged (kind) | excess over full [95% CI] | "
        "first-token checks | flips | flip rate | KL mean | reproduced | dropped | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in shadowed:
        rate, kl, same = row["shadow_disagreement_rate"], row["shadow_kl_mean"], row["shadow_reproduced_rate"]
        answers = row.get("shadow_answers") or {}
        diverged = "; ".join(f"{f['divergences']}/{f['answers']} ({kind})" for kind, f in answers.items())
        excess = "; ".join(
            f"{f['excess']:+.3f} [{f['excess_ci95'][0]:+.3f}, {f['excess_ci95'][1]:+.3f}] ({kind})"
            for kind, f in answers.items() if f.get("excess") is not None
        )  # fmt: skip
        lines.append(
            f"| {row['workload']} | {row['clients']} | {row['budget']} | {diverged or '—'} | {excess or '—'} | "
            f"{row.get('shadow_first_token_checks', row['shadow_checks'])} | "
            f"{row['shadow_top1_disagreements']} | {'—' if rate is None else f'{rate:.3f}'} | "
            f"{'—' if kl is None else f'{kl:.2e}'} | {'—' if same is None else f'{same:.3f}'} | "
            f"{row['shadow_dropped']} | {row['shadow_failed']} |"
        )
    lines.append("")
    return lines


def _align_lines(summary: dict) -> list[str]:
    """Each hybridkv budget against `vllm-prefix-cache` at the same workload and client count."""
    lines = [
        "## hybridkv against vLLM's align mode",
        "",
        "Mean TTFT and throughput of each hybridkv budget divided by `vllm-prefix-cache`'s, same workload and "
        "client count (the targets: TTFT ≤ 0.6 off the grid and on multi-turn, ≤ 1.05 on grid-aligned; "
        "throughput at 16 clients ≥ 1). Cold requests are those on which no cached configuration reused a "
        "token (a prefix seen for the first time): every configuration prefills them in full, so their share "
        "of hybridkv's TTFT is a cost no cache removes; `rest` is the ratio over the other requests, and "
        "`cold / align` compares what the two configurations spent on the same cold requests. Computed tokens "
        "are prompt tokens not reused (hybridkv's include its replay); unmatched ones, those no stored prefix "
        "matched, which every configuration computes: their ratio to align mode's computed tokens is what any "
        "budget leaves where TTFT follows the tokens computed (many clients on few cores).",
        "",
        "| workload | clients | budget | TTFT / align mode | throughput / align mode | cold requests | "
        "hybridkv's TTFT on them | cold / align | TTFT / align mode, rest | computed tokens / align mode | "
        "unmatched / align mode's computed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    align = {(r["workload"], r["clients"]): r for r in summary["rows"] if r["config"] == "vllm-prefix-cache"}
    for row in summary["rows"]:
        if row["config"] == "hybridkv" and (base := align.get((row["workload"], row["clients"]))) is not None:
            lines.append(
                f"| {row['workload']} | {row['clients']} | {row['budget']} | "
                f"{row['ttft_mean_s'] / base['ttft_mean_s']:.2f} | "
                f"{row['throughput_rps'] / base['throughput_rps']:.2f} | "
                + _cold_cells(row, base)
                + " | "
                + _token_cells(row, base)
                + " |"
            )
    lines.append("")
    return lines


def report(summary: dict) -> str:
    """The summary as report.md: a section each, in this order."""
    noise = summary.get("split_noise") or {}
    lines = [
        *_report_head(summary),
        *_calibration_lines(summary),
        *_noise_lines(noise),
        *_workload_tables(summary),
        *_disagreement_lines(summary.get("disagreements"), noise),
        *_shadow_lines(summary),
        *_align_lines(summary),
    ]
    return "\n".join(lines)
