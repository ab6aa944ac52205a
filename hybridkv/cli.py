"""The `hybridkv` command line.

Every option of every command is a field of a config dataclass that carries a `help` (`_add_fields`):
a flag's name, default, type and help text are written once, beside the field, in the layer that runs
the command (`ValidateConfig`, `ArenaPlan`, `BenchPlan`, ...) or, for the command line's own options
(where the model runs, where output goes), in the dataclasses below. `COMMANDS` lists the commands
with their dataclasses; `_build_parser` is a loop over it. Comma lists go through one typed parser
(`comma_list`), so a bad value is argparse's one-line error before any work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.arena import ArenaPlan
from hybridkv.eval.calibrate import CalibrateConfig
from hybridkv.eval.contract import ArenaConfig
from hybridkv.eval.plan import GLM_5_3_FLASH, Deployment
from hybridkv.eval.probe import ProbeConfig
from hybridkv.eval.trace_sim import POLICIES, TraceSimConfig
from hybridkv.eval.ttft import TTFTConfig
from hybridkv.eval.validate import ValidateConfig
from hybridkv.eval.workloads import WORKLOADS
from hybridkv.methods import Budget
from hybridkv.models.tiny import DEFAULT_MODEL
from hybridkv.serving.arena import DEFAULT_SERVED_BUDGETS, DEFAULT_SERVED_METHODS
from hybridkv.serving.bench import BenchPlan
from hybridkv.serving.models import DEFAULT_BENCH_MODEL
from hybridkv.serving.server import ADAPTIVE, SERVED_DTYPE
from hybridkv.serving.trace_replay import TraceReplayConfig
from hybridkv.serving.traffic import TRAFFIC, Shape
from hybridkv.train.loop import TrainConfig, parse_schedule


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


_NOT_SETTINGS = ("help", "flag")  # field metadata that is not passed on to argparse as it is


def _add_fields(parser: argparse.ArgumentParser, config: type, skip: tuple[str, ...] = (), **overrides: dict) -> None:
    """One option per field of the dataclass `config` that has a `help` in its metadata (and is not in
    `skip`): --FIELD-NAME, or the field's `flag`; a positional argument where the field has neither a
    default nor a `flag` (with a flag: a required option). The type comes from the annotation (a bool:
    a switch); other metadata (`choices`, `action`, `type`) and then `overrides[field]` set the rest."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if "help" not in f.metadata or f.name in skip:
            continue
        options = {k: v for k, v in f.metadata.items() if k not in _NOT_SETTINGS}
        options.update({"help": f.metadata["help"], **overrides.get(f.name, {})})
        if hints[f.name] is bool:
            options.setdefault("action", "store_true")
        elif "type" not in options:
            try:
                options["type"] = _flag_type(hints[f.name])
            except KeyError:
                raise TypeError(f"{config.__name__}.{f.name}: no flag type for {hints[f.name]}; give one") from None
        flag = f.metadata.get("flag")
        names = [flag or "--" + f.name.replace("_", "-")]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if flag is None:
                names = [f.name]
            else:
                options.update(dest=f.name, required=True)
        else:
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            # an override's default wins (None: "decided later", as the arena's engine defaults are)
            options.update(dest=f.name, default=options.pop("default", _flag_text(default)))
        if flag and flag.removeprefix("--") != f.name:  # named unlike the field: shown as the flag's name
            options.setdefault("metavar", flag.removeprefix("--").replace("-", "_").upper())
        parser.add_argument(*names, **options)


def _config(config: type, args: argparse.Namespace, **values: object):
    """`config` made from the parsed options of its fields (`_add_fields`), and `values`, which win."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if "help" in f.metadata and f.name not in values and hasattr(args, f.name):
            value = getattr(args, f.name)
            is_tuple = typing.get_origin(hints[f.name]) is tuple and isinstance(value, list)
            values[f.name] = tuple(value) if is_tuple else value
    return config(**values)


@dataclass
class Model:
    """The model a command runs."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "built-in model or checkpoint directory"})


DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass
class Device:
    """Where a command's model runs, and in what precision."""

    device: str = field(
        default="auto",
        metadata={
            "help": "cpu, cuda, cuda:N, or auto: the GPU when there is one, else the CPU; a checkpoint too large for "
            "one GPU is spread over all of them (the memory arithmetic is printed first)"
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "weights, KV and conv windows (recurrent states keep the model library's dtype); full prefill, "
            "the reference, runs in it too",
            "choices": DTYPE_NAMES,
        },
    )


@dataclass
class Threads:
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's choice)"})


@dataclass
class Output:
    """Where a command writes (each command names its own default folder) and whether it shows progress."""

    out: Path = field(default=Path("out"), metadata={"help": "output directory"})
    no_progress: bool = field(default=False, metadata={"help": "no progress bar"})


def _output(out: str, help: str = "output directory") -> tuple[type, dict]:
    return Output, {"out": {"default": out, "help": help}}


@dataclass
class StoreURL:
    store: str = field(metadata={"help": "store URL, as for validate --store", "flag": "--store"})


@dataclass
class StoreBench:
    store: list[str] = field(
        metadata={"help": "store URL; repeat for several backends", "flag": "--store", "action": "append", "type": str}
    )
    repeats: int = field(default=20, metadata={"help": "operations per entry size (the checkpoint: 1/5)"})


@dataclass
class ArenaRun:
    """The arena run's samples and engine (the methods and budgets are its `ArenaPlan`)."""

    tasks: list[str] | None = field(
        default=None, metadata={"help": "comma list of tasks (default: every task the workload can make)"}
    )
    lengths: list[int] = field(default_factory=lambda: [4096], metadata={"help": "target prompt lengths in tokens"})
    samples: int = field(default=20, metadata={"help": "samples per task and length"})
    data: str | None = field(
        default=None,
        metadata={
            "help": "local data: SQuAD/HotpotQA json for RULER's qa tasks; LongBench's data folder; KVShareArena's "
            "data/queryset folder"
        },
    )
    max_new_tokens: int | None = field(default=None, metadata={"help": "cap on generated tokens (default: per task)"})
    cache_model: str | None = field(
        default=None,
        metadata={
            "help": "cross-checkpoint reuse: caches are built by this checkpoint (built-in name or directory) of the "
            "same architecture and size as --model, which answers (default: --model builds them)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for the samples and a random model's weights"})
    engine: str = field(
        default="transformers",
        metadata={
            "help": "transformers: the harness answers in this process; vllm: each method is a real `vllm serve` "
            "(no-cache for full and no-context, vLLM's prefix cache, HybridKVConnector for the methods that "
            "resume in vLLM) answering the same samples (--model: a checkpoint directory vLLM serves)",
            "choices": ("transformers", "vllm"),
        },
    )
    shadow_rate: float = field(
        default=0.0,
        metadata={
            "help": "--engine vllm: the share of the connector's requests whose served answers its shadow process "
            "checks against exact full prefill, by kind of resume (budget by budget, into OUT/shadow.json beside "
            "the scores; 0: off)"
        },
    )


@dataclass
class RunDir:
    out: Path = field(metadata={"help": "an arena run's output directory"})


@dataclass
class Beside:
    beside: Path | None = field(
        default=None,
        metadata={
            "help": "another run directory on the same samples (e.g. the harness's beside a served run): its scores "
            "and CIs in a table beside OUT's"
        },
    )


@dataclass
class Export:
    format: str = field(metadata={"help": "kva: KVShareArena's kva.result.v1", "flag": "--format", "choices": ("kva",)})
    to: Path | None = field(default=None, metadata={"help": "output directory (default: OUT/kva)"})
    model: str | None = field(default=None, metadata={"help": "the model name to report (default: OUT/run.json's)"})


@dataclass
class AsJSON:
    json: bool = field(default=False, metadata={"help": "print JSON instead of tables"})


