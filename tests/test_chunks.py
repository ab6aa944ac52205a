"""Chunks encoded on their own: the maps that compose their linear states exactly, on every built-in family.

Invariants: each linear layer's map reproduces the layer's end state from any start state (the
layer's inputs held as they are); and on the first linear layer, whose inputs are the tokens' own,
composing separately encoded chunks (each started after a recomputed seam) equals running the
layer over their concatenation.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.cache.chunks import compose, encode_chunk
from hybridkv.models.adapter import read_kv, read_states, write_kv, write_states
from hybridkv.models.kv import LinearState, PromptKV
from tests.conftest import random_tokens

NAMES = ["random-glm5-next", "random-qwen3-next", "random-kimi-linear", "random-olmo-hybrid", "random-nemotron-h"]
SEAM = 8


@pytest.mark.parametrize("name", NAMES)
def test_each_layers_map_gives_its_end_state_from_any_start(models, name):
    model = models[name]
    tokens = random_tokens(40, seed=5, vocab=model.config.vocab_size)
    chunk = encode_chunk(model, tokens, seam=SEAM)
    assert set(chunk.maps) == set(model.description.linear_layers)
    cache = model.new_cache()
    model.forward(tokens[:SEAM], cache, start=0)
    kv, at_seam = read_kv(model.description, cache).clone(), read_states(model.description, cache)
    generator = torch.Generator().manual_seed(7)
    for layer, maps in chunk.maps.items():
        for slot, state_map in maps.items():
            start = torch.randn(at_seam[layer][slot].shape, generator=generator)
            run = model.new_cache()
            write_kv(run, kv)
            write_states(run, {**at_seam, layer: LinearState({**at_seam[layer].tensors, slot: start})})
            model.forward(tokens[SEAM:], run, start=SEAM)
            end = read_states(model.description, run)[layer][slot]
            torch.testing.assert_close(state_map.apply(start), end, atol=2e-4, rtol=1e-4, msg=f"layer {layer}")
        # from a zero start the map gives the natural run's end state only where the seam state was
        # zero anyway: not at the seam of a chunk in the middle, so nothing more to check here


# Random Qwen3-Next gates forget a start state within a few tokens and random Nemotron-H states are
# ~1e-5 in size, so over those a composition that ignored the carried state would pass unseen; the
# trained checkpoints carry state, as GLM, Kimi and OLMo do even at random.
COMPOSED = ["random-glm5-next", "tiny-qwen3-next", "random-kimi-linear", "random-olmo-hybrid", "tiny-nemotron-h"]


@pytest.mark.parametrize("name", COMPOSED)
def test_composed_chunks_equal_the_first_linear_layer_over_their_concatenation(models, name):
    model = models[name]
    vocab = model.config.vocab_size
    parts = [random_tokens(n, seed=20 + n, vocab=vocab) for n in (37, 11, 12)]
    whole = model.new_cache()
    model.forward(torch.cat(parts), whole, start=0)
    layer = model.description.linear_layers[0]
    assert layer == 0  # the layer whose inputs are the tokens' own, whatever came before
    truth = read_states(model.description, whole)[layer]

    chunks = [encode_chunk(model, part, seam=SEAM) for part in parts]
    states, kv, position = chunks[0].end_states, chunks[0].kv, len(chunks[0])
    for chunk in chunks[1:]:
        # the seam: the chunk's first tokens recomputed after what came before (its conv window carried)
        cache = model.new_cache()
        write_kv(cache, kv)
        write_states(cache, states)
        model.forward(chunk.tokens[:SEAM], cache, start=position)
        at_seam = read_states(model.description, cache)
        composed = {slot: compose([state_map], at_seam[layer][slot]) for slot, state_map in chunk.maps[layer].items()}
        # the next chunk continues from the composed recurrent state and this chunk's own conv tail
        states = {**chunk.end_states, layer: LinearState({**chunk.end_states[layer].tensors, **composed})}
        kv, position = PromptKV.cat([kv, chunk.kv]), position + len(chunk)
    for name_, tensor in truth.tensors.items():
        tolerance = 1e-4 * float(tensor.abs().max())  # float32 maps read off forwards, relative to the state
        torch.testing.assert_close(states[layer][name_], tensor, atol=tolerance, rtol=1e-4, msg=name_)
        if name_.startswith("recurrent"):
            # the test can fail: what the earlier chunks carried into the last one far exceeds the tolerance
            own = chunks[-1].end_states[layer][name_]
            assert float((tensor - own).abs().max()) > 20 * tolerance, "the start state leaves no trace"


@pytest.mark.parametrize("name", ["random-qwen3-next", "random-nemotron-h"])
def test_a_chunk_reports_the_bytes_of_each_part(models, name):
    model = models[name]
    chunk = encode_chunk(model, random_tokens(32, seed=1, vocab=model.config.vocab_size), seam=SEAM)
    parts = chunk.nbytes()
    assert parts["attention_kv"] == model.description.kv_bytes_per_token * 32
    assert parts["end_states"] + parts["conv_tails"] == model.description.state_bytes
    assert parts["operators"] > 0


def test_a_seam_outside_the_chunk_is_refused(models):
    model = models["random-qwen3-next"]
    with pytest.raises(ValueError, match="seam"):
        encode_chunk(model, random_tokens(8, seed=1, vocab=64), seam=8)
