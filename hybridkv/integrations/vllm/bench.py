"""`hybridkv vllm-bench`: one shared prefix, many suffixes, three ways through real vLLM.

For each prefix length L, a warm-up request puts `prefix + suffix_0` through the engine (what a
cache can learn from), then `requests` prompts `prefix + suffix_i` (each suffix its own) are sent
one at a time, each timed from submission to its first token (`max_tokens=1`). The same prompts
run through three engines, one after another in one invocation:

- `no-cache`: vLLM without prefix caching — every prompt is a full prefill; the fidelity reference;
- `vllm-prefix-cache`: vLLM's own hybrid prefix cache (`align` mode): hits on its block grid;
- `hybridkv`: vLLM with HybridKVConnector: token-level match, tail replay within the budget.

Fidelity compares each prompt's first-token distribution with `no-cache`'s, from the top-k
logprobs vLLM returns: top-1 agreement, and the KL divergence between the two distributions
coarsened to the reference's top k tokens plus one bucket for all others (a lower bound on the
full KL). TTFT is the median over requests.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

CONFIGS = ("no-cache", "vllm-prefix-cache", "hybridkv")


@dataclass
class BenchPlan:
    model: str
    prefix_lengths: list[int]
    requests: int = 8
    suffix_tokens: int = 64
    budget: str = "0.05"
    store: str | None = None  # default: a file store under the output folder, emptied first
    top_logprobs: int = 20
    seed: int = 0
    vocab: int = 500


def prompts_for(plan: BenchPlan, length: int) -> tuple[list[int], list[list[int]]]:
    """(warm-up prompt, measured prompts): one shared prefix of `length` tokens, own suffixes."""
    rng = random.Random(f"hybridkv-vllm-bench-{plan.seed}-{length}")

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, plan.vocab) for _ in range(n)]

    prefix = draw(length)
    return prefix + draw(plan.suffix_tokens), [prefix + draw(plan.suffix_tokens) for _ in range(plan.requests)]


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


def _engine(plan: BenchPlan, config: str, max_len: int, store: str):
    from vllm import LLM

    kv_transfer = None
    if config == "hybridkv":
        kv_transfer = {
            "kv_connector": "HybridKVConnector",
            "kv_connector_module_path": "hybridkv.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": store, "replay_budget": plan.budget},
        }
    return LLM(
        model=plan.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=config == "vllm-prefix-cache",
        max_model_len=max_len,
        max_num_batched_tokens=max_len,  # no chunked prefill: one prefill per prompt in every config
        dtype="bfloat16",
        seed=plan.seed,
        kv_transfer_config=kv_transfer,
        max_logprobs=plan.top_logprobs,
    )


def run_bench(plan: BenchPlan, out: Path, show_progress: bool = True) -> dict:
    # vLLM's CPU backend otherwise reserves most of the machine's memory for its KV cache.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM reserves one more CPU core once a KV connector is configured, which would give the
    # hybridkv engine another OpenMP thread count than the others (2 against 1 on a 2-core machine):
    # every configuration reserves the same one core, so the TTFTs compare like with like.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # a benchmark reports to nobody
    from vllm import SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    store = plan.store
    if store is None:
        shutil.rmtree(out / "store", ignore_errors=True)
        store = f"file://{(out / 'store').resolve()}"
    workloads = {length: prompts_for(plan, length) for length in plan.prefix_lengths}
    max_len = max(plan.prefix_lengths) + plan.suffix_tokens + 16
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=plan.top_logprobs, detokenize=False)
    results: dict[str, dict[int, list[dict]]] = {}
    total = len(CONFIGS) * len(plan.prefix_lengths) * plan.requests
    with tqdm(total=total, desc="vllm-bench", disable=not show_progress) as progress:
        for config in CONFIGS:
            progress.set_postfix_str(f"{config}: starting vLLM")
            llm = _engine(plan, config, max_len, store)
            try:
                llm.generate([{"prompt_token_ids": [5] * 64}], params, use_tqdm=False)  # one-time start-up costs
                results[config] = {}
                for length, (warm, prompts) in workloads.items():
                    progress.set_postfix_str(f"{config}, prefix {length}")
                    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
                    rows = []
                    for prompt in prompts:
                        started = time.perf_counter()
                        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                        ttft = time.perf_counter() - started
                        reuse = (output.kv_transfer_params or {}).get("hybridkv")
                        rows.append(
                            {
                                "ttft_s": ttft,
                                "reused": reuse["reused"] if reuse else (output.num_cached_tokens or 0),
                                "logprobs": {t: lp.logprob for t, lp in output.outputs[0].logprobs[0].items()},
                            }
                        )
                        progress.update()
                    results[config][length] = rows
            finally:
                llm.llm_engine.engine_core.shutdown()
    summary = summarise(plan, results)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(report(summary))
    plot(summary, out / "ttft.png")
    return summary


def summarise(plan: BenchPlan, results: dict[str, dict[int, list[dict]]]) -> dict:
    rows = []
    for length in plan.prefix_lengths:
        reference = results["no-cache"][length]
        base_ttft = statistics.median(r["ttft_s"] for r in reference)
        for config in CONFIGS:
            got = results[config][length]
            fidelity = [
                first_token_fidelity(ref["logprobs"], g["logprobs"]) for ref, g in zip(reference, got, strict=True)
            ]
            ttft = statistics.median(r["ttft_s"] for r in got)
            rows.append(
                {
                    "config": config,
                    "prefix_length": length,
                    "ttft_median_s": ttft,
                    "speedup": base_ttft / ttft,
                    "reused_tokens_per_request": statistics.mean(r["reused"] for r in got),
                    "top1_agreement": statistics.mean(a for a, _ in fidelity),
                    "kl_mean": statistics.mean(k for _, k in fidelity),
                }
            )
    return {
        "model": plan.model,
        "requests": plan.requests,
        "suffix_tokens": plan.suffix_tokens,
        "replay_budget": plan.budget,
        "rows": rows,
    }


def plot(summary: dict, path: Path) -> None:
    """TTFT per configuration, grouped by prefix length, with reused tokens on each bar."""
    from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

    lengths = sorted({row["prefix_length"] for row in summary["rows"]})
    width = 0.8 / len(CONFIGS)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for index, config in enumerate(CONFIGS):
        rows = {r["prefix_length"]: r for r in summary["rows"] if r["config"] == config}
        xs = [i + (index - (len(CONFIGS) - 1) / 2) * width for i in range(len(lengths))]
        bars = ax.bar(xs, [rows[n]["ttft_median_s"] for n in lengths], width, label=config)
        for bar, n in zip(bars, lengths, strict=True):
            reused = rows[n]["reused_tokens_per_request"]
            ax.annotate(f"{reused:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(lengths)), [f"{n} shared tokens" for n in lengths])
    ax.set_ylabel("median TTFT (s)")
    ax.set_title(f"vLLM: TTFT per configuration (labels: reused tokens); budget {summary['replay_budget']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(summary: dict) -> str:
    lines = [
        "# vllm-bench",
        "",
        f"Model `{summary['model']}`; {summary['requests']} requests per prefix, each with its own "
        f"{summary['suffix_tokens']}-token suffix; hybridkv replay budget {summary['replay_budget']}. "
        "TTFT medians; fidelity of the first token against `no-cache` (full prefill).",
        "",
        "![TTFT per configuration](ttft.png)",
        "",
        "| prefix | config | TTFT median s | speedup | reused tokens / request | top-1 agreement | KL mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        lines.append(
            f"| {row['prefix_length']} | {row['config']} | {row['ttft_median_s']:.3f} | {row['speedup']:.2f}x | "
            f"{row['reused_tokens_per_request']:.0f} | {row['top1_agreement']:.3f} | {row['kl_mean']:.2e} |"
        )
    return "\n".join(lines) + "\n"
