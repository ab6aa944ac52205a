"""`hybridkv trace-replay`: a scaled copy of a request trace through `vllm serve`, measured against
what `hybridkv trace-sim` predicts for the same copy (issue 47, §3: simulated = measured).

The copy: the first `requests` requests of a Mooncake trace, each hash block turned into
512 / `scale` tokens of fixed random content per hash id (seeded, the same wherever the id occurs),
so two requests share exactly the token prefix of the blocks they share. A request keeps its whole
blocks only (its partial last block is dropped): its end is then a block boundary, where the next
turn of its conversation stops matching it (the trace gives the grown block a new id), so a state
stored at a prompt's end is the checkpoint the simulator's `hybridkv` policy places there. With the
default `grid-128` model and scale 4, one trace block is one vLLM block of 128 tokens.

The runs, one `vllm serve` each, requests sent one at a time in trace order: vLLM alone (no cache),
vLLM's own prefix cache, and HybridKVConnector on a redis store bounded at each capacity under
`policy`. Measured per run: the token hit share (tokens the connector matched over input tokens),
the exact-hit share (matched tokens of hits resumed from a stored state) and TTFT; the simulator
replays the same copy at the same capacities with the served model's sizes and cost model.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.trace_sim import TRACE_BLOCK, TraceSimConfig, read_trace, run_sweep
from hybridkv.serving.server import Server, ServerSpec, complete
from hybridkv.store import open_store

MB = 1e6
SIM_POLICY = {"lru": "hybridkv", "value": "hybridkv-value"}  # the store's rule -> trace-sim's policy


@dataclass(frozen=True)
class TraceReplayConfig:
    """What `hybridkv trace-replay` replays. A field's `help` is its flag's text."""

    trace: Path = field(
        metadata={"help": "request trace (Mooncake's jsonl: input_length, hash_ids of 512-token blocks)"}
    )
    redis: str = field(
        metadata={"help": "a redis server the connector's stores go on (databases 11-13 are cleared and used)"}
    )
    requests: int = field(default=400, metadata={"help": "the trace's first N requests"})
    scale: int = field(default=4, metadata={"help": "tokens scaled down by this factor (a 512-token block: 512/scale)"})
    capacities_mb: tuple[float, ...] = field(
        default=(100, 300, 1000), metadata={"help": "store capacities in MB (1e6 bytes)"}
    )
    policy: str = field(default="lru", metadata={"help": "the store's rule: lru or value", "choices": ("lru", "value")})
    budget: float = field(default=0.05, metadata={"help": "the connector's replay budget (and the simulator's tail)"})
    seed: int = field(default=0, metadata={"help": "seed of each hash block's token content"})

    def check(self) -> None:
        if self.requests < 1 or self.scale < 1 or TRACE_BLOCK % self.scale:
            raise HybridKVError(f"--requests must be positive and --scale divide {TRACE_BLOCK}")
        if not self.capacities_mb or min(self.capacities_mb) <= 0:
            raise HybridKVError("--capacities-mb must be positive")
        if not 0 <= self.budget < 1:
            raise HybridKVError(f"--budget {self.budget} is not a fraction in [0, 1)")


@dataclass(frozen=True)
class ScaledTrace:
    block: int  # tokens per hash block
    rows: list[dict]  # the copy, in Mooncake's format (input_length, hash_ids)
    prompts: list[list[int]]


def scale_trace(path: Path, requests: int, scale: int, vocab: int, seed: int = 0) -> ScaledTrace:
    """The first `requests` requests of the trace at `path`, scaled down (see the module's text).
    Requests with no whole block are left out."""
    block = TRACE_BLOCK // scale
    trace = read_trace(path)
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    content: dict[int, list[int]] = {}
    rows, prompts = [], []
    for row in lines[:requests]:
        ids = row["hash_ids"][: row["input_length"] // TRACE_BLOCK]
        if not ids:
            continue
        tokens = []
        for hash_id in ids:
            if hash_id not in content:
                rng = random.Random(f"{seed}:{hash_id}")
                content[hash_id] = [rng.randrange(3, vocab) for _ in range(block)]
            tokens += content[hash_id]
        rows.append({"input_length": len(tokens), "hash_ids": ids})
        prompts.append(tokens)
    if not prompts:
        raise HybridKVError(f"{trace.path}: none of its first {requests} requests has a whole block")
    return ScaledTrace(block, rows, prompts)


def _replay(spec: ServerSpec, prompts: list[list[int]], log: Path, progress) -> list[dict]:
    """Every prompt through one `vllm serve`, one at a time; per request what it reused and its TTFT."""
    import httpx

    async def run(server: Server) -> list[dict]:
        out = []
        async with httpx.AsyncClient(timeout=600) as client:
            for prompt in prompts:
                reply = await complete(client, server.url, spec.model, prompt, 1)
                connector = reply.hybridkv or {}
                out.append({
                    "tokens": len(prompt), "ttft_s": reply.ttft_s, "cached": reply.cached_tokens,
                    "matched": connector.get("matched", 0), "reused": connector.get("reused", 0),
                    "exact": bool(connector.get("exact_state")),
                })  # fmt: skip
                progress()
        return out

    with Server(spec, log) as server:
        return asyncio.run(run(server))


def _measured(config: str, capacity_mb: float | None, rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    ttfts = [r["ttft_s"] for r in rows]
    hit = sum(r["matched"] if config == "hybridkv" else r["cached"] for r in rows)
    # vLLM's own cache resumes only from states it computed exactly: every hit of it is exact
    exact = sum(r["matched"] for r in rows if r["exact"]) if config == "hybridkv" else hit
    return {
        "config": config, "capacity_mb": capacity_mb, "requests": len(rows), "input_tokens": tokens,
        "token_hit_share": hit / tokens, "exact_hit_share": exact / tokens,
        "ttft_median_s": statistics.median(ttfts), "ttft_mean_s": statistics.fmean(ttfts),
    }  # fmt: skip


def run_trace_replay(config: TraceReplayConfig, model: str, out: Path, show_progress: bool = True) -> dict:
    """Simulate, then serve, the scaled copy; writes `out`/scaled_trace.jsonl, requests.jsonl and
    summary.json, and returns the summary."""
    from tqdm import tqdm

    from hybridkv.eval.plan import load_config

    config.check()
    out.mkdir(parents=True, exist_ok=True)
    vocab = load_config(model).vocab_size
    scaled = scale_trace(config.trace, config.requests, config.scale, vocab, config.seed)
    trace_file = out / "scaled_trace.jsonl"
    trace_file.write_text("".join(json.dumps(row) + "\n" for row in scaled.rows))
    sim_config = TraceSimConfig(
        trace=trace_file, capacities=tuple(c * MB / 1e9 for c in config.capacities_mb),
        policies=(SIM_POLICY[config.policy],), tail=config.budget, block_tokens=scaled.block, workers=1,
    )  # fmt: skip
    simulated = run_sweep(sim_config, model, show_progress=False)
    max_len = max(len(p) for p in scaled.prompts) + 16
    runs: list[tuple[str, float | None, ServerSpec]] = [
        ("no-cache", None, ServerSpec(model, "no-cache", max_len)),
        ("vllm-prefix-cache", None, ServerSpec(model, "vllm-prefix-cache", max_len)),
    ]
    base = config.redis.rstrip("/")
    for db, capacity in enumerate(config.capacities_mb, start=11):
        url = f"{base}/{db}?capacity={int(capacity * MB)}&policy={config.policy}"
        store = open_store(url)
        store.clear()
        store.close()
        runs.append(("hybridkv", capacity, ServerSpec(model, "hybridkv", max_len, url, str(config.budget))))
    measured, started = [], time.perf_counter()
    with (out / "requests.jsonl").open("w") as requests_log, tqdm(
        total=len(runs) * len(scaled.prompts), desc="trace-replay", unit="req", disable=not show_progress
    ) as bar:  # fmt: skip
        for name, capacity, spec in runs:
            label = name if capacity is None else f"{name}@{capacity:g}MB"
            bar.set_postfix_str(label)
            rows = _replay(spec, scaled.prompts, out / f"{label}.log", lambda: bar.update(1))
            for index, row in enumerate(rows):
                requests_log.write(json.dumps({"run": label, "request": index, **row}) + "\n")
            measured.append(_measured(name, capacity, rows))
    summary = {
        "config": {**asdict(config), "trace": str(config.trace)}, "model": model, "block_tokens": scaled.block,
        "requests": len(scaled.prompts), "input_tokens": sum(map(len, scaled.prompts)),
        "simulated": simulated, "measured": measured, "serve_seconds": time.perf_counter() - started,
        "agreement": agreement(simulated, measured),
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def agreement(simulated: dict, measured: list[dict]) -> list[dict]:
    """Per capacity: the simulator's token and exact-hit shares beside the measured ones."""
    rows = []
    for point in simulated["points"]:
        capacity_mb = point["capacity_gb"] * 1e9 / MB
        served = next(
            (m for m in measured if m["config"] == "hybridkv" and math.isclose(m["capacity_mb"], capacity_mb)), None
        )
        if served is None:
            continue
        row = {"capacity_mb": capacity_mb}
        for share in ("token_hit_share", "exact_hit_share"):
            row |= {f"simulated_{share}": point[share], f"measured_{share}": served[share]}
        rows.append(row)
    return rows
