"""bfloat16 on the CPU and the device plumbing (the GPU path itself runs in scripts/gpu/)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.cache import capture_prompt
from hybridkv.cache.prefix_cache import Hit
from hybridkv.cli import main
from hybridkv.methods.base import Recipe, execute
from hybridkv.models import load_model

PROMPT, MATCHED, INTERVAL, KEEP = 200, 160, 32, 8


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).max())


@pytest.mark.parametrize("name", ["tiny-glm5-next", "random-qwen3-next", "random-nemotron-h"])
def test_bfloat16_resumes_are_within_the_dtypes_own_noise(name):
    """In bfloat16 an exact resume cannot match full prefill bit for bit (the passes are shaped
    differently), but it must stay within the noise bfloat16 itself adds to full prefill."""
    reference = load_model(name)
    model = load_model(name, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    tokens = torch.randint(3, 500, (PROMPT,), generator=torch.Generator().manual_seed(0))
    full = model.forward(tokens, model.new_cache(), 0, KEEP)
    noise = _kl(reference.forward(tokens, reference.new_cache(), 0, KEEP), full)
    allowed = 2 * noise + 1e-4
    hit = Hit(capture_prompt(model, tokens[:MATCHED], checkpoint_interval=INTERVAL), MATCHED)
    for recipe in (Recipe(MATCHED, 0), Recipe(MATCHED, MATCHED, True), Recipe(MATCHED, MATCHED - INTERVAL, True)):
        kl = _kl(full, execute(model, tokens, hit, recipe, logits_to_keep=KEEP).logits)
        assert kl <= allowed, (recipe, kl, noise)
    if name == "tiny-glm5-next":  # the trained model needs its states: dropping them is far outside the noise
        assert (
            _kl(full, execute(model, tokens, hit, Recipe(MATCHED, MATCHED), logits_to_keep=KEEP).logits) > 10 * allowed
        )


def test_validate_records_the_dtype_and_device_of_its_reference(tmp_path, capsys):
    out = tmp_path / "v"
    args = ["validate", "--model", "random-qwen3-next", "--prefix-lengths", "96", "--suffix-length", "8"]
    args += ["--budgets", "1.0", "--methods", "full,tail-replay", "--repeats", "1", "--greedy-tokens", "2"]
    assert main([*args, "--dtype", "bfloat16", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["dtype"] == "bfloat16" and results["config"]["device"] == "cpu"
    assert "in bfloat16 on cpu" in results["reference"]
    assert "in bfloat16 on cpu" in (out / "report.md").read_text()
    tail = next(row for row in results["rows"] if row["method"] == "tail-replay")
    assert tail["kl_mean"] < 1e-2  # whole-prefix replay, bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_asking_for_cuda_without_one_is_a_one_line_error(capsys):
    assert main(["validate", "--model", "random-qwen3-next", "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv: error: --device cuda: no CUDA device") and "\n" not in err
