"""What a shadow check costs on GLM-5.3-Flash, against the request it checks, from the cost model.

A check of a served answer is one forward of prompt + answer (the LM head at every answer position);
a zero-state resume's first-token check adds a prefill of [0, s) and [s, end) twice. The request
itself computed only [reused, end) and decoded its answer. Where every request looks alike, a
sample rate r spends r x check / request of the engine's compute on checks: the rate that keeps
that at 5% is 0.05 x request / check. FLOPs from `hybridkv.models.meta.cost_model` (the config's
modules on the meta device; no weights). Prints a markdown table.

.venv/bin/python benchmarks/shadow_cost.py [--answer-tokens 256]
"""

from __future__ import annotations

import argparse

from hybridkv.eval.plan import GLM_5_3_FLASH, load_config
from hybridkv.models.meta import cost_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer-tokens", type=int, default=256)
    args = parser.parse_args()
    costs, n = cost_model(load_config(GLM_5_3_FLASH)), args.answer_tokens
    heads = (n - 1) * costs.head_flops  # the LM head at every answer position past the first

    print("| prompt | reused | request TFLOPs | answer check / request | + first-token check | rate for 5% |")
    print("|---|---|---|---|---|---|")
    for prompt in (8192, 32768, 131072):
        for share in (0.0, 0.5, 0.9, 0.99):
            reused = int(prompt * share)
            request = costs.prefill_flops(reused, prompt) + costs.prefill_flops(prompt, prompt + n) + heads
            answer = costs.prefill_flops(0, prompt + n - 1) + heads
            first_token = costs.prefill_flops(0, reused) + 2 * costs.prefill_flops(reused, prompt) if reused else 0.0
            print(
                f"| {prompt} | {share:.0%} | {request / 1e12:.1f} | {answer / request:.2f} | "
                f"{(answer + first_token) / request:.2f} | {0.05 * request / answer:.4f} |"
            )


if __name__ == "__main__":
    main()