@dataclass
class CalibrationFile:
    out: Path | None = field(default=None, metadata={"help": "output file (default: beside a checkpoint)"})


@dataclass
class TrainExport:
    export: bool = field(
        default=False,
        metadata={"help": "do not train: copy RUN_DIR's checkpoint weights into the package as the built-in MODEL"},
    )


def _schedule(text: str) -> tuple[tuple[int, int], ...]:
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
    from hybridkv.train.loop import export, train

    if args.export:
        print(f"wrote {export(args.run_dir, args.model)}")
        return
    checkpoint = train(_config(TrainConfig, args))
    print(f"checkpoint: {checkpoint}\nlog: {args.run_dir / 'log.jsonl'}\nplot: {args.run_dir / 'loss.png'}")


def _calibrate(args: argparse.Namespace) -> None:
    from hybridkv.eval.calibrate import calibrate
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

    from hybridkv.eval.probe import PROBE_FILE, run_probe
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
    from hybridkv.eval.ttft import run_ttft, table

    config = _config(TTFTConfig, args)
    config.check()
    summary = run_ttft(_load(args), config, args.out, show_progress=not args.no_progress)
    print(table(summary["rows"]))
    print(f"\nwrote {args.out / 'summary.json'} and {args.out / 'ttft.png'}")


def _plan(args: argparse.Namespace) -> None:
    from hybridkv.eval.plan import make_plan, plan_table

    workload = _config(Deployment, args)
    if min([*workload.prefix_lengths, workload.suffix_tokens, *workload.intervals]) < 1:
        raise HybridKVError("prefix lengths, suffix tokens and intervals must be positive")
    if workload.new_prefixes_per_s < 0 or workload.retention_s < 0:
        raise HybridKVError("--rate and --retention must not be negative")
    plan = make_plan(args.model, workload)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan_table(plan, workload))


def _trace_sim(args: argparse.Namespace) -> None:
    from hybridkv.eval.trace_sim import run_sweep
    from hybridkv.report.trace_report import sweep_tables, write_sweep

    config = _config(TraceSimConfig, args)
    config.check()  # a bad value fails before the trace is read
    summary = run_sweep(config, args.model, show_progress=not args.no_progress)
    print("\n".join(sweep_tables(summary)))
    for path in write_sweep(summary, args.out):
        print(f"wrote {path}")


