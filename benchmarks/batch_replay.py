"""Batched vs one-by-one tail-replay resumes on the default model (medians over repeats).

B requests, each a different cached prompt of --prefix-length tokens hit in full by a new prompt
with a --suffix-token suffix, resumed by tail-replay at --budget: once as B `execute` calls, once
as one `execute_batch` call, alternating in each repeat.

.venv/bin/python benchmarks/batch_replay.py [--prefix-length 4096] [--batch 4] [--budget 0.05]
"""

from __future__ import annotations

import statistics
import time

import torch
from common import cached_hit, parser

from hybridkv.methods import Budget, execute, execute_batch, get_method
from hybridkv.models import load_model


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--batch", type=int, default=4)
    options.add_argument("--repeats", type=int, default=3)
    args = options.parse_args()
    model = load_model(args.model)
    method, budget = get_method("tail-replay"), Budget.parse(args.budget)
    requests = [cached_hit(model, args.prefix_length, args.suffix, seed) for seed in range(args.batch)]
    prompts, hits = [prompt for prompt, _ in requests], [hit for _, hit in requests]
    recipes = [method.recipe(hit, budget) for hit in hits]
    one_by_one, batched = [], []
    execute_batch(model, prompts, hits, recipes)  # warm-up
    for _ in range(args.repeats):
        started = time.perf_counter()
        singles = [execute(model, p, h, r).logits for p, h, r in zip(prompts, hits, recipes, strict=True)]
        one_by_one.append(time.perf_counter() - started)
        started = time.perf_counter()
        together = [o.logits for o in execute_batch(model, prompts, hits, recipes)]
        batched.append(time.perf_counter() - started)
    gap = max(float((a - b).abs().max()) for a, b in zip(singles, together, strict=True))
    alone, joint = statistics.median(one_by_one), statistics.median(batched)
    tail = args.prefix_length - recipes[0].state_position
    print(
        f"{args.batch} requests × ({tail}-token tail + {args.suffix}-token suffix) at {args.prefix_length}: "
        f"one by one {alone * 1000:.0f} ms, batched {joint * 1000:.0f} ms, ratio {alone / joint:.2f}x "
        f"(max logit difference {gap:.1e}; torch threads {torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
