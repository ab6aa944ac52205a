"""Side by side at one long prefix: the exact-KV tail replay as two forward calls (the old path) vs one.

The old path, kept here only as the comparison: replay [s, n) on a cache holding KV [0, s), copy the
exact KV of [0, n) back (`set_attention`), then run the suffix. The new path is `execute`. Both are
timed alternately on the same hit, with the recompute variant beside them; medians over repeats.

.venv/bin/python benchmarks/one_pass_ab.py [--prefix-length 32768] [--budget 0.05] [--repeats 3]
"""

from __future__ import annotations

import statistics
import time

from common import cached_hit, parser

from hybridkv.cache import assemble_cache
from hybridkv.methods import Budget, execute, get_method
from hybridkv.models import load_model
from hybridkv.models.adapter import write_kv


def two_pass(model, prompt, hit, recipe):
    n, s = recipe.exact_kv_tokens, recipe.state_position
    cache = assemble_cache(model, hit.cached.kv_prefix(s), None)
    model.forward(prompt[s:n], cache, start=s)
    write_kv(cache, hit.cached.kv_prefix(n))
    return model.forward(prompt[n:], cache, start=n, logits_to_keep=1)


def main() -> None:
    options = parser(__doc__, prefix_length=32768)
    options.add_argument("--repeats", type=int, default=3)
    args = options.parse_args()
    model = load_model(args.model)
    prompt, hit = cached_hit(model, args.prefix_length, args.suffix)
    budget = Budget.parse(args.budget)
    exact = get_method("tail-replay").recipe(hit, budget)
    recompute = get_method("tail-replay-recompute").recipe(hit, budget)
    paths = {
        "two calls (old)": lambda: two_pass(model, prompt, hit, exact),
        "one call (new)": lambda: execute(model, prompt, hit, exact),
        "recompute variant": lambda: execute(model, prompt, hit, recompute),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for run in paths.values():  # warm-up
        run()
    for _ in range(args.repeats):
        for name, run in paths.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    tail = args.prefix_length - exact.state_position
    print(
        f"{args.prefix_length}-token prefix, {tail}-token tail, {args.suffix}-token suffix; medians of {args.repeats}:"
    )
    for name, values in times.items():
        print(
            f"  {name:18s} {statistics.median(values) * 1000:8.0f} ms  ({', '.join(f'{v * 1000:.0f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