def _trace_replay(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise HybridKVError("trace-replay needs vLLM: pip install 'hybridkv[vllm]'")
    from hybridkv.report.trace_replay_report import replay_tables, write_replay
    from hybridkv.serving.models import bench_checkpoint
    from hybridkv.serving.trace_replay import run_trace_replay

    model = str(bench_checkpoint(args.model, args.out))
    summary = run_trace_replay(_config(TraceReplayConfig, args), model, args.out, show_progress=not args.no_progress)
    print("\n".join(replay_tables(summary)))
    for path in write_replay(summary, args.out):
        print(f"wrote {path}")


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
    if importlib.util.find_spec("vllm") is None:
        raise HybridKVError("vllm-bench needs vLLM: pip install 'hybridkv[vllm]'")
    from hybridkv.serving.bench import run_bench
    from hybridkv.serving.models import bench_checkpoint

    model = str(bench_checkpoint(args.model, args.out))
    run_bench(
        _config(BenchPlan, args, model=model, shape=_config(Shape, args)), args.out, show_progress=not args.no_progress
    )
    print((args.out / "report.md").read_text())


def _validate(args: argparse.Namespace) -> None:
    import torch

    from hybridkv.eval.validate import run_validate
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


def _store_stats(args: argparse.Namespace) -> None:
    from hybridkv.store import open_store

    store = open_store(args.store)
    try:
        print(json.dumps({"url": args.store, **store.stats()}, indent=2))
    finally:
        store.close()


def _store_clear(args: argparse.Namespace) -> None:
    from hybridkv.store import open_store

    store = open_store(args.store)
    try:
        print(f"removed {store.clear()} entries from {args.store}")
    finally:
        store.close()


def _store_bench(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from hybridkv.eval.store_bench import format_bench_table, glm5_entry_sizes, run_store_bench

    if args.repeats < 1:
        raise HybridKVError("repeats must be at least 1")
    sizes = glm5_entry_sizes(args.repeats)
    total = len(sizes) * (1 + len(args.store))
    with tqdm(total=total, desc="store-bench", leave=False, disable=args.no_progress) as progress:
        rows = run_store_bench(args.store, sizes, progress)
    print(format_bench_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_bench.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out / 'store_bench.json'}")


def _write_summary(out: Path) -> None:
    from hybridkv.eval.arena import read_rows
    from hybridkv.eval.summary import rescore, summarise
    from hybridkv.eval.workloads import score_row

    results = out / "results.jsonl"
    if not results.exists():
        raise HybridKVError(f"{results}: no results to score")
    summary = summarise(rescore(read_rows(results), score_row))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'summary.json'} ({len(summary['rows'])} rows)")


def _arena_score(args: argparse.Namespace) -> None:
    _write_summary(args.out)


def _arena_report(args: argparse.Namespace) -> None:
    from hybridkv.report.arena_report import write_arena_report

    if not (args.out / "summary.json").exists():
        raise HybridKVError(f"{args.out / 'summary.json'}: missing; run `hybridkv arena score {args.out}` first")
    if args.beside is not None and not (args.beside / "summary.json").exists():
        raise HybridKVError(f"--beside {args.beside}: no summary.json; run `hybridkv arena score` on it first")
    md_path, html_path = write_arena_report(args.out, args.beside)
    print(f"wrote {md_path} and {html_path}")


def _arena_export(args: argparse.Namespace) -> None:
    from hybridkv.eval.kva import export_kva

    for path in export_kva(args.out, args.to, args.model):
        print(f"wrote {path}")


def _arena_run(args: argparse.Namespace) -> None:
    from hybridkv.eval.kva import check_resume, record_run  # OUT/run.json: the run's options, for resuming and export
    from hybridkv.eval.workloads import get_workload
    from hybridkv.models.tokenizer import load_tokenizer

    workload = get_workload(args.workload)
    plan = _arena_plan(args)
    _check_arena_run(args, plan)
    tasks = args.tasks if args.tasks else list(workload.default_tasks)
    if unknown := [t for t in tasks if t not in workload.tasks]:
        raise HybridKVError(f"unknown {args.workload} task(s) {', '.join(unknown)}; known: {', '.join(workload.tasks)}")
    args.dtype = _arena_dtype(args)  # what the answers are computed in, for run.json and the model's load
    run_options = dict(model=args.model, cache_model=args.cache_model, dtype=args.dtype, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, workload=args.workload, tasks=tasks, lengths=args.lengths,
                       samples=args.samples, data=args.data, engine=args.engine)  # fmt: skip
    check_resume(args.out, **run_options)  # before the frozen samples are trusted or a model is loaded
    tokenizer = load_tokenizer(args.model)
    samples = _arena_samples(args, workload, tasks, tokenizer)
    if args.engine == "vllm":
        from hybridkv.serving.arena import run_served_arena
        from hybridkv.serving.bench import ensure_calibrated

        record_run(args.out, device="vllm serve (cpu)", **run_options)
        run_served_arena(
            args.model, tokenizer, samples, plan, args.out, workload.score,
            horizon=lambda: _horizon(ensure_calibrated(args.model), args.model),
            show_progress=not args.no_progress, max_new_tokens=args.max_new_tokens, shadow_rate=args.shadow_rate,
        )  # fmt: skip
    else:
        from hybridkv.eval.arena import run_arena

        model = _load(args)
        record_run(args.out, device=str(model.device), **run_options)
        config = ArenaConfig(
            checkpoint_interval=args.checkpoint_interval or None, cache_model=_cache_model(args, model)
        )
        run_arena(
            model, tokenizer, samples, plan, config, args.out, workload.score,
            show_progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
        )  # fmt: skip
    _write_summary(args.out)


def _check_arena_run(args: argparse.Namespace, plan: ArenaPlan) -> None:
    """Refuses what cannot run before any work: unknown methods, bad NAME@BUDGET entries, options of the
    other engine."""
    from hybridkv.eval.arena import method_grid
    from hybridkv.eval.contract import get_arena_method
    from hybridkv.serving.arena import served_grid

    if args.engine == "vllm":
        served_grid(plan, horizon=lambda: 0)
        if not Path(args.model).is_dir():
            raise HybridKVError(f"--engine vllm serves a checkpoint directory; {args.model} is not one")
        if not 0 <= args.shadow_rate <= 1:
            raise HybridKVError(f"--shadow-rate {args.shadow_rate}: a share of requests, from 0 to 1")
        return
    if args.shadow_rate:
        raise HybridKVError("--shadow-rate checks a served connector's resumes: give --engine vllm")
    for name, budget in method_grid(plan):
        get_arena_method(name, budget)


def _arena_dtype(args: argparse.Namespace) -> str:
    """The arena's --dtype, left out: the harness's default, or what vllm serve runs the model in."""
    if args.engine != "vllm":
        return args.dtype or Device().dtype
    if args.dtype not in (None, SERVED_DTYPE):
        raise HybridKVError(f"--dtype {args.dtype}: vllm serve runs the model in {SERVED_DTYPE} here; leave it out")
    return SERVED_DTYPE


def _arena_samples(args: argparse.Namespace, workload, tasks: list[str], tokenizer) -> list:
    """OUT/samples.jsonl when a run froze them, else the workload's samples, frozen there."""
    from hybridkv.errors import MissingDataError
    from hybridkv.eval.workloads.frozen import freeze, load_frozen

    frozen = args.out / "samples.jsonl"
    if frozen.exists():
        return load_frozen(frozen)
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
    return samples


def _cache_model(args: argparse.Namespace, model):
    """--cache-model, loaded as --model is, or None."""
    if not args.cache_model:
        return None
    from hybridkv.models import load_model
    from hybridkv.models.loader import DTYPES

    return load_model(args.cache_model, seed=args.seed, dtype=DTYPES[args.dtype], device=model.device)


def _arena_plan(args: argparse.Namespace) -> ArenaPlan:
    """The arena's plan from its options: --methods and --budgets left out take the engine's defaults."""
    served, harness = args.engine == "vllm", ArenaPlan()
    methods = args.methods or list(DEFAULT_SERVED_METHODS if served else harness.methods)
    budgets = args.budgets or list(DEFAULT_SERVED_BUDGETS if served else harness.budgets)
    return ArenaPlan(args.workload, methods, budgets)


def _horizon(calibration: dict, model: str) -> int:
    """The calibrated forgetting horizon horizon-replay replays (refused when calibration found none)."""
    if calibration.get("horizon") is None:
        raise HybridKVError(f"{model}: its calibration found a layer remembering past its sample; no horizon to replay")
    return int(calibration["horizon"])


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


@dataclass(frozen=True)
class Command:
    """One `hybridkv` command: its name ("arena run": `run` under the group `arena`), what `hybridkv
    --help` and its own --help say, the dataclasses its options come from (a class, or a class with
    `_add_fields` overrides), and the function that runs it."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], None]
    options: tuple[type | tuple[type, dict], ...] = ()
    description: str | None = None


GROUPS = {
    "store": "inspect, empty or benchmark a store",
    "arena": "task-level validation: run, score and report methods on workloads",
}


def _by_engine(name: str, harness: list, served: list) -> dict:
    """An arena run's --methods or --budgets: None when left out, so that `_arena_plan` gives the engine's
    default and a list typed out is never mistaken for it."""
    text = ArenaPlan.__dataclass_fields__[name].metadata["help"]
    return {"default": None, "help": f"{text} (default: {harness} in the harness; {served} with --engine vllm)"}


_BENCH_MODEL_HELP = (
    "checkpoint directory vLLM can serve (one with a tokenizer is sent text); tiny-qwen3-next-vllm, a trained model "
    "sent text, so first-token fidelity means something; or a seeded random-weight bench model written to OUT/<name> "
    "and sent random token ids, for block grids and timing: grid-2048 (vLLM derives a 2,176-token block for it, a "
    "production-shaped grid) or grid-640 (a fine grid)"
)
_ARENA_PLAN = (ArenaPlan, {
    "workload": {"choices": WORKLOADS},
    "methods": _by_engine("methods", ",".join(ArenaPlan().methods), ",".join(DEFAULT_SERVED_METHODS)),
    "budgets": _by_engine("budgets", _flag_text(ArenaPlan().budgets), _flag_text(DEFAULT_SERVED_BUDGETS)),
})  # fmt: skip
_ARENA_DTYPE = (Device, {"dtype": {
    "default": None,
    "help": f"{Device.__dataclass_fields__['dtype'].metadata['help']} (default: {Device().dtype}; with --engine vllm, "
    f"{SERVED_DTYPE}, what vllm serve runs it in)",
}})  # fmt: skip
_PLAN_MODEL = (
    Model,
    {"model": {"default": GLM_5_3_FLASH, "help": f"{GLM_5_3_FLASH}, a built-in tiny model, or a checkpoint dir"}},
)
_BENCH_MODEL = (Model, {"model": {"default": DEFAULT_BENCH_MODEL, "help": _BENCH_MODEL_HELP}})
_BENCH_PLAN = (BenchPlan, {
    "workloads": {"type": comma_list(str, "server workloads", choices=TRAFFIC)},
    "budgets": {"type": comma_list(lambda text: text if text == ADAPTIVE else _budget_text(text), "budgets, adaptive")},
})  # fmt: skip

COMMANDS = (
    Command(
        "validate",
        "measure every recovery method against full prefill on a prefix-hit workload",
        _validate,
        (ValidateConfig, Device, Threads, _output("out/validate")),
        "A cached prompt and a new prompt share exactly their first L tokens, then diverge. The new prompt hits the "
        "cache at L and each method resumes from there; its next-token distributions over the suffix are compared "
        "with full prefill of the same prompt (KL, top-1, greedy agreement), and its time to first token is measured "
        "beside full prefill's in the same run. Prints a table and writes OUT/results.json and OUT/report.md.",
    ),
    Command("store stats", "entry count and bytes held", _store_stats, (StoreURL,)),
    Command("store clear", "remove every hybridkv entry", _store_clear, (StoreURL,)),
    Command(
        "store bench",
        "put/get latency and throughput per store backend, for GLM-5.3-Flash-sized entries",
        _store_bench,
        (StoreBench, _output("out/store-bench")),
        "Times puts and gets of GLM-5.3-Flash-sized entries (a 256-token KV block of its 11 attention layers, one KDA "
        "layer's state, one whole 34-layer state checkpoint) on each store, one request at a time, beside the "
        "hybridkv codec's own cost and, for redis/valkey, redis-benchmark on the same server. Writes "
        "OUT/store_bench.json.",
    ),
    Command(
        "arena run",
        "answer every sample with every method; writes OUT/results.jsonl and OUT/summary.json",
        _arena_run,
        (
            _ARENA_PLAN,
            ArenaConfig,
            ArenaRun,
            Model,
            _ARENA_DTYPE,
            _output("out/arena", "output directory (resumed if it exists)"),
        ),
        "Generates (or reloads) the workload's samples, freezes them to OUT/samples.jsonl with a checksum, and answers "
        "each one with each method through the setup/build_cache/answer contract. Rows are appended as they are "
        "scored, so a killed run resumes without duplicating rows.",
    ),
    Command("arena score", "rebuild OUT/summary.json from OUT/results.jsonl", _arena_score, (RunDir,)),
    Command("arena report", "write OUT/report.md and OUT/report.html with plots", _arena_report, (RunDir, Beside)),
    Command(
        "arena export",
        "write OUT's answers in another benchmark's format: kva (KVShareArena's kva.result.v1, one file per method, "
        "and the run's anchors); for --workload kvsharearena runs",
        _arena_export,
        (RunDir, Export),
    ),
    Command(
        "ttft",
        "TTFT speedups at long matched prefixes beside the cost-model bound",
        _ttft,
        ((TTFTConfig, {"skip": ("store", "cache_salt")}), Device, _output("out/ttft")),
        "Times full prefill, tail-replay (both variants), adaptive-replay (tail under a 1% decay bound, capped by the "
        "budget), checkpoint and seeded-replay at long matched prefixes with a short suffix, each method beside full "
        "prefill in the same process (medians over repeats), and prints the measured speedup beside the FLOP bound "
        "and the decay bound. Writes OUT/summary.json and OUT/ttft.png.",
    ),
    Command(
        "calibrate",
        "measure how far back a model's linear layers remember (for the vLLM connector's replay)",
        _calibrate,
        (Model, Device, CalibrateConfig, CalibrationFile),
        "Runs the model on sample prompts (essay text through its tokenizer, or random token ids for a model without "
        "one), records each linear layer's gates, and finds the replay tail after which a zeroed state contributes "
        "less than the tolerance (the bound adaptive-replay uses), at the quantile over positions. Writes the result "
        "beside a checkpoint directory (hybridkv-calibration.json), where the vLLM connector reads it with "
        '"replay_horizon": "calibrated"; for a built-in model, to --out.',
    ),
    Command(
        "probe",
        "where does a model read its answer: the attention KV or the linear states (swap test per layer)",
        _probe,
        (Model, Device, (ProbeConfig, {"workload": {"choices": WORKLOADS}}), _output("out/probe")),
        "On samples the model answers correctly with full prefill, swaps the attention KV and the linear states with "
        "those of a counterfactual context (every answer value changed), zeroes or swaps each linear layer's state "
        "alone, and runs tail-replay at each budget against the needle's distance from the match end. Says per task "
        "whether the answer follows the KV ('attention') or the states ('states, layer N'), and how much a replayed "
        "tail keeps inside and outside it. Writes OUT/probe.json, OUT/probe.md and OUT/probe.png; for a checkpoint "
        "directory also hybridkv-probe.json beside it, which arena reports and model cards read.",
    ),
    Command(
        "plan",
        "cache memory and predicted TTFT speedups per caching scheme, from a model's config alone",
        _plan,
        (_PLAN_MODEL, (Deployment, {"budgets": {"type": BUDGET_TEXTS}}), AsJSON),
        "From a config alone (no weights): attention KV bytes per token, linear-state bytes per checkpoint, the cache "
        "memory of checkpoint-every-B schemes vs tail-replay for a workload, and the speedup over full prefill that "
        "the FLOP cost model predicts for each method (an upper bound).",
    ),
    Command(
        "trace-sim",
        "replay a request trace against a model's cache sizes and a store of each capacity, under caching policies",
        _trace_sim,
        (
            (TraceSimConfig, {"policies": {"type": comma_list(str, "policies", choices=POLICIES)}}),
            _PLAN_MODEL,
            _output("out/trace-sim"),
        ),
        "Replays a Mooncake-format trace (512-token hash blocks) against the model's KV bytes per token, state bytes "
        "per checkpoint and prefill cost model (from its config alone, as `plan` reads them) and a store of each "
        "capacity: vLLM's align mode (last state per prompt; with Marconi-style admission, vLLM #37898; a state at "
        "every block), and hybridkv's token-level KV with tail replay and exact checkpoints at prompt ends (LRU, or "
        "admission and eviction by prefill compute saved per byte). Prints token hit share, exact-hit share, compute "
        "saved, bytes written and read per capacity, and the capacity each policy needs to save half the prefill "
        "compute; writes OUT/summary.json, OUT/report.md and OUT/sweep.png.",
    ),
    Command(
        "trace-replay",
        "a scaled copy of a request trace through vllm serve on a bounded store, against trace-sim's prediction",
        _trace_replay,
        (
            TraceReplayConfig,
            (Model, {"model": {"default": "grid-128", "help": _BENCH_MODEL_HELP}}),
            _output("out/trace-replay"),
        ),
        "Scales the trace's first requests down (each 512-token hash block becomes 512/scale tokens of fixed random "
        "content per hash id; partial last blocks dropped), simulates them with trace-sim at each capacity with the "
        "served model's sizes, then sends them one at a time, in order, through `vllm serve`: vLLM alone, vLLM's "
        "own prefix cache, and HybridKVConnector on a redis store bounded at each capacity. Prints measured token "
        "and exact-hit shares beside the simulated ones, and TTFT per run; writes OUT/summary.json, "
        "OUT/requests.jsonl, OUT/report.md and OUT/replay.png.",
    ),
    Command(
        "vllm-bench",
        "TTFT and reuse through vllm serve: no cache vs vLLM's prefix cache vs HybridKVConnector",
        _vllm_bench,
        (_BENCH_MODEL, _BENCH_PLAN, Shape, _output("out/vllm-bench")),
        "Starts one `vllm serve` process (vLLM's OpenAI server) per configuration - no prefix caching, vLLM's own "
        "hybrid prefix cache (align mode), vLLM with HybridKVConnector at each budget - and sends each the same "
        "workloads over HTTP from 1, 4 and 16 concurrent clients: shared system prompts with user turns of varied "
        "length, multi-turn conversations, a RAG-like mix with 30% misses, and prefixes on vLLM's block grid. Writes "
        "OUT/summary.json (one row per workload, config, clients and budget), OUT/report.md and a TTFT plot per "
        "workload. Needs the vllm extra (pip install 'hybridkv[vllm]').",
    ),
    Command(
        "train",
        "train a built-in tiny hybrid on the offline task mix (resumable)",
        _train,
        ((TrainConfig, {"schedule": {"type": _schedule}, "shape": {"type": _shape}}), TrainExport),
        "Trains a built-in model's transformers class on long-context tasks in the arena's formats (needle retrieval, "
        "variable tracking, passage QA) written by hybridkv's own generators over text every Python install ships "
        "(its reference topics and standard-library sources), from short to long examples. RUN_DIR gets checkpoint/ "
        "(weights, optimiser, data position, RNG), log.jsonl and loss.png; running the same command again resumes "
        "from the last checkpoint. Keep RUN_DIR outside the repository; `hybridkv train --export` copies the trained "
        "weights where the package loads them.",
    ),
)


def _build_parser() -> argparse.ArgumentParser:
    """The parser of every command in `COMMANDS`, each running its own function (`args.run`)."""
    parser = _Parser(
        prog="hybridkv",
        description="Token-level prefix KV-cache reuse for hybrid LLMs, measured against full prefill.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        *group, name = command.name.split()
        under = commands
        if group:
            if group[0] not in groups:
                parent = commands.add_parser(group[0], help=GROUPS[group[0]], description=GROUPS[group[0]])
                groups[group[0]] = parent.add_subparsers(dest="action", required=True)
            under = groups[group[0]]
        description = command.description or command.help[0].upper() + command.help[1:] + "."
        sub = under.add_parser(name, help=command.help, description=description, formatter_class=_Defaults)
        for options in command.options:
            config, overrides = options if isinstance(options, tuple) else (options, {})
            _add_fields(sub, config, **overrides)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status: 0, or 2 for a bad option (argparse's error) or a HybridKVError."""
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or argparse's error on stderr
        return int(done.code or 0)
    _quiet_libraries()
    try:
        args.run(args)
    except HybridKVError as err:
        print(f"hybridkv: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
