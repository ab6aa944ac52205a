"""The command line's options come from the commands' config dataclasses: a parser's defaults are its
config's, a default changed in a config shows in `--help`, and comma lists refuse a bad value in one
line before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from hybridkv.cache import CHECKPOINT_INTERVAL
from hybridkv.cli import (
    BUDGETS,
    COMMANDS,
    INTS,
    NAMES,
    ArenaRun,
    Device,
    Model,
    _add_fields,
    _arena_dtype,
    _arena_plan,
    _build_parser,
    _config,
    comma_list,
    main,
)
from hybridkv.eval.arena import ArenaPlan
from hybridkv.eval.calibrate import CalibrateConfig
from hybridkv.eval.contract import ArenaConfig
from hybridkv.eval.plan import Deployment
from hybridkv.eval.ttft import TTFTConfig
from hybridkv.eval.validate import ValidateConfig
from hybridkv.methods import Budget
from hybridkv.serving.bench import BenchPlan
from hybridkv.serving.traffic import Shape
from hybridkv.train.loop import TrainConfig


def _defaults(*argv: str):
    return _build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "made", "expected"),
    [
        (["validate"], lambda a: _config(ValidateConfig, a), ValidateConfig()),
        (["ttft"], lambda a: _config(TTFTConfig, a), TTFTConfig()),
        (["calibrate"], lambda a: _config(CalibrateConfig, a), CalibrateConfig()),
        (["plan"], lambda a: _config(Deployment, a), Deployment()),
        (["arena", "run"], _arena_plan, ArenaPlan()),
        (["arena", "run"], lambda a: _config(ArenaConfig, a), ArenaConfig()),
        (["vllm-bench"], lambda a: _config(BenchPlan, a, model="m", shape=_config(Shape, a)), BenchPlan("m")),
        (["train", "RUN"], lambda a: _config(TrainConfig, a), TrainConfig(run_dir=Path("RUN"))),
        (["arena", "run"], lambda a: _config(ArenaRun, a), ArenaRun()),
        (["probe"], lambda a: _config(Model, a), Model()),
        (["validate"], lambda a: _config(Device, a), Device()),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_every_commands_defaults_are_its_configs(argv, made, expected):
    assert made(_defaults(*argv)) == expected


def _options(parser) -> dict[str, object]:
    """Every command's parser by its name ("arena run")."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= {f"{name} {k}": v for k, v in _options(sub).items()} or {name: sub}
    return found


def test_every_option_of_every_command_is_a_field_of_its_configs():
    parsers = _options(_build_parser())
    assert sorted(parsers) == sorted(c.name for c in COMMANDS)
    for command in COMMANDS:
        fields = set()
        for options in command.options:
            config, overrides = options if isinstance(options, tuple) else (options, {})
            skip = overrides.get("skip", ())
            fields |= {f.name for f in dataclasses.fields(config) if "help" in f.metadata and f.name not in skip}
        dests = {a.dest for a in parsers[command.name]._actions if a.dest not in ("help", "run")}
        assert dests == fields, command.name


def test_the_arenas_dtype_left_out_is_the_engines():
    assert _arena_dtype(_defaults("arena", "run")) == Device().dtype
    assert _arena_dtype(_defaults("arena", "run", "--engine", "vllm")) == "bfloat16"
    assert _arena_dtype(_defaults("arena", "run", "--engine", "vllm", "--dtype", "bfloat16")) == "bfloat16"
    assert _arena_dtype(_defaults("arena", "run", "--dtype", "float16")) == "float16"


def test_the_checkpoint_interval_default_is_one_constant():
    assert ValidateConfig().checkpoint_interval == ArenaConfig().checkpoint_interval == CHECKPOINT_INTERVAL
    assert _defaults("validate").checkpoint_interval == _defaults("arena", "run").checkpoint_interval
    assert _defaults("validate").checkpoint_interval == CHECKPOINT_INTERVAL


