"""bfloat16 on the CPU and the device plumbing (the GPU path itself runs in scripts/gpu/)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.cache import capture_prompt
from hybridkv.cache.prefix_cache import CachedMatch
from hybridkv.cli import main
from hybridkv.methods.base import Recipe, execute
from hybridkv.models import load_model

PROMPT, MATCHED, INTERVAL, KEEP = 200, 160, 32, 8


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute log-probability difference over the kept positions: a metric, so the
    triangle inequality below holds exactly (KL is not one)."""
    return float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max())


def _prefill_split(model, tokens: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """The prompt prefilled in passes that end at `cuts`, each continuing the last one's cache."""
    cache, bounds = model.new_cache(), [0, *cuts, tokens.numel()]
    for start, end in zip(bounds, bounds[1:], strict=False):
        logits = model.forward(tokens[start:end], cache, start, KEEP if end == tokens.numel() else 1)
    return logits


@pytest.mark.parametrize("name", ["tiny-glm5-next", "random-qwen3-next", "random-nemotron-h"])
def test_bfloat16_resumes_are_within_the_dtypes_own_noise(name):
    """In bfloat16 an exact resume cannot match full prefill bit for bit, and how far it may be
    is measured here, on this machine, not guessed.

    A bfloat16 GEMM rounds according to its shape and the kernel this CPU picks for it (AMX,
    AVX-512-bf16 and AVX2 round differently), so the same prompt prefilled in passes split at
    other positions already lands away from the one-pass prefill. The noise is the largest such
    distance over single splits every 16 tokens and over the checkpoint grid. A resume re-shapes
    the computation at most twice (the passes that built the cache, then the pass that continues
    it from the match), each change of the kind measured, so by the triangle inequality an exact
    resume lies within twice the noise. A resume that reads the wrong state or KV is not
    bounded by it: dropping the trained model's states lands far outside."""
    model = load_model(name, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    tokens = torch.randint(3, 500, (PROMPT,), generator=torch.Generator().manual_seed(0))
    full = model.forward(tokens, model.new_cache(), 0, KEEP)
    grid = list(range(INTERVAL, MATCHED + 1, INTERVAL))
    splits = [[cut] for cut in range(16, PROMPT - KEEP + 1, 16)] + [grid, grid[:-1]]
    noise = max(_distance(full, _prefill_split(model, tokens, cuts)) for cuts in splits)
    allowed = 2 * noise
    hit = CachedMatch(capture_prompt(model, tokens[:MATCHED], checkpoint_interval=INTERVAL), MATCHED)
    exact = (Recipe(MATCHED, 0), Recipe(MATCHED, MATCHED, True), Recipe(MATCHED, MATCHED - INTERVAL, True))
    for recipe in exact:
        distance = _distance(full, execute(model, tokens, hit, recipe, logits_to_keep=KEEP).logits)
        assert distance <= allowed, (recipe, distance, noise)
    # Seeded at the match itself, the resume runs exactly the passes of a prefill split on the
    # checkpoint grid: one code path, so equal bit for bit on any machine.
    seeded = execute(model, tokens, hit, Recipe(MATCHED, MATCHED, True), logits_to_keep=KEEP).logits
    assert torch.equal(seeded, _prefill_split(model, tokens, grid))
    if name == "tiny-glm5-next":  # the trained model needs its states: dropping them is far outside the noise
        dropped = execute(model, tokens, hit, Recipe(MATCHED, MATCHED), logits_to_keep=KEEP).logits
        assert _distance(full, dropped) > 10 * allowed


def test_validate_records_the_dtype_and_device_of_its_reference(tmp_path, capsys):
    out = tmp_path / "v"
    args = ["validate", "--model", "random-qwen3-next", "--prefix-lengths", "96", "--suffix-length", "8"]
    args += ["--budgets", "1.0", "--methods", "full,zero-state,tail-replay", "--repeats", "1", "--greedy-tokens", "2"]
    assert main([*args, "--dtype", "bfloat16", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["dtype"] == "bfloat16" and results["config"]["device"] == "cpu"
    assert "in bfloat16 on cpu" in results["reference"]
    assert "in bfloat16 on cpu" in (out / "report.md").read_text()
    rows = {row["method"]: row for row in results["rows"]}
    # How close bfloat16 resumes come to full prefill is the test above's; here only that the rows
    # were computed at all: replaying the whole prefix restores what dropping the states loses.
    assert rows["tail-replay"]["kl_mean"] < rows["zero-state"]["kl_mean"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_asking_for_cuda_without_one_is_a_one_line_error(capsys):
    assert main(["validate", "--model", "random-qwen3-next", "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv: error: --device cuda: no CUDA device") and "\n" not in err
