"""The architecture registry: one module per family, found from any config transformers writes."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from hybridkv import HybridKVError
from hybridkv.models.arch import ARCHITECTURES, architecture_for, by_name
from hybridkv.models.meta import cache_sizes, cost_model
from hybridkv.models.tiny import RANDOM_MODELS
from hybridkv.train.shapes import TRAINABLE
from tests.families import FAMILIES

# tests/families.py's supported checkpoints -> the architecture module that must claim them
FAMILY_ARCHITECTURES = {
    "qwen3_5": "qwen3-5",
    "qwen3_5-vl": "qwen3-5",
    "qwen3_5_moe": "qwen3-5",
    "qwen3_5_moe-vl": "qwen3-5",
    "granitemoehybrid": "granite-4",
    "bamba": "bamba",
    "falcon_h1": "falcon-h1",
    "zamba2": "zamba2",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2",
    "lfm2_vl": "lfm2",
    "zaya": "zaya",
    "inkling": "inkling",
    "inkling-vl": "inkling",
    "minimax": "minimax",
    "qwen4_exp": "qwen4-exp",
    "qwen4_exp-vl": "qwen4-exp",
}
BUILT_IN = [a for a in ARCHITECTURES if a.tiny_config is not None]


@pytest.mark.parametrize("arch", BUILT_IN, ids=lambda a: a.name)
def test_a_saved_built_in_config_finds_its_architecture(arch, tmp_path):
    arch.tiny_config().save_pretrained(tmp_path)
    assert architecture_for(AutoConfig.from_pretrained(tmp_path)) is arch
    assert by_name(arch.name) is arch
    assert RANDOM_MODELS[arch.random_name] is arch.tiny_config
    assert (arch.trained_name in TRAINABLE) == bool(arch.trained_shape)


@pytest.mark.parametrize("key", sorted(FAMILY_ARCHITECTURES))
def test_a_family_checkpoints_config_finds_its_architecture(key):
    assert architecture_for(FAMILIES[key]()) is by_name(FAMILY_ARCHITECTURES[key])


def _probed() -> list[str]:
    names = [a.random_name for a in BUILT_IN if a.decay_probe]
    families = {}
    for key, arch in FAMILY_ARCHITECTURES.items():  # one checkpoint per architecture
        families.setdefault(arch, f"family:{key}")
    return names + list(families.values())


@pytest.mark.parametrize("name", _probed())
def test_decay_probes_hook_every_linear_layer_and_no_other(models, name):
    model = models[name]
    arch = architecture_for(model.config)
    linear = set(model.description.linear_layers)
    for index, layer in enumerate(model.backbone.layers):
        found = arch.decay_probe(layer)
        assert (found is not None) == (index in linear), index


@pytest.mark.parametrize("key", sorted(FAMILY_ARCHITECTURES))
def test_every_supported_family_has_config_only_sizes_and_costs(key):
    """`hybridkv plan` speaks about any supported checkpoint without its weights (meta device)."""
    config = FAMILIES[key]()
    sizes = cache_sizes(config)
    costs = cost_model(config)
    assert sizes.linear_layers > 0 and sizes.attention_layers > 0
    assert len(costs.layers) == config.get_text_config().num_hidden_layers
    assert sum(layer.kv_bytes_per_token for layer in costs.layers) == sizes.kv_bytes_per_token
    assert costs.prefill_flops(0, 4096) > costs.prefill_flops(4000, 4096) > 0


def test_a_config_that_cannot_be_described_is_refused_by_name():
    with pytest.raises(HybridKVError, match="recurrent_gemma.*no linear-attention"):
        cache_sizes(FAMILIES["recurrent_gemma"]())
    with pytest.raises(HybridKVError, match="unknown architecture"):
        by_name("mamba-3")
