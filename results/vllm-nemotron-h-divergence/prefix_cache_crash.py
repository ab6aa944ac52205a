"""vLLM's own prefix cache on tiny-nemotron-h (plain vLLM, no hybridkv): does it crash?

    python results/vllm-nemotron-h-divergence/prefix_cache_crash.py

The arena's `vllm-prefix-cache` server died with an IndexError in mamba_mixer2's conv_ssm_forward.
Here: vLLM bfloat16 in process, enable_prefix_caching=True (hybrid models: `align` mode), SSM state
float32, one prefill per prompt (max_num_batched_tokens = max_model_len), as the arena serves it.
A sample's context (1 token), then context + question (a prefix-cache hit), greedy. Prints the
outcome (answers, cached tokens, or the exception with its last frames) and writes
prefix_cache_crash.txt beside this file.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    lines = []
    pending = "engine start"
    samples = common.samples()
    try:
        llm = common.vllm_engine("bfloat16", enable_prefix_caching=True)
        for sid in ["niah_single_1-2048-0", "niah_single_2-2048-0"]:
            context, question = common.prompt_of(samples[sid])
            for name, ids, n in (("context", context, 1), ("context+question", context + question, 24)):
                pending = f"{sid} {name} ({len(ids)} prompt tokens)"
                out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                   SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=[common.EOS], detokenize=False),
                                   use_tqdm=False)[0]  # fmt: skip
                lines.append(f"{sid} {name}: {len(ids)} prompt tokens, {out.num_cached_tokens} from the prefix cache, "
                             f"answer {common.decode(out.outputs[0].token_ids)!r}")  # fmt: skip
                print(lines[-1], flush=True)
    except Exception as exc:  # noqa: BLE001
        frames = traceback.format_exception(exc)
        lines.append(f"CRASH during: {pending}\n" + "".join(frames[-12:]))
        print(lines[-1], flush=True)
    (common.OUT / "prefix_cache_crash.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
