"""Teacher-force prompt + answer through vLLM and transformers; compare logits per position.

    python results/vllm-nemotron-h-divergence/teacher_force.py            # all configs, then tables
    python results/vllm-nemotron-h-divergence/teacher_force.py --only vllm-bf16   # one config

Sequences: 8 of the arena's RULER niah 2K samples (common.DEFAULT_IDS), each its prompt (context +
question, byte tokens) followed by " <gold>.\\n". Every config runs one full prefill of each
sequence (vLLM: one prefill chunk, `enforce_eager`, no prefix caching, SSM state float32, as the
served arena; logits from the model's compute_logits on every position, cross-checked against
vLLM's own prompt logprobs). Configs (dt_min: the clamp on softplus(dt + dt_bias) in the scan):

    hf-fp32            transformers float32, as shipped (clamp at time_step_min = 1e-3)  <- reference
    hf-bf16            transformers bfloat16, as shipped
    hf-fp32-noclamp    transformers float32, clamp removed (dt_min 0)
    hf-bf16-noclamp    transformers bfloat16, clamp removed
    vllm-fp32          vLLM float32, as shipped (no clamp: mamba_mixer2 passes dt_limit=(0, inf))
    vllm-bf16          vLLM bfloat16, as shipped (the served arena's dtype)
    vllm-fp32-clamp    vLLM float32, clamp at 1e-3 in the prefill scan (common.set_vllm_dt_min)
    vllm-bf16-clamp    vLLM bfloat16, the same

Captures (logits of all 8; per-layer tensors of the first LAYER_SAMPLES) go to
/work/scratch45/captures/<config>.pt; the tables to teacher_force.md beside this file. Each vLLM
config runs in its own subprocess (one engine per process). ~6 minutes on one loaded core.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

CAPTURES = Path("/work/scratch45/captures")
LAYER_SAMPLES = ["niah_single_2-2048-0", "niah_single_1-2048-0"]
CONFIGS = ["hf-fp32", "hf-bf16", "hf-fp32-noclamp", "hf-bf16-noclamp", "vllm-fp32", "vllm-bf16", "vllm-fp32-clamp", "vllm-bf16-clamp"]  # fmt: skip


def run_config(name: str, ids_list: list[str]) -> None:
    samples = common.samples()
    result = {"logits": {}, "layers": {}, "prompt_len": {}, "ids": {}}
    if name.startswith("hf"):
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        model = common.hf_model(dtype, dt_min=0.0 if "noclamp" in name else None)
        store: dict = {}
        common.hf_hooks(model, store)
        for sid in ids_list:
            ids, plen = common.sequence(samples[sid])
            store.clear()
            result["logits"][sid] = common.hf_logits(model, ids)
            if sid in LAYER_SAMPLES:
                result["layers"][sid] = dict(store)
            result["prompt_len"][sid], result["ids"][sid] = plen, ids
    else:
        llm = common.vllm_engine("bfloat16" if "bf16" in name else "float32")
        common.set_vllm_dt_min("prefill" if name.endswith("clamp") else "none")
        common.vllm_hooks(llm)
        for sid in ids_list:
            ids, plen = common.sequence(samples[sid])
            cap = common.vllm_capture(llm, ids)
            logits = cap.pop("logits")
            top1 = cap.pop("prompt_top1")
            agree = (top1[:-1] == logits[:-1].argmax(-1)).float().mean().item()
            print(f"{name} {sid}: compute_logits argmax == vLLM prompt-logprob top-1 on {agree:.4f} of positions")
            result["logits"][sid] = logits
            if sid in LAYER_SAMPLES:
                result["layers"][sid] = cap
            result["prompt_len"][sid], result["ids"][sid] = plen, ids
    CAPTURES.mkdir(parents=True, exist_ok=True)
    torch.save(result, CAPTURES / f"{name}.pt")


def compare(names: list[str]) -> str:
    ref = torch.load(CAPTURES / "hf-fp32.pt")
    lines = ["# Teacher-forced logits: each config against transformers float32 (as shipped)", ""]
    lines += [
        "Per sequence (prompt + ' <gold>.\\n'), over all positions: mean and max over positions of "
        "max|Δlogit| over the vocabulary; mean |Δ| of the reference's top-1 logit; share of positions "
        "whose argmax differs; the first such position (p = prompt length; 'a+k' = k-th answer position; "
        "the last answer position predicts what follows '\\n': EOS ends the answer).", ""
    ]  # fmt: skip
    lines += ["| config | sample | mean max|Δ| | max max|Δ| | mean |Δtop1| | argmax differs | first differing position | after '\\n': ref → config (EOS logprob ref / config) |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    summary = {}
    for name in names:
        if name == "hf-fp32" or not (CAPTURES / f"{name}.pt").exists():
            continue
        other = torch.load(CAPTURES / f"{name}.pt")
        for sid, lr in ref["logits"].items():
            lo = other["logits"][sid]
            plen = ref["prompt_len"][sid]
            d = (lo - lr).abs()
            per = d.max(-1).values
            top = lr.argmax(-1)
            dtop = (lo.gather(-1, top[:, None]) - lr.gather(-1, top[:, None])).abs().squeeze(-1)
            differs = lo.argmax(-1) != top
            first = int(differs.nonzero()[0]) if differs.any() else None
            where = "—" if first is None else (f"{first}" if first < plen - 1 else f"a+{first - plen + 1}")
            last = len(lr) - 1
            lp_r = torch.log_softmax(lr[last], -1)[common.EOS].item()
            lp_o = torch.log_softmax(lo[last], -1)[common.EOS].item()
            end = f"{common.decode([int(lr[last].argmax())]) or '<eos>'!r} → {common.decode([int(lo[last].argmax())]) or '<eos>'!r} ({lp_r:.2f} / {lp_o:.2f})"
            lines.append(
                f"| {name} | {sid} | {per.mean():.2e} | {per.max():.2e} | {dtop.mean():.2e} | "
                f"{int(differs.sum())}/{len(lr)} | {where} | {end} |"
            )
            s = summary.setdefault(name, {"mean": [], "diff": 0, "n": 0, "end_changed": 0, "ends_eos": 0})
            s["mean"].append(per.mean().item())
            s["diff"] += int(differs.sum())
            s["n"] += len(lr)
            s["end_changed"] += int(lo[last].argmax() != lr[last].argmax())
            s["ends_eos"] += int(lo[last].argmax() == common.EOS)
    lines += ["", "## Summary over the 8 sequences", "",
              "| config | mean over sequences of mean max|Δlogit| | argmax differs (positions) | answer end (EOS after '\\n') | end differs from reference |",
              "|---|---|---|---|---|"]  # fmt: skip
    ref_eos = sum(int(lr[-1].argmax() == common.EOS) for lr in ref["logits"].values())
    lines.append(f"| hf-fp32 (reference) | 0 | 0 | {ref_eos}/{len(ref['logits'])} | — |")
    for name, s in summary.items():
        lines.append(
            f"| {name} | {sum(s['mean']) / len(s['mean']):.2e} | {s['diff']}/{s['n']} | "
            f"{s['ends_eos']}/{len(ref['logits'])} | {s['end_changed']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=CONFIGS)
    parser.add_argument("--compare-only", action="store_true")
    args = parser.parse_args()
    if args.only:
        run_config(args.only, common.DEFAULT_IDS)
        return
    if not args.compare_only:
        for name in CONFIGS:
            if name.startswith("hf"):
                run_config(name, common.DEFAULT_IDS)
            else:  # one engine per process
                subprocess.run([sys.executable, __file__, "--only", name], check=True)
    table = compare(CONFIGS)
    (common.OUT / "teacher_force.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
