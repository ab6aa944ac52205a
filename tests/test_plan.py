"""The config-only cost model and `hybridkv plan`."""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.cli import main
from hybridkv.eval.plan import Deployment, load_config, make_plan
from hybridkv.models.arch import ARCHITECTURES
from hybridkv.models.cost import H200, LayerCost, _attended
from hybridkv.models.meta import cache_sizes, cost_model


@pytest.mark.parametrize("cap", [None, 1, 7, 50, 1000])
def test_attended_tokens_closed_form_equals_the_sum(cap):
    for start, end in [(0, 0), (0, 1), (0, 64), (10, 64), (49, 51), (63, 200)]:
        brute = sum(min(p + 1, cap) if cap else p + 1 for p in range(start, end))
        assert _attended(start, end, cap) == brute


@pytest.mark.parametrize("model", ["glm-5.3-flash", "random-glm5-next", "random-qwen3-next"])
def test_prefill_cost_splits_at_any_position(model):
    costs = cost_model(load_config(model))
    for split in (1, 777, 2048, 5000):
        whole = costs.prefill_flops(0, 6000)
        parts = costs.prefill_flops(0, split) + costs.prefill_flops(split, 6000) - costs.head_flops
        assert parts == pytest.approx(whole, rel=1e-12)
    assert costs.speedup_bound(6000, 0) == 1.0


def test_dense_attention_lifts_the_dsa_cap_and_costs_more_at_long_contexts():
    sparse = cost_model(load_config("glm-5.3-flash"))
    dense = cost_model(load_config("glm-5.3-flash"), dense_attention=True)
    assert dense.prefill_flops(0, 1024) == sparse.prefill_flops(0, 1024)  # below index_topk: the same
    assert dense.prefill_flops(0, 32768) > sparse.prefill_flops(0, 32768)


def test_dsa_caps_attention_but_not_the_indexer():
    capped = LayerCost("attention", 0.0, flops_per_context_token=1.0, max_attended=100)
    indexer = LayerCost("attention", 0.0, flops_per_pooled_token=1.0)
    assert _attended(1000, 1001, capped.max_attended) == 100
    assert _attended(1000, 1001, indexer.max_attended) == 1001


def test_glm_plan_matches_hand_arithmetic():
    plan = make_plan("glm-5.3-flash", Deployment(prefix_lengths=(32768,), intervals=(3584,), budgets=("0.05",)))
    per_layer_kv = (512 + 0 + 2 * 128 + 1) * 2  # MLA latent + DSA indexer key/gate/flag, bf16
    state = 64 * 128 * 128 * 4 + 3 * 64 * 128 * 4 * 2  # KDA recurrent (float32) + q/k/v short-conv windows
    assert plan.kv_bytes_per_token == 11 * per_layer_kv == 16918
    assert plan.state_bytes_per_checkpoint == 34 * state
    schemes = {s["scheme"]: s for s in plan.schemes}
    assert schemes["tail-replay"]["bytes_per_prefix"] == 32768 * 16918
    assert schemes["checkpoint-every-3584"]["bytes_per_prefix"] == 32768 * 16918 + 9 * 34 * state
    assert schemes["tail-replay"]["total_bytes"] == 600 * 32768 * 16918  # 1 new prefix/s kept 600 s
    predictions = {(p["method"], p["budget"]): p for p in plan.predictions}
    assert predictions[("tail-replay", "0.05")]["recomputed_tokens"] == 64 + round(0.05 * 32768)
    assert predictions[("checkpoint-every-3584", None)]["recomputed_tokens"] == 64 + 32768 - 9 * 3584


def test_predicted_speedups_order_as_the_recomputed_tokens():
    plan = make_plan("glm-5.3-flash", Deployment(prefix_lengths=(16384,), budgets=("0.02", "0.05", "0.1")))
    ordered = sorted(plan.predictions, key=lambda p: p["recomputed_tokens"])
    speedups = [p["predicted_speedup"] for p in ordered]
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] == 1.0


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.tiny_config], ids=lambda a: a.name)
def test_config_only_cache_sizes_match_the_loaded_tiny_model(models, arch):
    """The sizes quoted for full-size models (meta device, no weights) equal what a real model caches."""
    model = models[arch.random_name]
    sizes = cache_sizes(model.config, torch.float32)  # the tiny models run in float32
    description = model.description
    assert (sizes.linear_layers, sizes.attention_layers) == (
        len(description.linear_layers),
        len(description.attention_layers),
    )
    assert sizes.kv_bytes_per_token == description.kv_bytes_per_token
    assert sizes.state_bytes_per_checkpoint == description.state_bytes


def test_plan_cli_json_and_errors(capsys, tmp_path):
    assert main(["plan", "--json", "--prefix-lengths", "8192", "--budgets", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"model", "kv_bytes_per_token", "state_bytes_per_checkpoint", "linear_layers", "attention_layers",
            "schemes", "predictions"} <= set(out)  # fmt: skip
    assert main(["plan", "--json", "--model", "random-olmo-hybrid"]) == 0  # the generic cost model
    olmo = load_config("random-olmo-hybrid")
    assert json.loads(capsys.readouterr().out)["linear_layers"] == olmo.layer_types.count("linear_attention")
    assert main(["plan", "--budgets", "7"]) == 2
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "cannot read its config" in capsys.readouterr().err


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.tiny_config], ids=lambda a: a.name)
def test_weights_read_by_a_large_call_are_the_models_own_parameters(models, arch):
    """Every expert touched: the cost model's weight bytes (the family's own, or the generic one
    built on the meta device) equal the loaded model's matrices."""
    name = arch.random_name
    model = models[name]
    costs = cost_model(model.config)
    predicted = sum(layer.weights_read(10**7) for layer in costs.layers) + costs.head_bytes
    matrices = sum(p.numel() for n, p in model.backbone.named_parameters() if p.dim() >= 2 and "embed" not in n)
    matrices += model.lm_head.weight.numel()
    # bf16; vectors (norms, biases, gates) are under 1%: the generic model counts them, the own ones do not
    assert predicted / 2 == pytest.approx(matrices, rel=1e-2)


def test_roofline_time_is_the_slower_of_compute_and_memory():
    costs = cost_model(load_config("glm-5.3-flash"))
    machine = H200
    for start, end in [(0, 32768), (32704, 32768), (0, 1), (31000, 32768)]:
        compute = costs.prefill_flops(start, end) / machine.flops_per_s
        memory = costs.prefill_bytes(start, end) / machine.bytes_per_s
        assert costs.seconds(start, end, machine) == max(compute, memory)
    # a 64-token call on a 313B-parameter MoE mostly reads weights; a 32K prefill mostly computes
    assert costs.prefill_bytes(32704, 32768) / H200.bytes_per_s > costs.prefill_flops(32704, 32768) / H200.flops_per_s
    assert costs.prefill_flops(0, 32768) / H200.flops_per_s > costs.prefill_bytes(0, 32768) / H200.bytes_per_s
    # more tokens never read fewer experts, and a call never reads more than all of them
    layer = costs.layers[-1]
    reads = [layer.weights_read(n) for n in (1, 8, 64, 4096)]
    assert reads == sorted(reads) and reads[-1] <= layer.weight_bytes + layer.expert_bytes * layer.experts


def test_plan_reports_the_roofline_beside_the_flop_ratio():
    plan = make_plan("glm-5.3-flash", Deployment(prefix_lengths=(32768,)))
    for p in plan.predictions:
        assert 1.0 <= p["roofline_speedup"] <= p["predicted_speedup"] * (1 + 1e-9), p
