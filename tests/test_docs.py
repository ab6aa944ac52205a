"""The documentation stays true to the code: results/README.md is what its generator makes from the
folders' run.json, every `hybridkv` command quoted in README.md, docs/*.md and results/README.md
names a real subcommand and only flags its `--help` lists, and every relative link resolves inside
the repository. Fast: the help texts come from the parser in-process, nothing is run."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest

from hybridkv.cli import _build_parser
from hybridkv.report.results_index import INDEX_FILE, RESULTS, read_runs, render

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / INDEX_FILE]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
PINNED = re.compile(r"^\s*git checkout \S+ &&")  # a command of another revision's command line (results/README.md)


def _snippets(text: str) -> list[str]:
    """Shell snippets: every line of a fenced block (continuations joined, comments dropped) and every
    inline code span, split at `&&`, `;` and `|` unless the snippet runs at another revision."""
    snippets = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            snippets.append(re.sub(r"(^|\s)#\s.*$", "", line))
    snippets += [span.replace("\n", " ") for span in INLINE.findall(FENCE.sub("", text))]
    parts = []
    for snippet in snippets:
        if not PINNED.match(snippet):
            parts += re.split(r"&&|;|\|", snippet)
    return [part.strip() for part in parts if part.strip()]


def quoted_commands(text: str) -> list[list[str]]:
    """The arguments after `hybridkv` (or `.venv/bin/hybridkv`) of every command quoted in `text`."""
    commands = []
    for snippet in _snippets(text):
        try:
            tokens = shlex.split(snippet)
        except ValueError:  # an unbalanced quote in prose: whitespace will do
            tokens = snippet.split()
        for index, token in enumerate(tokens):
            if token == "hybridkv" or token.endswith("/hybridkv"):
                commands.append(tokens[index + 1 :])
                break
    return [command for command in commands if command]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve(args: list[str]) -> tuple[str, set[str]]:
    """The subcommand `args` names (e.g. "arena run") and the flags its `--help` lists."""
    parser, path = _build_parser(), []
    while args and (choices := _subcommands(parser)) and not args[0].startswith("-"):
        if args[0] not in choices:
            raise AssertionError(f"`hybridkv {' '.join([*path, args[0]])}`: no such subcommand")
        parser = choices[args[0]]
        path.append(args.pop(0))
    return " ".join(path), set(FLAG.findall(parser.format_help())) | {"--help"}


def test_results_index_is_generated() -> None:
    index = RESULTS / INDEX_FILE
    assert index.read_text(encoding="utf-8") == render(read_runs(RESULTS)), (
        f"{index} is out of date: run `.venv/bin/python -m hybridkv.report.results_index`"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_commands_use_real_flags(page: Path) -> None:
    commands = quoted_commands(page.read_text(encoding="utf-8"))
    assert commands, f"{page}: no hybridkv command found (is the parser still right?)"
    problems = []
    for args in commands:
        name, flags = resolve(list(args))
        quoted = {flag.split("=")[0] for token in args for flag in FLAG.findall(token.strip("[]"))}
        problems += [f"`hybridkv {name}` has no {flag}" for flag in sorted(quoted - flags)]
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_results_commands_parse() -> None:
    """Every command results/README.md lists for this checkout parses (the others name their revision)."""
    for run in read_runs(RESULTS):
        for command in run.commands if run.runs_at is None else ():
            args = shlex.split(command)
            if args[0] == "hybridkv":
                _build_parser().parse_args(args[1:])  # exits on an unknown flag or a bad value


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:|#", target):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links outside the repository or to nothing: {broken}"


# docs/design.md's picture: a package imports only packages of a lower layer (errors.py is everyone's).
LAYERS = {
    "models": 0,
    "store": 0,
    "cache": 1,
    "methods": 2,
    "eval": 3,
    "report": 4,
    "train": 4,
    "integrations": 4,
    "serving": 5,
}


def test_packages_import_only_lower_layers() -> None:
    wrong = []
    for package, layer in LAYERS.items():
        for path in sorted((ROOT / "hybridkv" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    parts = [*name.split("."), ""]
                    if parts[0] == "hybridkv" and parts[1] != package and LAYERS.get(parts[1], -1) >= layer:
                        wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "; ".join(wrong)


# What an architecture module may build on (docs/design.md): the registry and the loader come after it.
ARCH_DEPENDS_ON = {"hybridkv.errors", "hybridkv.models.arch.base", "hybridkv.models.cost", "hybridkv.models.gates",
                   "hybridkv.models.rope"}  # fmt: skip


def test_models_has_no_import_cycle_and_no_import_hidden_in_a_function() -> None:
    """models/ imports at module level only (an import inside a function is how a cycle hides), and
    the modules' import graph has no cycle; architecture modules build on ARCH_DEPENDS_ON alone."""
    graph: dict[str, set[str]] = {}
    hidden = []
    for path in sorted((ROOT / "hybridkv" / "models").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        graph[module] = {name for name in imports if name.startswith("hybridkv.models")} - {module}
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            hidden += [f"{module}.{function.name} imports {node.module}" for node in ast.walk(function)
                       if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridkv")]  # fmt: skip
        if module.startswith("hybridkv.models.arch.") and module != "hybridkv.models.arch.base":
            assert {n for n in imports if n.startswith("hybridkv")} <= ARCH_DEPENDS_ON, module
    assert not hidden, "; ".join(hidden)
    # A package's submodules import it first (its __init__), so `arch.x -> arch` is not a cycle.
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in edges.get(module, ()):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*path, module, dep])}"
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in edges:
        if module not in state:
            visit(module, [])


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_the_parser_finds_commands_and_flags() -> None:
    text = "```bash\nhybridkv arena run --lengths 4096 \\\n    --samples 2  # a comment --not-a-flag\n```\n"
    text += "Then `git checkout abc && hybridkv vllm-bench --gone 1`, `.venv/bin/hybridkv validate --bogus`."
    assert quoted_commands(text) == [["arena", "run", "--lengths", "4096", "--samples", "2"], ["validate", "--bogus"]]
    name, flags = resolve(["validate", "--bogus"])
    assert name == "validate" and "--prefix-lengths" in flags and "--bogus" not in flags
    with pytest.raises(AssertionError, match="no such subcommand"):
        resolve(["arena", "rnu"])
