"""The boundary with transformers: typed containers and the splicing cache layers."""

from __future__ import annotations

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.cache import assemble_cache, capture_prompt
from hybridkv.models.adapter import (
    HybridCache,
    SplicingIndexedLayer,
    SplicingLayer,
    exact_kv_for_first_tokens,
    read_kv,
    read_states,
    write_kv,
)
from hybridkv.models.kv import LayerKV, PromptKV
from tests.conftest import random_tokens

# Qwen4-Exp: QSA indexer keys, and position ids kept on the cache object
NAMES = ["random-glm5-next", "random-qwen3-next", "random-nemotron-h", "family:qwen4_exp"]


def test_prompt_kv_slices_and_joins_without_the_model():
    layer = LayerKV(
        {"keys": torch.randn(1, 2, 10, 4), "values": torch.randn(1, 2, 10, 3), "indexer_keys": torch.randn(1, 10, 5)},
        {"keys": -2, "values": -2, "indexer_keys": 1},
    )
    kv = PromptKV({3: layer})
    assert len(kv) == 10
    joined = PromptKV.cat([kv.narrow(0, 4), kv.narrow(4, 7), kv.narrow(7, 10)])
    for name in layer:
        assert torch.equal(joined[3][name], layer[name])
    assert kv.narrow(2, 5)[3]["indexer_keys"].shape == (1, 3, 5)
    with pytest.raises(ValueError):
        kv.narrow(3, 11)


def test_layer_kv_refuses_tensors_of_different_lengths():
    with pytest.raises(ValueError, match="disagree"):
        LayerKV({"keys": torch.zeros(1, 1, 5, 2), "values": torch.zeros(1, 1, 6, 2)}, {"keys": -2, "values": -2})


@pytest.mark.parametrize("name", NAMES)
def test_caches_are_dynamic_caches_with_splicing_attention_layers(models, name):
    model = models[name]
    cache = model.new_cache()
    assert isinstance(cache, HybridCache)
    for index in model.description.attention_layers:
        expected = SplicingIndexedLayer if "indexer_keys" in model.description.token_tensors(index) else SplicingLayer
        assert type(cache.layers[index]) is expected


@pytest.mark.parametrize("call", ["positional", "keyword", "class"])
def test_the_splice_holds_however_update_is_called(call):
    layer = SplicingLayer()
    exact = torch.full((1, 2, 3, 4), 7.0)
    layer.pending = {"keys": (-2, [exact]), "values": (-2, [exact])}
    keys, values = torch.zeros(1, 2, 5, 4), torch.ones(1, 2, 5, 4)
    if call == "positional":
        layer.update(keys, values)
    elif call == "keyword":
        layer.update(key_states=keys, value_states=values)
    else:
        SplicingLayer.update(layer, keys, values)
    assert not layer.pending
    assert torch.equal(layer.keys[:, :, :3], exact) and torch.equal(layer.keys[:, :, 3:], keys[:, :, 3:])
    assert torch.equal(layer.values[:, :, :3], exact) and torch.equal(layer.values[:, :, 3:], values[:, :, 3:])
    assert torch.equal(keys, torch.zeros(1, 2, 5, 4))  # the model's own tensor is not written to


@pytest.mark.parametrize("name", NAMES)
def test_an_unconsumed_splice_fails_the_call(models, name):
    model = models[name]
    tokens = random_tokens(40, 3, model.config.vocab_size)
    cached = capture_prompt(model, tokens[:30])
    cache = assemble_cache(model, cached.kv_prefix(20), None)
    splice = exact_kv_for_first_tokens(model.description, cache, [cached.kv_range(20, 30)])
    with pytest.raises(HybridKVError, match="never taken"), splice:
        pass  # no forward: nothing takes the exact KV
    # the failed arming leaves nothing behind: the cache decodes as a plain cache
    assert all(not cache.layers[i].pending for i in model.description.attention_layers)
    model.forward(tokens[20:], cache, start=20)
    assert cache.get_seq_length() == 40


@pytest.mark.parametrize("name", NAMES)
def test_a_consumed_splice_stores_the_exact_kv(models, name):
    model = models[name]
    tokens = random_tokens(40, 4, model.config.vocab_size)
    cached = capture_prompt(model, tokens[:30])
    cache = assemble_cache(model, cached.kv_prefix(20), None)
    with exact_kv_for_first_tokens(model.description, cache, [cached.kv_range(20, 30)]):
        model.forward(tokens[20:], cache, start=20)
    held = read_kv(model.description, cache)
    assert len(held) == 40
    for index, layer in cached.attention.narrow(0, 30).items():
        for tensor_name, tensor in layer.items():
            assert torch.equal(held[index].narrow(0, 30)[tensor_name], tensor), (index, tensor_name)
    assert read_states(model.description, cache).keys() == set(model.description.linear_layers)


@pytest.mark.parametrize("key", ["zaya", "inkling"])
def test_a_sliding_window_layer_written_from_a_prefix_equals_a_forward_over_it(models, key):
    """Sliding layers keep every token's KV for the cached prompt, yet a cache rebuilt from any prefix
    holds exactly the window a forward over that prefix leaves (the KV the next tokens attend)."""
    model = models[f"family:{key}"]
    tokens = random_tokens(40, seed=3, vocab=model.config.vocab_size - 8)
    whole = model.new_cache()
    model.forward(tokens, whole, start=0)
    kv = read_kv(model.description, whole)
    assert all(len(layer) == 40 for _, layer in kv.items())  # every token, not only the window
    for length in (5, 23):  # inside and beyond the window of 8
        forward, written = model.new_cache(), model.new_cache()
        model.forward(tokens[:length], forward, start=0)
        write_kv(written, kv.narrow(0, length))
        for index in model.description.attention_layers:
            ours, theirs = written.layers[index], forward.layers[index]
            if theirs.is_sliding:
                assert theirs.keys.shape[-2] == min(length, theirs.sliding_window - 1)
            # the same tokens' KV from a 40-token and a shorter forward: float32 reassociation only
            torch.testing.assert_close(ours.keys, theirs.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(ours.values, theirs.values, rtol=0, atol=1e-5)
            assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
