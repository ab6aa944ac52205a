"""Served TTFT with the connector's shadow checks on against off, side by side in one run.

Two `vllm serve` configurations of one model, HybridKVConnector at budget 0.05 with `shadow_rate`
0 and with `shadow_rate` R, are started in turn, alternating, REPEATS times each; each answers the
same vllm-bench sessions (the workload at CLIENTS concurrent clients, each server in a store
namespace of its own, so every run sees the same hits). The shadow process is started (and its
model loaded) before the measurement, as on a server that has been up a while. Per run: the TTFT
p50 and mean over its requests, and the checks the shadow made for them (counted once they are all
done, after the run). The
result is the median over repeats of the per-repeat ratio p50(on) / p50(off), written as JSON and
markdown to OUT.

    .venv/bin/python benchmarks/shadow_overhead.py --out results/vllm-shadow-overhead [--rate 0.1] \
        [--clients 4] [--repeats 5] [--workload shared-system] [--requests 48]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import uuid
from pathlib import Path

from hybridkv.models.tiny import WEIGHTS_DIR
from hybridkv.serving.bench import BenchPlan, _flat, _percentile, _run, prompt_tokens
from hybridkv.serving.server import Server, ServerSpec, settle_shadow_checks
from hybridkv.serving.traffic import Shape, make_sessions


def _warm_shadow(server: Server, plan: BenchPlan) -> None:
    """Send greedy misses until one was sampled and checked: the shadow process is then up."""
    for _ in range(200):
        _run([server.url], [[[5] * 48 + [int(uuid.uuid4().int % 400) + 3] * 16]], 1, plan)
        if settle_shadow_checks([server]).get("vllm:hybridkv_shadow_checks_total", 0):
            return
    raise RuntimeError("no shadow check was made in 200 requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(WEIGHTS_DIR / "tiny-qwen3-next-vllm"))
    parser.add_argument("--rate", type=float, default=0.1)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", default="shared-system")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-prefix", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    shape = Shape(min_prefix=1024, max_prefix=args.max_prefix, requests=args.requests)
    plan = BenchPlan(args.model, [args.workload], [args.clients], ["0.05"], shape)
    sessions = make_sessions(args.workload, shape, 0, args.clients, prompt_tokens(args.model, shape))
    store = args.out / "store"
    runs = []
    for repeat in range(args.repeats):
        for rate in (0.0, args.rate):
            shutil.rmtree(store, ignore_errors=True)
            spec = ServerSpec(
                args.model, "hybridkv", args.max_prefix + 2048, f"file://{store.resolve()}", "0.05",
                namespace=uuid.uuid4().hex, shadow_rate=rate,
            )  # fmt: skip
            with Server(spec, args.out / "logs" / f"rate-{rate}-{repeat}.log") as server:
                _run([server.url], [[[5] * 64]], 1, plan)  # start-up costs, outside the measurement
                if rate:  # and the shadow's: its process starts, and loads the model, with its first job
                    _warm_shadow(server, plan)
                before = settle_shadow_checks([server]) if rate else {}
                replies, wall = _run([server.url], sessions, args.clients, plan)
                ttfts = [r.ttft_s for _, _, r in _flat(replies)]
                after = settle_shadow_checks([server]) if rate else {}
                checks = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            runs.append({
                "repeat": repeat, "shadow_rate": rate, "requests": len(ttfts), "wall_s": wall,
                "ttft_p50_s": _percentile(ttfts, 50), "ttft_mean_s": statistics.mean(ttfts),
                "shadow_checks": checks.get("vllm:hybridkv_shadow_checks_total", 0),
                "shadow_dropped": checks.get("vllm:hybridkv_shadow_dropped_total", 0),
            })  # fmt: skip
            print(json.dumps(runs[-1]), flush=True)
    shutil.rmtree(store, ignore_errors=True)
    pairs = [(off, on) for off, on in zip(runs[::2], runs[1::2], strict=True)]
    ratios = [on["ttft_p50_s"] / off["ttft_p50_s"] for off, on in pairs]
    mean_ratios = [on["ttft_mean_s"] / off["ttft_mean_s"] for off, on in pairs]
    summary = {
        "model": args.model, "workload": args.workload, "clients": args.clients, "shadow_rate": args.rate,
        "runs": runs, "p50_ratios": ratios, "p50_ratio_median": statistics.median(ratios),
        "mean_ratio_median": statistics.median(mean_ratios),
    }  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# Served TTFT with shadow checks at rate {args.rate} against off",
        "",
        f"{args.model}, {args.workload}, {args.clients} clients, {args.requests} requests per run, budget 0.05; "
        f"servers alternating, {args.repeats} repeats.",
        "",
        "| repeat | p50 off (s) | p50 on (s) | p50 on / off | mean on / off | checks made | dropped |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {off['repeat']} | {off['ttft_p50_s']:.4f} | {on['ttft_p50_s']:.4f} | {r:.3f} | {m:.3f} | "
            f"{on['shadow_checks']:.0f} | {on['shadow_dropped']:.0f} |"
            for (off, on), r, m in zip(pairs, ratios, mean_ratios, strict=True)
        ),
        "",
        f"Median p50 ratio {summary['p50_ratio_median']:.3f}; median mean ratio {summary['mean_ratio_median']:.3f}.",
        "",
    ]
    (args.out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
