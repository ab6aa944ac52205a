"""The `hybridkv` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.workloads import WORKLOADS
from hybridkv.models.tiny import BUILTIN_MODELS, DEFAULT_MODEL


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    from hybridkv.methods import METHODS

    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Token-level prefix KV-cache reuse for hybrid LLMs, measured against full prefill.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser(
        "validate",
        help="measure every recovery method against full prefill on a prefix-hit workload",
        description=(
            "A cached prompt and a new prompt share exactly their first L tokens, then diverge. The new "
            "prompt hits the cache at L and each method resumes from there; its next-token distributions over "
            "the suffix are compared with full prefill of the same prompt (KL, top-1, greedy agreement), and its "
            "time to first token is measured beside full prefill's in the same run. Prints a table and writes "
            "OUT/results.json and OUT/report.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    validate.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"built-in model ({', '.join(BUILTIN_MODELS)}) or a checkpoint directory"
    )
    _add_device_options(validate)
    validate.add_argument("--prefix-lengths", type=_int_list, default="1000,2048", help="matched prefix lengths L")
    validate.add_argument(
        "--suffix-length", type=int, default=64, help="new tokens after the match (fidelity positions)"
    )
    validate.add_argument(
        "--budgets", default="0.05,0.1", help="replay budgets: fractions of L in [0, 1], or token counts like 256tok"
    )
    validate.add_argument("--methods", default=",".join(METHODS), help=f"comma list of methods: {', '.join(METHODS)}")
    validate.add_argument(
        "--checkpoint-interval", type=int, default=384, help="store linear-state checkpoints every B tokens (0: none)"
    )
    validate.add_argument("--seed", type=int, default=0, help="seed for the tiny model's weights and the prompts")
    validate.add_argument("--repeats", type=int, default=3, help="timing repeats (TTFT is the median)")
    validate.add_argument("--greedy-tokens", type=int, default=16, help="G, tokens of greedy continuation compared")
    validate.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    validate.add_argument(
        "--store",
        default=None,
        help="put the cached prompt through this store and serve the hit from it: memory://, file:///DIR, "
        "redis://HOST:PORT, valkey://HOST:PORT, lmcache://… (default: keep it in this process)",
    )
    validate.add_argument("--cache-salt", default="", help="tenant salt: prompts of one salt never hit another's")
    validate.add_argument("--out", type=Path, default=Path("out/validate"), help="output directory")
    validate.add_argument("--no-progress", action="store_true", help="no progress bar")

    store = commands.add_parser("store", help="inspect, empty or benchmark a store")
    actions = store.add_subparsers(dest="action", required=True)
    for action, text in (("stats", "entry count and bytes held"), ("clear", "remove every hybridkv entry")):
        sub = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + " of a store.")
        sub.add_argument("--store", required=True, help="store URL, as for validate --store")
    bench = actions.add_parser(
        "bench",
        help="put/get latency and throughput per store backend, for GLM-5.3-Flash-sized entries",
        description=(
            "Times puts and gets of GLM-5.3-Flash-sized entries (a 256-token KV chunk of its 11 attention "
            "layers, one KDA layer's state, one whole 34-layer state checkpoint) on each store, one request at "
            "a time, beside the hybridkv codec's own cost and, for redis/valkey, redis-benchmark on the same "
            "server. Writes OUT/store_bench.json."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument("--store", action="append", required=True, help="store URL; repeat for several backends")
    bench.add_argument("--repeats", type=int, default=20, help="operations per entry size (the checkpoint: 1/5)")
    bench.add_argument("--out", type=Path, default=Path("out/store-bench"), help="output directory")

    arena = commands.add_parser("arena", help="task-level validation: run, score and report methods on workloads")
    arena_commands = arena.add_subparsers(dest="action", required=True)
    run = arena_commands.add_parser(
        "run",
        help="answer every sample with every method; writes OUT/results.jsonl and OUT/summary.json",
        description=(
            "Generates (or reloads) the workload's samples, freezes them to OUT/samples.jsonl with a checksum, "
            "and answers each one with each method through the setup/build_cache/answer contract. Rows are "
            "appended as they are scored, so a killed run resumes without duplicating rows."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument(
        "--workload",
        default="ruler",
        choices=WORKLOADS,
        help="ruler (generated), longbench (needs --data), prefix (shared documents, diverging questions), "
        "multi-turn (each turn extends the last), rag (retrieved passages, each cached alone), "
        "agent-reports (sub-agents' reports, each cached alone; the answer needs two), "
        "kvsharearena (KVShareArena's frozen querysets, one cache per declared chunk; needs --data)",
    )
    run.add_argument("--tasks", default=None, help="comma list of tasks (default: every task the workload can make)")
    run.add_argument("--lengths", type=_int_list, default="4096", help="target prompt lengths in tokens")
    run.add_argument("--samples", type=int, default=20, help="samples per task and length")
    run.add_argument(
        "--methods",
        default="no-context,full,zero-state,checkpoint,tail-replay",
        help="methods (no-context is the PGR floor, full the oracle; entry-point methods work too); "
        "NAME@BUDGET runs a budgeted method at that budget only, e.g. tail-replay-recompute@0.05; "
        "ATTENTION+LINEAR runs a position-independent pair over separately encoded chunks, e.g. epic+linearkv "
        "(attention: naive, position-corrected, epic, cacheblend, prophet; "
        "linear: zero, linearkv, linearkv-relevant, compose)",
    )
    run.add_argument("--budgets", default="0.05,0.1", help="budgets for methods that take one")
    run.add_argument("--model", default=DEFAULT_MODEL, help="built-in model or checkpoint directory")
    _add_device_options(run)
    run.add_argument(
        "--data",
        default=None,
        help="local data: SQuAD/HotpotQA json for RULER's qa tasks; LongBench's data folder; "
        "KVShareArena's data/queryset folder",
    )
    run.add_argument("--max-new-tokens", type=int, default=None, help="cap on generated tokens (default: per task)")
    run.add_argument("--checkpoint-interval", type=int, default=384, help="state checkpoints for checkpoint methods")
    run.add_argument(
        "--cache-model",
        default=None,
        help="cross-checkpoint reuse: caches are built by this checkpoint (built-in name or directory) of the same "
        "architecture and size as --model, which answers (default: --model builds them)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", type=Path, default=Path("out/arena"), help="output directory (resumed if it exists)")
    run.add_argument("--no-progress", action="store_true")
    score = arena_commands.add_parser("score", help="rebuild OUT/summary.json from OUT/results.jsonl")
    score.add_argument("out", type=Path)
    report = arena_commands.add_parser("report", help="write OUT/report.md and OUT/report.html with plots")
    report.add_argument("out", type=Path)
    export = arena_commands.add_parser(
        "export",
        help="write OUT's answers in another benchmark's format: kva (KVShareArena's kva.result.v1, one file per "
        "method, and the run's anchors); for --workload kvsharearena runs",
    )
    export.add_argument("out", type=Path)
    export.add_argument("--format", required=True, choices=["kva"], help="kva: KVShareArena's kva.result.v1")
    export.add_argument("--to", type=Path, default=None, help="output directory (default: OUT/kva)")
    export.add_argument("--model", default=None, help="the model name to report (default: OUT/run.json's)")
    ttft = commands.add_parser(
        "ttft",
        help="TTFT speedups at long matched prefixes beside the cost-model bound",
        description=(
            "Times full prefill, tail-replay (both variants), adaptive-replay (tail under a 1% decay bound, capped "
            "by the budget), checkpoint and seeded-replay at long matched prefixes with a short suffix, each method "
            "beside full prefill in the same process (medians over repeats), and prints the measured speedup beside "
            "the FLOP bound and the decay bound. Writes OUT/summary.json and OUT/ttft.png."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ttft.add_argument("--model", default=DEFAULT_MODEL, help="built-in model or checkpoint directory")
    _add_device_options(ttft)
    ttft.add_argument("--prefix-lengths", type=_int_list, default="8192,16384,32768", help="matched prefix lengths")
    ttft.add_argument("--budgets", default="0.02,0.05,0.1", help="tail budgets (fractions or e.g. 256tok)")
    ttft.add_argument("--suffix-length", type=int, default=16, help="new tokens after the matched prefix")
    ttft.add_argument("--checkpoint-interval", type=int, default=1024, help="state checkpoints every B tokens")
    ttft.add_argument("--repeats", type=int, default=3, help="timing repeats (medians)")
    ttft.add_argument("--seed", type=int, default=0)
    ttft.add_argument("--out", type=Path, default=Path("out/ttft"), help="output directory")
    ttft.add_argument("--no-progress", action="store_true")

    calibrate = commands.add_parser(
        "calibrate",
        help="measure how far back a model's linear layers remember (for the vLLM connector's replay)",
        description=(
            "Runs the model on sample prompts (essay text through its tokenizer, or random token ids for a model "
            "without one), records each linear layer's gates, and finds the replay tail after which a zeroed state "
            "contributes less than the tolerance (the bound adaptive-replay uses), at the quantile over positions. "
            "Writes the result beside a checkpoint directory (hybridkv-calibration.json), where the vLLM connector "
            'reads it with "replay_horizon": "calibrated"; for a built-in model, to --out.'
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    calibrate.add_argument("--model", default=DEFAULT_MODEL, help="built-in model or checkpoint directory")
    _add_device_options(calibrate)
    calibrate.add_argument("--tokens", type=int, default=4096, help="tokens per sample prompt")
    calibrate.add_argument("--samples", type=int, default=4, help="sample prompts")
    calibrate.add_argument("--tolerance", type=float, default=0.01, help="bound on a zeroed state's surviving share")
    calibrate.add_argument("--quantile", type=float, default=0.95, help="of the shortest tails over positions")
    calibrate.add_argument("--seed", type=int, default=0, help="which sample prompts (and a random model's weights)")
    calibrate.add_argument("--out", type=Path, default=None, help="output file (default: beside a checkpoint)")

    plan = commands.add_parser(
        "plan",
        help="cache memory and predicted TTFT speedups per caching scheme, from a model's config alone",
        description=(
            "From a config alone (no weights): attention KV bytes per token, linear-state bytes per checkpoint, "
            "the cache memory of checkpoint-every-B schemes vs tail-replay for a workload, and the speedup over "
            "full prefill that the FLOP cost model predicts for each method (an upper bound)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plan.add_argument(
        "--model", default="glm-5.3-flash", help="glm-5.3-flash, a built-in tiny model, or a checkpoint dir"
    )
    plan.add_argument("--prefix-lengths", type=_int_list, default="8192,16384,32768", help="matched prefix lengths")
    plan.add_argument("--suffix-tokens", type=int, default=64, help="new tokens after the matched prefix")
    plan.add_argument("--budgets", default="0.02,0.05,0.1", help="tail-replay budgets (fractions or e.g. 256tok)")
    plan.add_argument("--intervals", type=_int_list, default="1024,3584", help="checkpoint intervals B to compare")
    plan.add_argument("--rate", type=float, default=1.0, help="new distinct prefixes per second")
    plan.add_argument("--retention", type=float, default=600.0, help="seconds each prefix is kept")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")

    bench_vllm = commands.add_parser(
        "vllm-bench",
        help="TTFT and reuse through vllm serve: no cache vs vLLM's prefix cache vs HybridKVConnector",
        description=(
            "Starts one `vllm serve` process (vLLM's OpenAI server) per configuration - no prefix caching, vLLM's own "
            "hybrid prefix cache (align mode), vLLM with HybridKVConnector at each budget - and sends each the same "
            "workloads over HTTP from 1, 4 and 16 concurrent clients: shared system prompts with user turns of varied "
            "length, multi-turn conversations, a RAG-like mix with 30%% misses, and prefixes on vLLM's block grid. "
            "Writes OUT/summary.json (one row per workload, config, clients and budget), OUT/report.md and a TTFT plot "
            "per workload. Needs the vllm extra (pip install 'hybridkv[vllm]')."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench_vllm.add_argument(
        "--model",
        default="grid-2048",
        help="checkpoint directory vLLM can serve, or a seeded random-weight bench model written to OUT/<name>: "
        "grid-2048 (vLLM derives a 2,176-token block for it, a production-shaped grid) or grid-640 (a fine grid)",
    )
    bench_vllm.add_argument(
        "--workloads", default="shared-system,multi-turn,rag-mix,grid-aligned", help="comma list of server workloads"
    )
    bench_vllm.add_argument("--clients", type=_int_list, default="1,4,16", help="concurrent client counts")
    bench_vllm.add_argument(
        "--budgets", default="0.05,adaptive",
        help="hybridkv replay budgets: fractions, token counts (256tok), or adaptive (the horizon `hybridkv calibrate` "
        "measures on the model, written beside it on first use)",
    )  # fmt: skip
    bench_vllm.add_argument("--requests", type=int, default=24, help="requests per workload and client count")
    bench_vllm.add_argument(
        "--engines", type=int, default=1,
        help="vllm serve processes per configuration, on one store; each conversation moves to another at every turn",
    )  # fmt: skip
    bench_vllm.add_argument("--min-prefix", type=int, default=1024, help="shortest shared prefix (tokens)")
    bench_vllm.add_argument("--max-prefix", type=int, default=16384, help="longest shared prefix (tokens)")
    bench_vllm.add_argument("--store", default=None, help="hybridkv store URL (default: a file store in OUT/store)")
    bench_vllm.add_argument("--out", type=Path, default=Path("out/vllm-bench"), help="output directory")
    bench_vllm.add_argument("--no-progress", action="store_true")

    train = commands.add_parser(
        "train",
        help="train a built-in tiny hybrid on the offline task mix (resumable)",
        description=(
            "Trains a built-in model's transformers class on long-context tasks in the arena's formats (needle "
            "retrieval, variable tracking, passage QA) written by hybridkv's own generators over text every "
            "Python install ships (its reference topics and standard-library sources), from short to long "
            "examples. RUN_DIR gets checkpoint/ (weights, optimiser, data position, RNG), log.jsonl and loss.png; "
            "running the same command again resumes from the last checkpoint. Keep RUN_DIR outside the "
            "repository; `hybridkv train --export` copies the trained weights where the package loads them."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from hybridkv.train.loop import DEFAULT_SCHEDULE, TrainConfig

    defaults = TrainConfig(model="tiny-glm5-next", run_dir=Path("."))
    train.add_argument("run_dir", type=Path, help="run directory (created; resumed when it holds a checkpoint)")
    train.add_argument("--model", default="tiny-glm5-next", help="model shape to train (hybridkv/train/shapes.py)")
    train.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the data stream")
    train.add_argument(
        "--schedule",
        default=",".join(f"{length}:{steps}" for length, steps in DEFAULT_SCHEDULE),
        help="curriculum: LENGTH:STEPS pairs, example length in tokens and optimiser steps at it",
    )
    train.add_argument("--tokens-per-step", type=int, default=defaults.tokens_per_step, help="tokens per batch")
    train.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (cosine decay)")
    train.add_argument("--eval-every", type=int, default=defaults.eval_every, help="held-out evaluation interval")
    train.add_argument("--save-every", type=int, default=defaults.save_every, help="checkpoint interval (steps)")
    train.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    train.add_argument("--stop-at", type=int, default=None, help="end this stretch at this step (resume later)")
    train.add_argument(
        "--tasks",
        default="",
        help="comma list of training tasks, NAME or NAME:WEIGHT (a bare name keeps its default weight; "
        "documents, the rag/agent-reports shape, is drawn only when named with a weight; empty: the whole mix)",
    )
    train.add_argument(
        "--init", type=Path, default=None,
        help="start a fresh run from these weights (a model directory, e.g. hybridkv/models/weights/tiny-glm5-next)",
    )  # fmt: skip
    train.add_argument(
        "--shape", default="",
        help="JSON object of config fields replacing the model shape's own, e.g. "
        "'{\"num_attention_heads\": 8, \"kv_lora_rank\": 128}' (the exported config.json keeps them)",
    )  # fmt: skip
    train.add_argument(
        "--export", action="store_true",
        help="do not train: copy RUN_DIR's checkpoint weights into the package as the built-in MODEL",
    )  # fmt: skip
    return parser


def _shape(text: str) -> dict:
    import json

    try:
        shape = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise HybridKVError(f"--shape is not JSON ({e.msg}): {text!r}") from None
    if not isinstance(shape, dict):
        raise HybridKVError(f"--shape must be a JSON object of config fields, not {text!r}")
    return shape


def _train(args: argparse.Namespace) -> None:
    from hybridkv.train.loop import TrainConfig, export, parse_schedule, train

    if args.export:
        print(f"wrote {export(args.run_dir, args.model)}")
        return
    config = TrainConfig(
        model=args.model, run_dir=args.run_dir, seed=args.seed, schedule=parse_schedule(args.schedule),
        tokens_per_step=args.tokens_per_step, lr=args.lr, eval_every=args.eval_every, save_every=args.save_every,
        threads=args.threads, stop_at=args.stop_at, tasks=tuple(t for t in args.tasks.split(",") if t),
        init=args.init, shape=_shape(args.shape),
    )  # fmt: skip
    checkpoint = train(config)
    print(f"checkpoint: {checkpoint}\nlog: {args.run_dir / 'log.jsonl'}\nplot: {args.run_dir / 'loss.png'}")


def _calibrate(args: argparse.Namespace) -> None:
    import json

    from hybridkv.eval.calibrate import calibrate
    from hybridkv.models.calibration import CALIBRATION_FILE

    out = args.out
    if out is None:
        if not Path(args.model).is_dir():
            raise HybridKVError(f"--model {args.model} is not a checkpoint directory: give --out for its calibration")
        out = Path(args.model) / CALIBRATION_FILE
    if args.tokens < 256 or args.samples < 1:
        raise HybridKVError("--tokens must be at least 256 and --samples at least 1")
    result = calibrate(_load(args), args.tokens, args.samples, args.tolerance, args.quantile, args.seed)
    print(json.dumps({"horizon": result.horizon, "layers": result.layers, "text": result.text}))
    print(f"wrote {result.write(out)}")


def _ttft(args: argparse.Namespace) -> None:
    from hybridkv.eval.ttft import TTFT_METHODS, run_ttft, table
    from hybridkv.eval.validate import ValidateConfig
    from hybridkv.methods import Budget

    config = ValidateConfig(
        model=args.model,
        prefix_lengths=args.prefix_lengths,
        suffix_length=args.suffix_length,
        budgets=[Budget.parse(part) for part in args.budgets.split(",") if part.strip()],
        methods=TTFT_METHODS,
        checkpoint_interval=args.checkpoint_interval,
        seed=args.seed,
        repeats=args.repeats,
        greedy_tokens=1,
    )
    config.check()
    summary = run_ttft(_load(args), config, args.out, show_progress=not args.no_progress)
    print(table(summary["rows"]))
    print(f"\nwrote {args.out / 'summary.json'} and {args.out / 'ttft.png'}")


def _plan(args: argparse.Namespace) -> None:
    import json

    from hybridkv.eval.plan import Workload, make_plan, plan_table
    from hybridkv.methods import Budget

    budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
    for budget in budgets:
        Budget.parse(budget)
    if min(args.prefix_lengths) < 1 or args.suffix_tokens < 1 or min(args.intervals) < 1:
        raise HybridKVError("prefix lengths, suffix tokens and intervals must be positive")
    if args.rate < 0 or args.retention < 0:
        raise HybridKVError("--rate and --retention must not be negative")
    workload = Workload(tuple(args.prefix_lengths), args.suffix_tokens, args.rate, args.retention, budgets,
                        tuple(args.intervals))  # fmt: skip
    plan = make_plan(args.model, workload)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan_table(plan, workload))


def _vllm_bench(args: argparse.Namespace) -> None:
    from hybridkv.methods import Budget

    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    for budget in budgets:
        if budget != "adaptive":
            Budget.parse(budget)  # a bad budget fails before any server starts
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if (
        args.requests < 1
        or args.engines < 1
        or not args.clients
        or min(args.clients) < 1
        or not budgets
        or not workloads
    ):
        raise HybridKVError(
            "--requests, --engines and every --clients value must be positive; give a budget and a workload"
        )
    if not 64 <= args.min_prefix <= args.max_prefix:
        raise HybridKVError(f"--min-prefix {args.min_prefix} / --max-prefix {args.max_prefix}: need 64 <= min <= max")
    try:
        from hybridkv.integrations.vllm.bench import BenchPlan, run_bench
        from hybridkv.integrations.vllm.models import BENCH_MODELS, write_servable
        from hybridkv.integrations.vllm.workloads import SERVER_WORKLOADS, Shape
    except ImportError as err:
        raise HybridKVError(f"vllm-bench needs vLLM: pip install 'hybridkv[vllm]' ({err})") from err
    if unknown := [w for w in workloads if w not in SERVER_WORKLOADS]:
        raise HybridKVError(f"--workloads: unknown {', '.join(unknown)} (known: {', '.join(SERVER_WORKLOADS)})")
    model = args.model
    if model in BENCH_MODELS:
        model = str(write_servable(args.out / model, model))
    elif not Path(model).is_dir():
        raise HybridKVError(f"--model {model!r}: not a checkpoint directory (or one of {', '.join(BENCH_MODELS)})")
    shape = Shape(args.min_prefix, args.max_prefix, args.requests)
    plan = BenchPlan(model, workloads, args.clients, budgets, shape, args.store, engines=args.engines)
    run_bench(plan, args.out, show_progress=not args.no_progress)
    print((args.out / "report.md").read_text())


def _validate(args: argparse.Namespace) -> None:
    import torch

    from hybridkv.eval.validate import ValidateConfig, run_validate
    from hybridkv.methods import Budget
    from hybridkv.report.validate_report import format_table, write_outputs

    if args.threads:
        torch.set_num_threads(args.threads)
    config = ValidateConfig(
        model=args.model,
        prefix_lengths=args.prefix_lengths,
        suffix_length=args.suffix_length,
        budgets=[Budget.parse(part) for part in args.budgets.split(",") if part.strip()],
        methods=[part.strip() for part in args.methods.split(",") if part.strip()],
        checkpoint_interval=args.checkpoint_interval or None,
        seed=args.seed,
        repeats=args.repeats,
        greedy_tokens=args.greedy_tokens,
        store=args.store,
        cache_salt=args.cache_salt,
    )
    config.check()
    model = _load(args)
    results = run_validate(model, config, show_progress=not args.no_progress)
    print(format_table(results["rows"]))
    if results["store"] is not None:
        events = ", ".join(f"{k} {v}" for k, v in sorted(results["store"]["events"].items())) or "none"
        print(f"\nstore {results['store']['url']}: {events}")
    json_path, md_path = write_outputs(results, args.out)
    print(f"\nwrote {json_path} and {md_path}")


def _store(args: argparse.Namespace) -> None:
    import json

    from hybridkv.store import open_store

    store = open_store(args.store)
    try:
        if args.action == "stats":
            print(json.dumps({"url": args.store, **store.stats()}, indent=2))
        else:
            print(f"removed {store.clear()} entries from {args.store}")
    finally:
        store.close()


def _store_bench(args: argparse.Namespace) -> None:
    import json

    from tqdm import tqdm

    from hybridkv.eval.store_bench import format_bench_table, glm5_entry_sizes, run_store_bench

    if args.repeats < 1:
        raise HybridKVError("repeats must be at least 1")
    sizes = glm5_entry_sizes(args.repeats)
    with tqdm(total=len(sizes) * (1 + len(args.store)), desc="store-bench", leave=False) as progress:
        rows = run_store_bench(args.store, sizes, progress)
    print(format_bench_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_bench.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out / 'store_bench.json'}")


def _arena(args: argparse.Namespace) -> None:
    import json

    from hybridkv.eval.arena import read_rows
    from hybridkv.eval.summary import rescore, summarise
    from hybridkv.eval.workloads import score_row

    def write_summary() -> Path:
        results = args.out / "results.jsonl"
        if not results.exists():
            raise HybridKVError(f"{results}: no results to score")
        summary = summarise(rescore(read_rows(results), score_row))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.out / 'summary.json'} ({len(summary['rows'])} rows)")
        return results

    if args.action == "report":
        from hybridkv.report.arena_report import write_arena_report

        if not (args.out / "summary.json").exists():
            raise HybridKVError(f"{args.out / 'summary.json'}: missing; run `hybridkv arena score {args.out}` first")
        md_path, html_path = write_arena_report(args.out)
        print(f"wrote {md_path} and {html_path}")
        return
    if args.action == "score":
        write_summary()
        return
    if args.action == "export":
        from hybridkv.eval.kva import export_kva

        for path in export_kva(args.out, args.to, args.model):
            print(f"wrote {path}")
        return

    from hybridkv.errors import MissingDataError
    from hybridkv.eval.arena import ArenaPlan, method_grid, run_arena
    from hybridkv.eval.contract import ArenaConfig, get_arena_method
    from hybridkv.eval.workloads import get_workload
    from hybridkv.eval.workloads.frozen import freeze, load_frozen
    from hybridkv.methods import Budget
    from hybridkv.models.tokenizer import load_tokenizer

    workload = get_workload(args.workload)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = [Budget.parse(b) for b in args.budgets.split(",") if b.strip()]
    for name, budget in method_grid(ArenaPlan(args.workload, methods, budgets)):
        get_arena_method(name, budget)  # unknown names and bad NAME@BUDGET entries fail before any work
    tasks = [t.strip() for t in args.tasks.split(",")] if args.tasks else list(workload.default_tasks)
    if unknown := [t for t in tasks if t not in workload.tasks]:
        raise HybridKVError(f"unknown {args.workload} task(s) {', '.join(unknown)}; known: {', '.join(workload.tasks)}")
    from hybridkv.eval.kva import check_resume, record_run  # OUT/run.json: the run's options, for resuming and export

    run_options = dict(model=args.model, cache_model=args.cache_model, dtype=args.dtype, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, workload=args.workload, tasks=tasks, lengths=args.lengths,
                       samples=args.samples, data=args.data)  # fmt: skip
    check_resume(args.out, **run_options)  # before the frozen samples are trusted or a model is loaded
    tokenizer = load_tokenizer(args.model)
    frozen = args.out / "samples.jsonl"
    if frozen.exists():
        samples = load_frozen(frozen)
    else:
        samples = []
        for task in tasks:
            for length in args.lengths:
                try:
                    samples += workload.generate(task, length, args.samples, tokenizer, args.seed, args.data)
                except MissingDataError as err:
                    print(err)
                    break
        if not samples:
            raise HybridKVError(f"no {args.workload} samples to run (see the messages above)")
        args.out.mkdir(parents=True, exist_ok=True)
        freeze(samples, frozen)
    model = _load(args)
    record_run(args.out, device=str(model.device), **run_options)
    cache_model = None
    if args.cache_model:
        from hybridkv.models import load_model
        from hybridkv.models.loader import DTYPES

        cache_model = load_model(args.cache_model, seed=args.seed, dtype=DTYPES[args.dtype], device=model.device)
    config = ArenaConfig(checkpoint_interval=args.checkpoint_interval or None, cache_model=cache_model)
    run_arena(
        model, tokenizer, samples, ArenaPlan(args.workload, methods, budgets), config, args.out, workload.score,
        show_progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    write_summary()


def _add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N, or auto: the GPU when there is one, else the CPU; a checkpoint too large for one "
        "GPU is spread over all of them (the memory arithmetic is printed first)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights, KV and conv windows (recurrent states keep the model library's dtype); full prefill, the "
        "reference, runs in it too",
    )


def _load(args: argparse.Namespace):
    import torch

    from hybridkv.models import load_model
    from hybridkv.models.loader import DTYPES, resolve_device

    dtype = DTYPES[args.dtype]
    if args.device == "auto" and Path(args.model).is_dir() and torch.cuda.is_available():
        return load_model(args.model, seed=args.seed, dtype=dtype, device=_placement(args, dtype))
    return load_model(args.model, seed=args.seed, dtype=dtype, device=resolve_device(args.device))


def _placement(args: argparse.Namespace, dtype):
    """One GPU or several for a checkpoint, from the memory arithmetic, printed before loading."""
    from transformers import AutoConfig

    from hybridkv.models.placement import checkpoint_parameters, choose_placement, free_gpu_memory, memory_plan

    directory = Path(args.model)
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as err:
        raise HybridKVError(f"{directory}: unreadable config ({err})") from err
    # the longest prompt this command holds: a prefix and its suffix, or an arena prompt and its answer
    lengths = getattr(args, "prefix_lengths", None) or getattr(args, "lengths", None) or [0]
    extra = getattr(args, "suffix_length", None) or getattr(args, "max_new_tokens", None) or 256
    plan = memory_plan(config, checkpoint_parameters(directory), dtype, max(lengths) + extra)
    placement = choose_placement(plan, free_gpu_memory())
    for line in [f"memory plan for {directory} ({str(dtype).removeprefix('torch.')}):", *plan.lines()]:
        print(line, file=sys.stderr)
    print(f"placement: {placement.reason}", file=sys.stderr)
    return placement


def _quiet_libraries() -> None:
    """Process-wide settings for the command line only (a library user keeps their own)."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # kernel-fallback notices are expected on a CPU
    warnings.filterwarnings("ignore", module="transformers")


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        if args.command == "validate":
            _validate(args)
        elif args.command == "store" and args.action == "bench":
            _store_bench(args)
        elif args.command == "store":
            _store(args)
        elif args.command == "arena":
            _arena(args)
        elif args.command == "calibrate":
            _calibrate(args)
        elif args.command == "ttft":
            _ttft(args)
        elif args.command == "plan":
            _plan(args)
        elif args.command == "vllm-bench":
            _vllm_bench(args)
        elif args.command == "train":
            _train(args)
    except HybridKVError as err:
        print(f"hybridkv: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
