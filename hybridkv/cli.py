"""The `hybridkv` command line.

A command's options are the fields of its config dataclass that carry a `help` (`_add_fields`): a
flag's name, default, type and help text are written once, beside the field, in the layer that runs
the command. Comma lists go through one typed parser (`comma_list`), so a bad value is argparse's
one-line error before any work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.workloads import WORKLOADS
from hybridkv.methods import Budget
from hybridkv.models.tiny import DEFAULT_MODEL


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None or its help already says what the default means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse's errors (a bad value, an unknown flag) as one line, like the command's own errors."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"hybridkv: error: {message}; see {self.prog} --help\n")


def comma_list(item: Callable[[str], object], what: str, choices: Iterable[str] | None = None) -> Callable:
    """An argparse `type=`: "a,b,c" -> [item("a"), item("b"), item("c")] (empty parts skipped). A part
    that `item` refuses (ValueError, or a HybridKVError saying why) or that is not among `choices`
    becomes argparse's one-line error for the flag."""

    def parse(text: str) -> list:
        try:
            values = [item(part) for part in (p.strip() for p in text.split(",")) if part]
        except HybridKVError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r}") from None
        if choices is not None and (unknown := [v for v in values if v not in choices]):
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (known: {', '.join(choices)})")
        return values

    parse.__name__ = f"comma list of {what}"
    return parse


def _budget_text(text: str) -> str:
    Budget.parse(text)  # refuses a bad budget; the text is kept as written
    return text


INTS = comma_list(int, "integers")
FLOATS = comma_list(float, "numbers")
NAMES = comma_list(str, "names")
BUDGETS = comma_list(Budget.parse, "budgets (fractions like 0.05, or token counts like 256tok)")
BUDGET_TEXTS = comma_list(_budget_text, "budgets (fractions like 0.05, or token counts like 256tok)")
_LIST_TYPES = {int: INTS, float: FLOATS, str: NAMES, Budget: BUDGETS}


def _flag_type(hint: object) -> Callable | None:
    """The argparse `type=` for a field annotation: X | None as X, lists and tuples as comma lists."""
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) in (list, tuple):
        return _LIST_TYPES[typing.get_args(hint)[0]]
    return {int: int, float: float, str: None, Path: Path}[hint]


def _flag_text(value: object) -> object:
    """A default as it would be typed (argparse parses a text default like a given value, and --help
    shows it): lists comma-joined, (LENGTH, STEPS) pairs as LENGTH:STEPS, a dict as JSON."""
    if isinstance(value, list | tuple):
        return ",".join(":".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value) if value else ""
    return value


def _add_fields(parser: argparse.ArgumentParser, config: type, skip: tuple[str, ...] = (), **overrides: dict) -> None:
    """One option per field of the dataclass `config` that has a `help` in its metadata (and is not in
    `skip`): --FIELD-NAME, or the field's `flag`; a positional argument where the field has no
    default. The type comes from the annotation unless `overrides[field]` sets it (and any other
    add_argument setting)."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if "help" not in f.metadata or f.name in skip:
            continue
        options = {"help": f.metadata["help"], **overrides.get(f.name, {})}
        if "type" not in options:
            try:
                options["type"] = _flag_type(hints[f.name])
            except KeyError:
                raise TypeError(f"{config.__name__}.{f.name}: no flag type for {hints[f.name]}; give one") from None
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            parser.add_argument(f.name, **options)
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if flag := f.metadata.get("flag"):  # named unlike the field: shown as the flag's name
            options.setdefault("metavar", flag.removeprefix("--").replace("-", "_").upper())
        default = options.pop("default", _flag_text(default))  # an override's default wins (None: "decide later")
        parser.add_argument(flag or "--" + f.name.replace("_", "-"), dest=f.name, default=default, **options)


def _config(config: type, args: argparse.Namespace, **values: object):
    """`config` made from the parsed options of its fields (`_add_fields`), and `values`, which win."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if "help" in f.metadata and f.name not in values and hasattr(args, f.name):
            value = getattr(args, f.name)
            is_tuple = typing.get_origin(hints[f.name]) is tuple and isinstance(value, list)
            values[f.name] = tuple(value) if is_tuple else value
    return config(**values)


