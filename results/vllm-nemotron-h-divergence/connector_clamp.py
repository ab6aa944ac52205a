"""Served zero-state resume (hybridkv's connector, tail-replay) with and without the dt clamp.

    python results/vllm-nemotron-h-divergence/connector_clamp.py [--n 10] [--budget 0.2]

vLLM bfloat16 in this process (as the served arena: enforce_eager, no prefix caching, SSM state
float32, one prefill per prompt), HybridKVConnector (hybridkv/integrations/vllm/connector.py,
unchanged) with `save_states` false, a fresh file store in /work/scratch45. For each sample, as the
served arena does: the context alone (1 token), then context + question (a hit: the tail of the
context replayed from zeroed Mamba-2 states), greedy, up to 24 tokens. The same engine answers
every sample twice: with vLLM as shipped and with the dt clamp of transformers (1e-3) in its
prefill scan (common.set_vllm_dt_min("prefill")), each in its own namespace (cache_salt).
Writes connector_clamp.md beside this file.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

STORE = Path("/work/scratch45/connector-store")
MAX_NEW = 24


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10, help="samples per task")
    parser.add_argument("--budget", default="0.2")
    args = parser.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    shutil.rmtree(STORE, ignore_errors=True)
    transfer = {
        "kv_connector": "HybridKVConnector",
        "kv_connector_module_path": "hybridkv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": f"file://{STORE}", "replay_budget": args.budget,
                                      "cache_salt": "div45", "save_states": False},
    }  # fmt: skip
    llm = common.vllm_engine("bfloat16", kv_transfer_config=transfer)
    samples, served = common.samples(), common.arena_rows()
    ids = [f"niah_single_{t}-2048-{i}" for t in (1, 2) for i in range(args.n)]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[common.EOS], detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    run = uuid.uuid4().hex[:8]
    rows = []
    for mode in ("none", "prefill"):
        common.set_vllm_dt_min(mode)
        for sid in ids:
            context, question = common.prompt_of(samples[sid])
            salt = f"{run}-{mode}-{sid}"
            llm.generate([TokensPrompt(prompt_token_ids=context, cache_salt=salt)], one, use_tqdm=False)
            out = llm.generate([TokensPrompt(prompt_token_ids=context + question, cache_salt=salt)], greedy, use_tqdm=False)[0]
            tokens = [t for t in out.outputs[0].token_ids if t != common.EOS]
            ended = len(tokens) < MAX_NEW
            text = common.decode(tokens)
            hkv = (out.kv_transfer_params or {}).get("hybridkv") if hasattr(out, "kv_transfer_params") else None
            ref = served[(sid, "tail-replay", float(args.budget))]["prediction"]
            rows.append((mode, sid, text, ended, bool(text.partition("\n")[2]) or not ended,
                         ref == text if ended else ref.startswith(text), out.num_cached_tokens, hkv))  # fmt: skip
            print(rows[-1], flush=True)
    lines = [f"# Served zero-state resume (tail-replay@{args.budget}, hybridkv connector, vLLM bf16 in process), {len(ids)} samples", "",
             "| vLLM dt clamp | answers run on | same answer as the arena's served tail-replay (first 24 tokens) |", "|---|---|---|"]  # fmt: skip
    for mode in ("none", "prefill"):
        rs = [r for r in rows if r[0] == mode]
        label = {"none": "none (as shipped)", "prefill": "1e-3 in the prefill scan (as transformers)"}[mode]
        lines.append(f"| {label} | {sum(r[4] for r in rs)}/{len(rs)} | {sum(r[5] for r in rs)}/{len(rs)} |")
    lines += ["", "| clamp | sample | answer | connector's kv_transfer_params |", "|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]!r} | {r[7]} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (common.OUT / f"connector_clamp.md").write_text(text)
    print(text)
    shutil.rmtree(STORE, ignore_errors=True)


if __name__ == "__main__":
    main()
