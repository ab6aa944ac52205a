"""Profile one tail-replay resume on the default model (cProfile, top functions by own time).

.venv/bin/python benchmarks/profile_replay.py [--prefix-length 4096] [--suffix 16] [--budget 0.05]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from hybridkv.cache import PrefixCache, capture_prompt
from hybridkv.eval.validate import make_workload
from hybridkv.methods import Budget, execute, get_method
from hybridkv.models import DEFAULT_MODEL, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prefix-length", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--budget", default="0.05")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=5, help="untimed-profiler runs for the median wall time")
    args = parser.parse_args()
    model = load_model(args.model)
    work = make_workload(model, args.prefix_length, args.suffix, seed=0)
    cache = PrefixCache()
    cache.add(capture_prompt(model, work.cached_prompt, None))
    hit = cache.lookup(work.prompt)
    for name in ("tail-replay", "tail-replay-recompute"):
        recipe = get_method(name).recipe(hit, Budget.parse(args.budget))
        execute(model, work.prompt, hit, recipe)  # warm-up
        walls = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            execute(model, work.prompt, hit, recipe)
            walls.append(time.perf_counter() - started)
        median = statistics.median(walls) * 1000
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        execute(model, work.prompt, hit, recipe)
        profile.disable()
        elapsed = time.perf_counter() - started
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        timing = f"median {median:.0f} ms over {args.repeats} runs; {elapsed * 1000:.0f} ms under cProfile"
        print(f"== {name}: {timing}\n{text.getvalue()}")


if __name__ == "__main__":
    main()