def _help(capsys, *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_a_default_changed_in_the_config_shows_in_help_and_is_parsed(monkeypatch, capsys):
    monkeypatch.setattr(ValidateConfig.__dataclass_fields__["suffix_length"], "default", 99)
    monkeypatch.setattr(Deployment.__dataclass_fields__["prefix_lengths"], "default", (4096, 512))
    assert "--suffix-length SUFFIX_LENGTH new tokens after the match (fidelity positions) (default: 99)" in _help(
        capsys, "validate"
    )
    assert "--prefix-lengths PREFIX_LENGTHS matched prefix lengths (default: 4096,512)" in _help(capsys, "plan")
    assert _defaults("validate").suffix_length == 99
    assert _config(Deployment, _defaults("plan")).prefix_lengths == (4096, 512)


@pytest.mark.parametrize(
    ("argv", "flag", "says"),
    [
        (["validate", "--prefix-lengths", "1024,x"], "--prefix-lengths", "comma list of integers, got '1024,x'"),
        (["validate", "--budgets", "0.05,2"], "--budgets", "budget 2 is outside [0, 1]"),
        (["ttft", "--budgets", "half"], "--budgets", "budget 'half' is not a number"),
        (["arena", "run", "--budgets", "0.1,abc"], "--budgets", "'abc' is not a number"),
        (["arena", "run", "--lengths", "4k"], "--lengths", "comma list of integers"),
        (["plan", "--intervals", "1.5"], "--intervals", "comma list of integers"),
        (["plan", "--budgets", "7"], "--budgets", "outside [0, 1]"),
        (["vllm-bench", "--clients", "1,two"], "--clients", "comma list of integers"),
        (["vllm-bench", "--budgets", "adaptive,sometimes"], "--budgets", "'sometimes' is not a number"),
        (["vllm-bench", "--workloads", "rag-mix,nope,gone"], "--workloads", "unknown nope, gone (known: shared-system"),
        (["train", "RUN", "--schedule", "512:x"], "--schedule", "LENGTH:STEPS pairs"),
        (["train", "RUN", "--shape", "[1]"], "--shape", "a JSON object of config fields"),
    ],
)
def test_a_bad_value_is_a_one_line_error_naming_its_flag(argv, flag, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"hybridkv: error: argument {flag}: "), err
    assert says in err and err.endswith(" --help")


def test_comma_lists_parse_what_they_name():
    assert INTS("1, 2,,3,") == [1, 2, 3]
    assert NAMES("") == [] and NAMES("a, b") == ["a", "b"]
    assert BUDGETS("0.05,256tok") == [Budget(fraction=0.05), Budget(tokens=256)]
    assert comma_list(str, "colours", choices=("red", "blue"))("blue,red") == ["blue", "red"]


def test_a_field_without_a_flag_type_is_refused_where_the_parser_is_built():
    @dataclasses.dataclass
    class Odd:
        table: dict = dataclasses.field(default_factory=dict, metadata={"help": "a mapping"})

    with pytest.raises(TypeError, match=r"Odd.table: no flag type"):
        _add_fields(_build_parser(), Odd)


def test_arena_lists_given_explicitly_are_kept_whichever_engine(monkeypatch, tmp_path):
    """--methods and --budgets left out take the engine's defaults; given, even equal to the harness's
    defaults, they are what runs (they were once swapped for the served defaults by comparing values)."""
    from hybridkv.cli import main
    from hybridkv.errors import HybridKVError
    from hybridkv.models.tiny import WEIGHTS_DIR
    from hybridkv.serving import arena as served_arena

    planned = []

    def capture(model, tokenizer, samples, plan, *args, **kwargs):
        planned.append(([*plan.methods], [str(b) for b in plan.budgets]))
        raise HybridKVError("captured")

    monkeypatch.setattr(served_arena, "run_served_arena", capture)
    model = str(WEIGHTS_DIR / "tiny-qwen3-next-vllm")
    base = ["arena", "run", "--engine", "vllm", "--model", model, "--samples", "1", "--lengths", "1024",
            "--tasks", "niah_single_1", "--no-progress"]  # fmt: skip
    given = ["--methods", "no-context,full,zero-state,checkpoint,tail-replay", "--budgets", "0.05,0.1"]
    assert main([*base, "--out", str(tmp_path / "a"), *given]) == 2
    assert main([*base, "--out", str(tmp_path / "b")]) == 2
    assert planned == [
        (["no-context", "full", "zero-state", "checkpoint", "tail-replay"], ["0.05", "0.1"]),
        ([*served_arena.DEFAULT_SERVED_METHODS], [str(b) for b in served_arena.DEFAULT_SERVED_BUDGETS]),
    ]
