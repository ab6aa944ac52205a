"""`hybridkv calibrate`: a model's forgetting horizon from its own gates."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.errors import HybridKVError
from hybridkv.eval.calibrate import CalibrateConfig, Calibration, calibrate, sample_prompts, shortest_tails
from hybridkv.models.decay import DecaySummary, record_decay, summarise


def test_shortest_tails_follow_the_decay_by_hand():
    """Layer 0 keeps half its state per 64-token chunk: 0.5^7 < 0.01 <= 0.5^6, so 7 chunks; layer 1
    never forgets, so no tail short of the whole history gets there."""
    chunks = 16
    log_decay = torch.zeros(chunks, 2, 1)
    log_decay[:, 0, 0] = math.log(0.5)
    tails = shortest_tails(DecaySummary(log_decay, 64), 0.01)
    assert tails[0] == [7 * 64.0] * 9  # ends 512, 576, ..., 1024 (the second half)
    assert tails[1] == [math.inf] * 9


def test_a_calibrated_horizon_holds_on_prompts_it_did_not_see(models):
    """Measured on two prompts of the trained Gated DeltaNet model, the horizon bounds a zeroed
    state's share below the tolerance at (nearly) every position of a third, unseen prompt."""
    model = models["tiny-qwen3-next"]
    result = calibrate(model, CalibrateConfig(tokens=1024, samples=2, tolerance=0.01, quantile=0.95))
    assert result.text == "essay text" and len(result.layers) == len(model.description.linear_layers)
    assert result.horizon is not None and result.horizon == max(result.layers)
    fresh, _ = sample_prompts(model, 1024, 3, seed=1)  # prompts 3-5: none of the two calibrated on
    with torch.inference_mode(), record_decay(model) as gates:
        model.forward(fresh[0], model.new_cache(), start=0)
    summary = summarise(gates)
    ends = range(512 + result.horizon, 1025, 64)
    held = [summary.bound(end - result.horizon, end) < 0.01 for end in ends]
    assert sum(held) >= 0.8 * len(held)


def test_a_calibration_file_round_trips_and_a_bad_one_is_refused(tmp_path):
    made = Calibration("m", 0.01, 0.95, 1024, 2, "random token ids", None, [64, None])
    assert Calibration.read(made.write(tmp_path / "c.json")) == made
    (tmp_path / "bad.json").write_text('{"horizon": 3}')
    with pytest.raises(HybridKVError, match="not a hybridkv calibration"):
        Calibration.read(tmp_path / "bad.json")
    with pytest.raises(HybridKVError, match="run hybridkv calibrate"):
        Calibration.read(tmp_path / "missing.json")