def _build_parser() -> argparse.ArgumentParser:
    from hybridkv.eval.arena import ArenaPlan
    from hybridkv.eval.calibrate import CalibrateConfig
    from hybridkv.eval.contract import ArenaConfig
    from hybridkv.eval.plan import GLM_5_3_FLASH, Deployment
    from hybridkv.eval.probe import ProbeConfig
    from hybridkv.eval.ttft import TTFTConfig
    from hybridkv.eval.validate import ValidateConfig
    from hybridkv.serving.arena import DEFAULT_SERVED_BUDGETS, DEFAULT_SERVED_METHODS
    from hybridkv.serving.bench import BenchPlan
    from hybridkv.serving.models import DEFAULT_BENCH_MODEL
    from hybridkv.serving.server import ADAPTIVE
    from hybridkv.serving.traffic import TRAFFIC, Shape
    from hybridkv.train.loop import TrainConfig

    defaults = _Defaults
    parser = _Parser(
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
        formatter_class=defaults,
    )
    _add_fields(validate, ValidateConfig)
    _add_device_options(validate)
    validate.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _add_output_options(validate, "out/validate")

    store = commands.add_parser("store", help="inspect, empty or benchmark a store")
    actions = store.add_subparsers(dest="action", required=True)
    for action, text in (("stats", "entry count and bytes held"), ("clear", "remove every hybridkv entry")):
        sub = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + " of a store.")
        sub.add_argument("--store", required=True, help="store URL, as for validate --store")
    bench = actions.add_parser(
        "bench",
        help="put/get latency and throughput per store backend, for GLM-5.3-Flash-sized entries",
        description=(
            "Times puts and gets of GLM-5.3-Flash-sized entries (a 256-token KV block of its 11 attention "
            "layers, one KDA layer's state, one whole 34-layer state checkpoint) on each store, one request at "
            "a time, beside the hybridkv codec's own cost and, for redis/valkey, redis-benchmark on the same "
            "server. Writes OUT/store_bench.json."
        ),
        formatter_class=defaults,
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
        formatter_class=defaults,
    )
    # --methods and --budgets default by engine (the harness's ArenaPlan, the served arena's own): left
    # out, they are None here, so a list given explicitly is never mistaken for the default.
    harness = ArenaPlan()
    by_engine = "default: {} in the harness; {} with --engine vllm"
    _add_fields(
        run, ArenaPlan, workload={"choices": WORKLOADS},
        methods={"default": None, "help": f"{ArenaPlan.__dataclass_fields__['methods'].metadata['help']} ("
                 + by_engine.format(",".join(harness.methods), ",".join(DEFAULT_SERVED_METHODS)) + ")"},
        budgets={"default": None, "help": f"{ArenaPlan.__dataclass_fields__['budgets'].metadata['help']} ("
                 + by_engine.format(_flag_text(harness.budgets), _flag_text(list(DEFAULT_SERVED_BUDGETS))) + ")"},
    )  # fmt: skip
    _add_fields(run, ArenaConfig)
    run.add_argument(
        "--tasks", type=NAMES, default=None, help="comma list of tasks (default: every task the workload can make)"
    )
    run.add_argument("--lengths", type=INTS, default="4096", help="target prompt lengths in tokens")
    run.add_argument("--samples", type=int, default=20, help="samples per task and length")
    _add_model_options(run)
    run.add_argument(
        "--data",
        default=None,
        help="local data: SQuAD/HotpotQA json for RULER's qa tasks; LongBench's data folder; "
        "KVShareArena's data/queryset folder",
    )
    run.add_argument("--max-new-tokens", type=int, default=None, help="cap on generated tokens (default: per task)")
    run.add_argument(
        "--cache-model",
        default=None,
        help="cross-checkpoint reuse: caches are built by this checkpoint (built-in name or directory) of the same "
        "architecture and size as --model, which answers (default: --model builds them)",
    )
    run.add_argument("--seed", type=int, default=0, help="seed for the samples and a random model's weights")
    run.add_argument(
        "--engine",
        default="transformers",
        choices=["transformers", "vllm"],
        help="transformers: the harness answers in this process; vllm: each method is a real `vllm serve` "
        "(no-cache for full and no-context, vLLM's prefix cache, HybridKVConnector for tail-replay, "
        "horizon-replay and checkpoint) answering the same samples; its methods default to all of those, "
        "its budgets to 0.05,0.2,1.0 (--model: a checkpoint directory vLLM serves)",
    )
    run.add_argument(
        "--shadow-rate", type=float, default=0.0,
        help="--engine vllm: the share of the connector's requests whose served answers its shadow process "
        "checks against exact full prefill, by kind of resume (budget by budget, into OUT/shadow.json beside "
        "the scores; 0: off)",
    )  # fmt: skip
    _add_output_options(run, "out/arena", "output directory (resumed if it exists)")
    score = arena_commands.add_parser("score", help="rebuild OUT/summary.json from OUT/results.jsonl")
    score.add_argument("out", type=Path)
    report = arena_commands.add_parser("report", help="write OUT/report.md and OUT/report.html with plots")
    report.add_argument("out", type=Path)
    report.add_argument(
        "--beside", type=Path, default=None,
        help="another run directory on the same samples (e.g. the harness's beside a served run): its scores "
        "and CIs in a table beside OUT's",
    )  # fmt: skip
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
        formatter_class=defaults,
    )
    _add_fields(ttft, TTFTConfig, skip=("store", "cache_salt"))
    _add_device_options(ttft)
    _add_output_options(ttft, "out/ttft")

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
        formatter_class=defaults,
    )
    _add_model_options(calibrate)
    _add_fields(calibrate, CalibrateConfig)
    calibrate.add_argument("--out", type=Path, default=None, help="output file (default: beside a checkpoint)")

    probe = commands.add_parser(
        "probe",
        help="where does a model read its answer: the attention KV or the linear states (swap test per layer)",
        description=(
            "On samples the model answers correctly with full prefill, swaps the attention KV and the linear states "
            "with those of a counterfactual context (every answer value changed), zeroes or swaps each linear layer's "
            "state alone, and runs tail-replay at each budget against the needle's distance from the match end. Says "
            "per task whether the answer follows the KV ('attention') or the states ('states, layer N'), and how "
            "much a replayed tail keeps inside and outside it. Writes OUT/probe.json, OUT/probe.md and OUT/probe.png; "
            "for a checkpoint directory also hybridkv-probe.json beside it, which arena reports and model cards read."
        ),
        formatter_class=defaults,
    )
    _add_model_options(probe)
    _add_fields(probe, ProbeConfig, workload={"choices": WORKLOADS})
    _add_output_options(probe, "out/probe")

    plan = commands.add_parser(
        "plan",
        help="cache memory and predicted TTFT speedups per caching scheme, from a model's config alone",
        description=(
            "From a config alone (no weights): attention KV bytes per token, linear-state bytes per checkpoint, "
            "the cache memory of checkpoint-every-B schemes vs tail-replay for a workload, and the speedup over "
            "full prefill that the FLOP cost model predicts for each method (an upper bound)."
        ),
        formatter_class=defaults,
    )
    plan.add_argument(
        "--model", default=GLM_5_3_FLASH, help=f"{GLM_5_3_FLASH}, a built-in tiny model, or a checkpoint dir"
    )
    _add_fields(plan, Deployment, budgets={"type": BUDGET_TEXTS})
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")

    bench_vllm = commands.add_parser(
        "vllm-bench",
        help="TTFT and reuse through vllm serve: no cache vs vLLM's prefix cache vs HybridKVConnector",
        description=(
            "Starts one `vllm serve` process (vLLM's OpenAI server) per configuration - no prefix caching, vLLM's own "
            "hybrid prefix cache (align mode), vLLM with HybridKVConnector at each budget - and sends each the same "
            "workloads over HTTP from 1, 4 and 16 concurrent clients: shared system prompts with user turns of varied "
            "length, multi-turn conversations, a RAG-like mix with 30% misses, and prefixes on vLLM's block grid. "
            "Writes OUT/summary.json (one row per workload, config, clients and budget), OUT/report.md and a TTFT plot "
            "per workload. Needs the vllm extra (pip install 'hybridkv[vllm]')."
        ),
        formatter_class=defaults,
    )
    bench_vllm.add_argument(
        "--model",
        default=DEFAULT_BENCH_MODEL,
        help="checkpoint directory vLLM can serve (one with a tokenizer is sent text); tiny-qwen3-next-vllm, a "
        "trained model sent text, so first-token fidelity means something; or a seeded random-weight bench model "
        "written to OUT/<name> and sent random token ids, for block grids and timing: grid-2048 (vLLM derives a "
        "2,176-token block for it, a production-shaped grid) or grid-640 (a fine grid)",
    )
    server_budget = comma_list(lambda text: text if text == ADAPTIVE else _budget_text(text), "budgets or adaptive")
    _add_fields(
        bench_vllm, BenchPlan,
        workloads={"type": comma_list(str, "server workloads", choices=TRAFFIC)},
        budgets={"type": server_budget},
    )  # fmt: skip
    _add_fields(bench_vllm, Shape)
    _add_output_options(bench_vllm, "out/vllm-bench")

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
        formatter_class=defaults,
    )
    _add_fields(train, TrainConfig, schedule={"type": _schedule}, shape={"type": _shape})
    train.add_argument(
        "--export", action="store_true",
        help="do not train: copy RUN_DIR's checkpoint weights into the package as the built-in MODEL",
    )  # fmt: skip
    return parser


