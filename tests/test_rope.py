"""Moving cached keys: a re-rotated key equals the key computed at its new position."""

from __future__ import annotations

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.models.adapter import read_kv, shift_kv
from tests.conftest import random_tokens

# rotary attention (qwen3-next: partial RoPE; olmo-hybrid) and NoPE attention (the others)
NAMES = ["random-qwen3-next", "random-olmo-hybrid", "random-glm5-next", "random-kimi-linear", "random-nemotron-h"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("delta", [1, 37, 1000])
def test_shifted_keys_equal_keys_computed_at_the_new_position(models, name, delta):
    """The same tokens run from position 0 and from position δ (nothing cached before either, so
    every layer's input is the same): moving the first run's KV by δ must give the second's. For
    NoPE families this also checks that their keys really carry no position."""
    model = models[name]
    tokens = random_tokens(24, seed=4, vocab=model.config.vocab_size)
    here, there = model.new_cache(), model.new_cache()
    model.forward(tokens, here, start=0)
    model.forward(tokens, there, start=delta)
    moved, want = shift_kv(model, read_kv(model.description, here), delta), read_kv(model.description, there)
    # float32 rotation angles lose ~1e-7 of a radian per position: 1.5e-4 at δ = 1000 on keys of norm ~4
    tolerance = 1e-5 + 3e-7 * delta
    for index, layer in want.items():
        for tensor, expected in layer.items():
            torch.testing.assert_close(moved[index][tensor], expected, atol=tolerance, rtol=0, msg=f"{index} {tensor}")


def test_rotary_keys_do_move(models):
    model = models["random-qwen3-next"]
    cache = model.new_cache()
    model.forward(random_tokens(8, seed=1, vocab=model.config.vocab_size), cache, start=0)
    kv = read_kv(model.description, cache)
    index = model.description.attention_layers[0]
    assert (shift_kv(model, kv, 5)[index]["keys"] - kv[index]["keys"]).abs().max() > 1e-2


def test_a_family_without_a_known_shift_is_refused(models):
    model = models["family:bamba"]
    cache = model.new_cache()
    model.forward(random_tokens(8, seed=1, vocab=model.config.vocab_size), cache, start=0)
    with pytest.raises(HybridKVError, match="position correction is not known for bamba"):
        shift_kv(model, read_kv(model.description, cache), 3)
