"""Greedy answers with and without the dt clamp: does the clamp explain served ≠ harness?

    python results/vllm-nemotron-h-divergence/generate.py [--n 10] [--part hf|vllm|both]

For the first N samples of each task (niah_single_1 and _2, 2K; --n 30 is all 60):

part hf (transformers float32):
  full           one prefill of context + question, then greedy decoding
  zero@0.2       the arena's served tail-replay at budget 0.2, done in transformers: prefill the
                 context up to s = matched - replayed (the served run's own row), zero every
                 Mamba-2 conv and SSM state, prefill context[s:] + question (attention KV of the
                 prefix kept, the tail's recomputed), then greedy decoding
  each with transformers as shipped (dt clamped at 1e-3 in the chunked scan) and without the clamp.
part vllm (vLLM bfloat16, in process, no connector): full, with the clamp off (as shipped), in the
  prefill scan only ('prefill', as transformers), and in prefill + decode ('all').

An answer "runs on" when text follows its first newline (or no EOS comes within 24 tokens).
Prints and writes generate.md (and generate.jsonl, every answer) beside this file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

MAX_NEW = 24


def runs_on(text: str, ended: bool) -> bool:
    head, sep, tail = text.partition("\n")
    return bool(tail) or not ended


@torch.no_grad()
def hf_greedy(model, prompt: list[int], zero_at: int | None = None) -> tuple[list[int], bool]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = 0
    if zero_at is not None:
        model(torch.tensor([prompt[:zero_at]]), past_key_values=cache, use_cache=True)
        zeroed = 0
        for layer in cache.layers:
            if getattr(layer, "recurrent_states", {}).get(0) is not None:
                layer.conv_states[0].zero_()
                layer.recurrent_states[0].zero_()
                zeroed += 1
        assert zeroed == 3, zeroed  # the three Mamba-2 layers
        start = zero_at
    out = model(torch.tensor([prompt[start:]]), past_key_values=cache, use_cache=True)
    tokens = []
    for _ in range(MAX_NEW):
        nxt = int(out.logits[0, -1].argmax())
        if nxt == common.EOS:
            return tokens, True
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
    return tokens, False


def pick(n: int) -> list[str]:
    return [f"niah_single_{t}-2048-{i}" for t in (1, 2) for i in range(n)]


def part_hf(ids: list[str], rows: list[dict]) -> None:
    samples, served = common.samples(), common.arena_rows()
    for clamp in ("shipped", "noclamp"):
        model = common.hf_model(torch.float32, dt_min=0.0 if clamp == "noclamp" else None)
        for sid in ids:
            context, question = common.prompt_of(samples[sid])
            row = served[(sid, "tail-replay", 0.2)]
            s = row["matched_tokens"] - row["replayed_tokens"]
            for method, zero_at in (("full", None), ("zero@0.2", s)):
                tokens, ended = hf_greedy(model, context + question, zero_at)
                text = common.decode(tokens)
                rows.append({"engine": "hf-fp32", "dt": clamp, "method": method, "id": sid, "text": text,
                             "ended": ended, "runs_on": runs_on(text, ended)})  # fmt: skip
                print(rows[-1], flush=True)


def part_vllm(ids: list[str], rows: list[dict]) -> None:
    samples = common.samples()
    llm = common.vllm_engine("bfloat16")
    for mode in ("none", "prefill", "all"):
        common.set_vllm_dt_min(mode)
        for sid in ids:
            context, question = common.prompt_of(samples[sid])
            tokens = common.vllm_greedy(llm, context + question, MAX_NEW)
            ended = len(tokens) < MAX_NEW
            text = common.decode(tokens)
            rows.append({"engine": "vllm-bf16", "dt": {"none": "shipped"}.get(mode, f"clamp-{mode}"), "method": "full",
                         "id": sid, "text": text, "ended": ended, "runs_on": runs_on(text, ended)})  # fmt: skip
            print(rows[-1], flush=True)


def table(rows: list[dict], ids: list[str]) -> str:
    served, harness = common.arena_rows(), common.arena_rows("harness")

    def arena_runs_on(book, method, budget):
        return sum(runs_on(book[(sid, method, budget)]["prediction"], True) for sid in ids)

    lines = [f"# Greedy answers that run on past the answer ({len(ids)} samples: {ids[0]} … {ids[-1]})", ""]
    lines += ["| engine | dt clamp | method | runs on | answer differs from hf-fp32 shipped (same method) | same answer as arena served (same method; first 24 tokens) |",
              "|---|---|---|---|---|---|"]
    ref = {(r["method"], r["id"]): r["text"] for r in rows if r["engine"] == "hf-fp32" and r["dt"] == "shipped"}
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["engine"], r["dt"], r["method"]), []).append(r)
    for (engine, dt, method), rs in groups.items():
        differs = sum(r["text"] != ref.get((method, r["id"]), r["text"]) for r in rs) if ref else "—"
        key = {"full": ("full", None), "zero@0.2": ("tail-replay", 0.2)}[method]
        same = sum(
            (served[(r["id"], *key)]["prediction"] == r["text"]) if r["ended"]
            else served[(r["id"], *key)]["prediction"].startswith(r["text"])
            for r in rs
        )  # fmt: skip
        lines.append(f"| {engine} | {dt} | {method} | {sum(r['runs_on'] for r in rs)}/{len(rs)} | {differs} | {same}/{len(rs)} |")
    lines += [
        f"| arena served (vLLM bf16) | shipped | full | {arena_runs_on(served, 'full', None)}/{len(ids)} | | |",
        f"| arena served (vLLM bf16 + connector) | shipped | tail-replay@0.2 | {arena_runs_on(served, 'tail-replay', 0.2)}/{len(ids)} | | |",
        f"| arena harness (hf fp32) | shipped | full | {arena_runs_on(harness, 'full', None)}/{len(ids)} | | |",
        f"| arena harness (hf fp32) | shipped | tail-replay@0.2 | {arena_runs_on(harness, 'tail-replay', 0.2)}/{len(ids)} | | |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10, help="samples per task (30 = all)")
    parser.add_argument("--part", choices=["hf", "vllm", "both"], default="both")
    args = parser.parse_args()
    ids = pick(args.n)
    out = common.OUT / "generate.jsonl"
    rows = [json.loads(x) for x in open(out)] if out.exists() else []
    rows = [r for r in rows if not (args.part in ("hf", "both") and r["engine"].startswith("hf"))
            and not (args.part in ("vllm", "both") and r["engine"].startswith("vllm"))]  # fmt: skip
    if args.part in ("hf", "both"):
        part_hf(ids, rows)
    if args.part in ("vllm", "both"):
        part_vllm(ids, rows)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = sorted({r["id"] for r in rows}, key=lambda s: (s.split("-")[0], int(s.split("-")[-1])))
    text = table(rows, ids)
    (common.OUT / "generate.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
