"""Every hybrid family transformers implements: exact resumes, or a one-line refusal with the true reason.

Each family's tiny random checkpoint (`tests/families.py`) is saved by transformers itself and
loaded as a user's checkpoint directory. A supported family must pass the invariants every
method rests on; the others must be refused at load with the reason, never give wrong numbers.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv import HybridKVError
from hybridkv.cache import assemble_cache, capture_prompt
from hybridkv.cache.prefix_cache import CachedMatch
from hybridkv.methods.base import Recipe, execute
from hybridkv.methods.batch import execute_batch
from hybridkv.models import load_model
from tests.families import FAMILIES, save_random_checkpoint

SUPPORTED = [
    "qwen3_5",
    "qwen3_5-vl",
    "qwen3_5_moe",
    "qwen3_5_moe-vl",
    "granitemoehybrid",
    "bamba",
    "falcon_h1",  # parallel hybrid: attention and Mamba-2 side by side in every layer
    "zamba2",  # Mamba-2 layers and shared-attention hybrid layers
    "lfm2",  # short-conv layers: a conv window and no recurrent state
    "lfm2_moe",
    "lfm2_vl",  # multimodal only: loaded as image-text-to-text, its text decoder kept
    # parallel hybrids with sliding-window attention (window 8, inside the 40-token match)
    "zaya",  # convolved q/k (CCA) and a delayed value state in every layer
    "inkling",  # four short convolutions per layer
    "inkling-vl",
    "minimax",  # lightning attention: its own cache class (MiniMaxCache), states in our cache layers
    "qwen4_exp",  # QSA indexer keys and position ids on the cache object, PLE windows of token ids
    "qwen4_exp-vl",
]
REFUSED = {
    # transformers runs a multi-token forward of these from a zero SSM state, whatever the cache holds
    "jamba": "does not start a multi-token forward from the cached state",
    "zamba": "does not start a multi-token forward from the cached state",
    # its recurrent and conv states live on its modules, outside any cache
    "recurrent_gemma": "keeps state outside its cache layers",
}
PROMPT, MATCHED, INTERVAL = 48, 40, 8


def test_every_family_is_either_supported_or_refused():
    assert set(SUPPORTED) | set(REFUSED) == set(FAMILIES) and not set(SUPPORTED) & set(REFUSED)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def save(key: str):
        directory = tmp_path_factory.mktemp(key.replace("-", "_"))
        save_random_checkpoint(key, directory)
        return directory

    return save


@pytest.mark.parametrize("key", SUPPORTED)
def test_supported_family_resumes_exactly(checkpoint, key):
    model = load_model(str(checkpoint(key)))
    assert model.description.linear_layers and model.description.attention_layers
    tokens = torch.randint(3, model.config.vocab_size - 8, (PROMPT,), generator=torch.Generator().manual_seed(1))
    full = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=1)
    cached = capture_prompt(model, tokens[:MATCHED], checkpoint_interval=INTERVAL)
    hit = CachedMatch(cached, MATCHED)
    recipes = {
        "whole-prefix replay": Recipe(MATCHED, 0),  # exact KV, every state rebuilt from zero
        "checkpoint at the match": Recipe(MATCHED, MATCHED, state_seed=True),
        "continuation from a kept state": Recipe(MATCHED, MATCHED - INTERVAL, state_seed=True),
    }
    for name, recipe in recipes.items():
        outcome = execute(model, tokens, hit, recipe)
        torch.testing.assert_close(outcome.logits, full, atol=1e-4, rtol=0, msg=f"{key}: {name}")
        assert outcome.reused_tokens == MATCHED


def test_qwen4_exp_resumes_at_any_length_alone_or_batched(checkpoint):
    """Qwen4-Exp's QSA indexer pools blocks of `indexer_compress_ratio` tokens, its position ids live on
    the cache object and its n-gram context (a window of token ids) starts as end-of-sequence ids: a
    prefix of any length resumes exactly, ending inside a block or not, with EOS tokens (which reset the
    n-grams) in the prompt, alone or batched with left padding."""
    model = load_model(str(checkpoint("qwen4_exp")))
    eos = model.config.eos_token_id
    tokens = torch.randint(3, model.config.vocab_size - 8, (PROMPT,), generator=torch.Generator().manual_seed(2))
    tokens[[5, 17, 18, 30]] = eos
    full = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=PROMPT)
    # zero states, written: every position's logits as from a fresh cache
    from_zero = model.forward(tokens, assemble_cache(model, None, None), start=0, logits_to_keep=PROMPT)
    torch.testing.assert_close(from_zero, full, atol=1e-4, rtol=0)
    cached = capture_prompt(model, tokens[:MATCHED], checkpoint_interval=1)
    ratio = model.config.indexer_compress_ratio
    for matched in range(MATCHED - ratio, MATCHED):  # every remainder modulo the compress ratio
        keep = PROMPT - matched
        for recipe in (Recipe(matched, 0), Recipe(matched, matched, True), Recipe(matched, matched - 3, True)):
            outcome = execute(model, tokens, CachedMatch(cached, matched), recipe, logits_to_keep=keep)
            torch.testing.assert_close(outcome.logits, full[-keep:], atol=1e-4, rtol=0, msg=f"{matched}: {recipe}")
    # two rows, 2 tokens of left padding before the shorter one's KV
    prompts, recipes = [tokens, tokens[:-2]], [Recipe(39, 37, True), Recipe(37, 35, True)]
    outcomes = execute_batch(model, prompts, [CachedMatch(cached, 39), CachedMatch(cached, 37)], recipes)
    torch.testing.assert_close(outcomes[0].logits, full[-1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(outcomes[1].logits, full[-3:-2], atol=1e-4, rtol=0)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_unsupported_family_is_refused_with_its_reason(checkpoint, key):
    with pytest.raises(HybridKVError, match=REFUSED[key]) as refusal:
        load_model(str(checkpoint(key)))
    assert "\n" not in str(refusal.value)
