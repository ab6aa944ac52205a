"""README §4's example method, taken from README.md as written: its class in a package of its own,
registered by its pyproject lines, found by name in `validate`, the arena and a served request. The
README cannot drift from what works: this fails when either block does."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from hybridkv.eval.arena import ArenaPlan, read_rows, run_arena
from hybridkv.eval.contract import ArenaConfig
from hybridkv.eval.validate import ValidateConfig, run_validate
from hybridkv.methods import PositionsMatch, Recipe, get_method
from hybridkv.models.tokenizer import ByteTokenizer
from tests.test_arena import contains_gold, samples

ROOT = Path(__file__).resolve().parents[1]


def readme_blocks() -> tuple[str, dict[str, str]]:
    """§4's Python block and the entry points its toml block registers."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## 4. Add a method") :]
    section = section[: section.index("\n## ", 1)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    toml = tomllib.loads(re.search(r"```toml\n(.*?)```", section, re.S).group(1))
    return code, toml["project"]["entry-points"]["hybridkv.recipes"]


@pytest.fixture
def last_128(tmp_path, monkeypatch):
    """The README's package, installed the way `pip install -e .` makes it visible: its modules and a
    dist-info with its entry points on the path, in this process and in any server it starts."""
    code, registered = readme_blocks()
    (name, target), = registered.items()  # fmt: skip
    module = target.split(":")[0]
    package = tmp_path / module.split(".")[0]
    package.mkdir()
    (package / "__init__.py").write_text("")
    (tmp_path / (module.replace(".", "/") + ".py")).write_text(code)
    info = tmp_path / "my_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[hybridkv.recipes]\n{name} = {target}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return name


def test_the_readme_method_runs_in_validate_and_the_arena(last_128, models, tmp_path):
    method = get_method(last_128)
    assert method.recipe(PositionsMatch(300), None) == Recipe(300, 172)
    model = models["random-olmo-hybrid"]
    config = ValidateConfig(prefix_lengths=[200], suffix_length=8, methods=["full", last_128], repeats=1,
                            greedy_tokens=2, checkpoint_interval=None)  # fmt: skip
    rows = {row["method"]: row for row in run_validate(model, config, show_progress=False)["rows"]}
    assert (rows[last_128]["reused_tokens"], rows[last_128]["replayed_tokens"]) == (200, 128)
    assert rows[last_128]["kl_mean"] > 1e-6 > rows["full"]["kl_mean"]  # states from zero: inexact on this model
    plan = ArenaPlan("toy", ["full", last_128], [])
    out = run_arena(model, ByteTokenizer(), samples(2), plan, ArenaConfig(max_new_tokens=2), tmp_path / "arena",
                    contains_gold, False)  # fmt: skip
    answered = [row for row in read_rows(out) if row["method"] == last_128]
    assert len(answered) == 2
    for row in answered:
        assert (row["reused_tokens"], row["replayed_tokens"]) == (row["context_tokens"], 128)


def test_the_readme_method_runs_in_vllm_serve(last_128, tmp_path):
    """The served arena lists it from its declaration, and the server (another process, which finds it
    through the same entry point) resumes each question 128 tokens before the stored context's end."""
    pytest.importorskip("vllm")
    from hybridkv.eval.workloads import get_workload
    from hybridkv.models.tiny import WEIGHTS_DIR
    from hybridkv.models.tokenizer import load_tokenizer
    from hybridkv.serving.arena import run_served_arena

    model = WEIGHTS_DIR / "tiny-qwen3-next-vllm"
    tokenizer = load_tokenizer(str(model))
    ruler = get_workload("ruler")
    needles = ruler.generate("niah_single_1", 1024, 2, tokenizer, 7)
    plan = ArenaPlan("ruler", [last_128], [])
    out = run_served_arena(str(model), tokenizer, needles, plan, tmp_path / "served", ruler.score, horizon=lambda: 0,
                           show_progress=False)  # fmt: skip
    rows = read_rows(out)
    assert len(rows) == 2 and {row["method"] for row in rows} == {last_128}
    for row in rows:
        context = row["context_tokens"]
        assert (row["matched_tokens"], row["reused_tokens"], row["replayed_tokens"]) == (context, context - 128, 128)