def _add_output_options(parser: argparse.ArgumentParser, out: str, help: str = "output directory") -> None:
    parser.add_argument("--out", type=Path, default=Path(out), help=help)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _schedule(text: str) -> tuple[tuple[int, int], ...]:
    from hybridkv.train.loop import parse_schedule

    try:
        return parse_schedule(text)
    except HybridKVError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _shape(text: str) -> dict:
    try:
        shape = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(shape, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of config fields, not {text!r}")
    return shape


def _train(args: argparse.Namespace) -> None:
    from hybridkv.train.loop import TrainConfig, export, train

    if args.export:
        print(f"wrote {export(args.run_dir, args.model)}")
        return
    checkpoint = train(_config(TrainConfig, args))
    print(f"checkpoint: {checkpoint}\nlog: {args.run_dir / 'log.jsonl'}\nplot: {args.run_dir / 'loss.png'}")


def _calibrate(args: argparse.Namespace) -> None:
    from hybridkv.eval.calibrate import CalibrateConfig, calibrate
    from hybridkv.models.calibration import CALIBRATION_FILE

    out = args.out
    if out is None:
        if not Path(args.model).is_dir():
            raise HybridKVError(f"--model {args.model} is not a checkpoint directory: give --out for its calibration")
        out = Path(args.model) / CALIBRATION_FILE
    config = _config(CalibrateConfig, args)  # a bad value fails before the model loads
    result = calibrate(_load(args), config)
    print(json.dumps({"horizon": result.horizon, "layers": result.layers, "text": result.text}))
    print(f"wrote {result.write(out)}")


def _probe(args: argparse.Namespace) -> None:
    import shutil

    from hybridkv.eval.probe import PROBE_FILE, ProbeConfig, run_probe
    from hybridkv.models.tokenizer import load_tokenizer
    from hybridkv.report.probe_report import probe_tables, write_probe

    config = _config(ProbeConfig, args)
    config.check()  # a bad value fails before the model loads
    tokenizer = load_tokenizer(args.model)
    summary = run_probe(_load(args), tokenizer, config, show_progress=not args.no_progress)
    print(f"{args.model} reads its answer from: {summary['reads_from']}\n")
    print("\n".join(probe_tables(summary)))
    written = list(write_probe(summary, args.out))
    if Path(args.model).is_dir():  # kept beside the checkpoint, where arena reports look for it
        written.append(shutil.copyfile(written[0], Path(args.model) / PROBE_FILE))
    print(f"\nwrote {', '.join(map(str, written))}")


def _ttft(args: argparse.Namespace) -> None:
    from hybridkv.eval.ttft import TTFTConfig, run_ttft, table

    config = _config(TTFTConfig, args)
    config.check()
    summary = run_ttft(_load(args), config, args.out, show_progress=not args.no_progress)
    print(table(summary["rows"]))
    print(f"\nwrote {args.out / 'summary.json'} and {args.out / 'ttft.png'}")


def _plan(args: argparse.Namespace) -> None:
    from hybridkv.eval.plan import Deployment, make_plan, plan_table

    workload = _config(Deployment, args)
    if min([*workload.prefix_lengths, workload.suffix_tokens, *workload.intervals]) < 1:
        raise HybridKVError("prefix lengths, suffix tokens and intervals must be positive")
    if workload.new_prefixes_per_s < 0 or workload.retention_s < 0:
        raise HybridKVError("--rate and --retention must not be negative")
    plan = make_plan(args.model, workload)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan_table(plan, workload))


