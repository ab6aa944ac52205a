"""The architecture registry: one module per family, found from any config transformers writes."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from hybridkv import HybridKVError
from hybridkv.models.arch import ARCHITECTURES, architecture_for, by_name, cache_sizes, cost_model
from hybridkv.models.tiny import RANDOM_MODELS
from hybridkv.train.shapes import TRAINABLE


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_a_saved_config_finds_its_architecture(arch, tmp_path):
    arch.tiny_config().save_pretrained(tmp_path)
    assert architecture_for(AutoConfig.from_pretrained(tmp_path)) is arch
    assert by_name(arch.name) is arch
    assert RANDOM_MODELS[arch.random_name] is arch.tiny_config
    assert (arch.trained_name in TRAINABLE) == bool(arch.trained_shape)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.decay_probe], ids=lambda a: a.name)
def test_decay_probes_hook_every_linear_layer_and_no_other(models, arch):
    model = models[arch.random_name]
    linear = set(model.description.linear_layers)
    for index, layer in enumerate(model.backbone.layers):
        found = arch.decay_probe(layer)
        assert (found is not None) == (index in linear), index


def test_families_without_formulas_are_refused_by_name():
    olmo = by_name("olmo-hybrid").tiny_config()
    with pytest.raises(HybridKVError, match="olmo_hybrid"):
        cost_model(olmo)
    with pytest.raises(HybridKVError, match="olmo_hybrid"):
        cache_sizes(olmo)
    with pytest.raises(HybridKVError, match="unknown architecture"):
        by_name("mamba-3")
