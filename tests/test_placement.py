"""Placing a checkpoint: the memory arithmetic from headers and the meta device, and the spread path."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hybridkv import HybridKVError
from hybridkv.cache import capture_prompt
from hybridkv.cache.prefix_cache import CachedMatch
from hybridkv.methods.base import Recipe, execute
from hybridkv.models import load_model
from hybridkv.models.meta import cache_sizes, memory_plan
from hybridkv.models.placement import (
    GIB,
    USABLE,
    MemoryPlan,
    Placement,
    checkpoint_parameters,
    choose_placement,
)
from tests.families import FAMILIES, save_random_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5")
    save_random_checkpoint("qwen3_5", directory)
    return directory


def test_parameters_from_headers_equal_the_stored_tensors(checkpoint):
    stored = sum(t.numel() for f in checkpoint.glob("*.safetensors") for t in load_file(f).values())
    assert checkpoint_parameters(checkpoint) == stored


def test_the_plan_counts_weights_in_the_load_dtype_and_the_cache_at_the_context(checkpoint):
    config = FAMILIES["qwen3_5"]()
    sizes = cache_sizes(config, torch.bfloat16)
    plan = memory_plan(config, checkpoint_parameters(checkpoint), torch.bfloat16, context_tokens=1000)
    assert plan.weight_bytes == 2 * checkpoint_parameters(checkpoint)
    assert plan.cache_bytes == 2 * (1000 * sizes.kv_bytes_per_token + sizes.state_bytes_per_checkpoint)
    assert plan.total_bytes == plan.weight_bytes + plan.cache_bytes
    assert len(plan.lines()) == 4


def test_an_unreadable_header_is_refused_in_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(HybridKVError, match="unreadable safetensors header") as refusal:
        checkpoint_parameters(tmp_path)
    assert "\n" not in str(refusal.value)
    with pytest.raises(HybridKVError, match="no \\*.safetensors"):
        checkpoint_parameters(tmp_path / "missing")


def test_placement_picks_one_gpu_when_it_fits_and_spreads_only_when_it_must():
    plan = MemoryPlan(weight_bytes=30 * GIB, kv_bytes_per_token=2**20, state_bytes=GIB, context_tokens=4096)
    assert choose_placement(plan, []).device == torch.device("cpu")
    one = choose_placement(plan, [20 * GIB, 80 * GIB])  # the roomier GPU, alone
    assert one.device == torch.device("cuda:1") and one.device_map is None
    spread = choose_placement(plan, [30 * GIB, 30 * GIB])
    assert spread.device_map == "auto" and set(spread.max_memory) == {0, 1}
    # the weights fit the caps, and what the caps leave holds the cache
    assert sum(spread.max_memory.values()) >= plan.weight_bytes
    assert sum(int(f * USABLE) for f in (30 * GIB, 30 * GIB)) - sum(spread.max_memory.values()) >= plan.cache_bytes - 2
    with pytest.raises(HybridKVError, match="GiB usable") as refusal:
        choose_placement(plan, [10 * GIB, 10 * GIB])
    assert "\n" not in str(refusal.value)


def test_a_spread_checkpoint_resumes_exactly(checkpoint):
    """The path a multi-GPU model takes (transformers' device_map, per-layer cache devices), here with
    the CPU as the only device: the resume invariants hold on it as on a model moved whole."""
    model = load_model(str(checkpoint), device=Placement(torch.device("cpu"), device_map="auto"))
    assert model.layer_devices is not None and set(model.layer_devices) == set(range(model.description.num_layers))
    tokens = torch.randint(3, 500, (48,), generator=torch.Generator().manual_seed(2))
    full = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=1)
    hit = CachedMatch(capture_prompt(model, tokens[:40], checkpoint_interval=8), 40)
    for recipe in (Recipe(40, 0), Recipe(40, 40, state_seed=True), Recipe(40, 32, state_seed=True)):
        torch.testing.assert_close(execute(model, tokens, hit, recipe).logits, full, atol=1e-4, rtol=0)


def test_only_a_checkpoint_directory_is_spread():
    with pytest.raises(HybridKVError, match="checkpoint directory"):
        load_model("random-qwen3-next", device=Placement(torch.device("cpu"), device_map="auto"))
