"""Profile one tail-replay resume on the default model (cProfile, top functions by own time).

.venv/bin/python benchmarks/profile_replay.py [--prefix-length 4096] [--suffix 16] [--budget 0.05]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

from common import cached_hit, parser

from hybridkv.methods import Budget, execute, get_method
from hybridkv.models import load_model


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--top", type=int, default=14)
    options.add_argument("--repeats", type=int, default=5, help="untimed-profiler runs for the median wall time")
    args = options.parse_args()
    model = load_model(args.model)
    prompt, hit = cached_hit(model, args.prefix_length, args.suffix)
    for name in ("tail-replay", "tail-replay-recompute"):
        recipe = get_method(name).recipe(hit, Budget.parse(args.budget))
        execute(model, prompt, hit, recipe)  # warm-up
        walls = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            execute(model, prompt, hit, recipe)
            walls.append(time.perf_counter() - started)
        median = statistics.median(walls) * 1000
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        execute(model, prompt, hit, recipe)
        profile.disable()
        elapsed = time.perf_counter() - started
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        timing = f"median {median:.0f} ms over {args.repeats} runs; {elapsed * 1000:.0f} ms under cProfile"
        print(f"== {name}: {timing}\n{text.getvalue()}")


if __name__ == "__main__":
    main()