def _vllm_bench(args: argparse.Namespace) -> None:
    if (
        args.requests < 1
        or args.engines < 1
        or min(args.clients, default=0) < 1
        or not args.budgets
        or not args.workloads
    ):
        raise HybridKVError(
            "--requests, --engines and every --clients value must be positive; give a budget and a workload"
        )
    if not 64 <= args.min_prefix <= args.max_prefix:
        raise HybridKVError(f"--min-prefix {args.min_prefix} / --max-prefix {args.max_prefix}: need 64 <= min <= max")
    try:
        from hybridkv.serving.bench import BenchPlan, run_bench
        from hybridkv.serving.models import bench_checkpoint
        from hybridkv.serving.traffic import Shape
    except ImportError as err:
        raise HybridKVError(f"vllm-bench needs vLLM: pip install 'hybridkv[vllm]' ({err})") from err
    model = str(bench_checkpoint(args.model, args.out))
    run_bench(
        _config(BenchPlan, args, model=model, shape=_config(Shape, args)), args.out, show_progress=not args.no_progress
    )
    print((args.out / "report.md").read_text())


def _validate(args: argparse.Namespace) -> None:
    import torch

    from hybridkv.eval.validate import ValidateConfig, run_validate
    from hybridkv.report.validate_report import format_table, write_outputs

    if args.threads:
        torch.set_num_threads(args.threads)
    config = _config(ValidateConfig, args, checkpoint_interval=args.checkpoint_interval or None)
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
        if args.beside is not None and not (args.beside / "summary.json").exists():
            raise HybridKVError(f"--beside {args.beside}: no summary.json; run `hybridkv arena score` on it first")
        md_path, html_path = write_arena_report(args.out, args.beside)
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
    from hybridkv.eval.arena import method_grid, run_arena
    from hybridkv.eval.contract import ArenaConfig, get_arena_method
    from hybridkv.eval.workloads import get_workload
    from hybridkv.eval.workloads.frozen import freeze, load_frozen
    from hybridkv.models.tokenizer import load_tokenizer

    workload = get_workload(args.workload)
    served = args.engine == "vllm"
    plan = _arena_plan(args)
    if served:
        from hybridkv.serving.arena import served_grid

        served_grid(plan, horizon=lambda: 0)  # bad names fail here
        if not Path(args.model).is_dir():
            raise HybridKVError(f"--engine vllm serves a checkpoint directory; {args.model} is not one")
        if not 0 <= args.shadow_rate <= 1:
            raise HybridKVError(f"--shadow-rate {args.shadow_rate}: a share of requests, from 0 to 1")
    elif args.shadow_rate:
        raise HybridKVError("--shadow-rate checks a served connector's resumes: give --engine vllm")
    else:
        for name, budget in method_grid(plan):
            get_arena_method(name, budget)  # unknown names and bad NAME@BUDGET entries fail before any work
    tasks = args.tasks if args.tasks else list(workload.default_tasks)
    if unknown := [t for t in tasks if t not in workload.tasks]:
        raise HybridKVError(f"unknown {args.workload} task(s) {', '.join(unknown)}; known: {', '.join(workload.tasks)}")
    from hybridkv.eval.kva import check_resume, record_run  # OUT/run.json: the run's options, for resuming and export

    dtype = args.dtype  # what the answers were computed in, for run.json
    if served:
        from hybridkv.serving.server import SERVED_DTYPE

        if args.dtype != "float32":  # the harness's --dtype, at its default
            raise HybridKVError(f"--dtype {args.dtype}: vllm serve runs the model in {SERVED_DTYPE} here; leave it out")
        dtype = SERVED_DTYPE
    run_options = dict(model=args.model, cache_model=args.cache_model, dtype=dtype, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, workload=args.workload, tasks=tasks, lengths=args.lengths,
                       samples=args.samples, data=args.data, engine=args.engine)  # fmt: skip
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
    if served:
        from hybridkv.serving.arena import run_served_arena
        from hybridkv.serving.bench import ensure_calibrated

        record_run(args.out, device="vllm serve (cpu)", **run_options)
        run_served_arena(
            args.model, tokenizer, samples, plan, args.out, workload.score,
            horizon=lambda: _horizon(ensure_calibrated(args.model), args.model),
            show_progress=not args.no_progress, max_new_tokens=args.max_new_tokens, shadow_rate=args.shadow_rate,
        )  # fmt: skip
        write_summary()
        return
    model = _load(args)
    record_run(args.out, device=str(model.device), **run_options)
    cache_model = None
    if args.cache_model:
        from hybridkv.models import load_model
        from hybridkv.models.loader import DTYPES

        cache_model = load_model(args.cache_model, seed=args.seed, dtype=DTYPES[args.dtype], device=model.device)
    config = ArenaConfig(checkpoint_interval=args.checkpoint_interval or None, cache_model=cache_model)
    run_arena(
        model, tokenizer, samples, plan, config, args.out, workload.score,
        show_progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    write_summary()


def _arena_plan(args: argparse.Namespace):
    """The arena's plan from its options: --methods and --budgets left out take the engine's defaults."""
    from hybridkv.eval.arena import ArenaPlan
    from hybridkv.serving.arena import DEFAULT_SERVED_BUDGETS, DEFAULT_SERVED_METHODS

    served, harness = args.engine == "vllm", ArenaPlan()
    methods = args.methods or list(DEFAULT_SERVED_METHODS if served else harness.methods)
    budgets = args.budgets or list(DEFAULT_SERVED_BUDGETS if served else harness.budgets)
    return ArenaPlan(args.workload, methods, budgets)


def _horizon(calibration: dict, model: str) -> int:
    """The calibrated forgetting horizon horizon-replay replays (refused when calibration found none)."""
    if calibration.get("horizon") is None:
        raise HybridKVError(f"{model}: its calibration found a layer remembering past its sample; no horizon to replay")
    return int(calibration["horizon"])


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model and where it runs (`_add_device_options`)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in model or checkpoint directory")
    _add_device_options(parser)


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

    from hybridkv.models.meta import memory_plan
    from hybridkv.models.placement import checkpoint_parameters, choose_placement, free_gpu_memory

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
    """Run one command; the exit status: 0, or 2 for a bad option (argparse's error) or a HybridKVError."""
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or argparse's error on stderr
        return int(done.code or 0)
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
        elif args.command == "probe":
            _probe(args)
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
