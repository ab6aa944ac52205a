"""Loading tiny and on-disk hybrid models, and what their description claims about the cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hybridkv import HybridKVError
from hybridkv.models import RANDOM_MODELS, load_model
from hybridkv.models.arch import TINY_VOCAB

NAMES = list(RANDOM_MODELS)

# What each architecture's config calls a layer -> the kind hybridkv should report.
PATTERN_KINDS = {
    "linear_attention": "linear",
    "mamba": "linear",
    "full_attention": "attention",
    "attention": "attention",
    "indexed_attention": "indexed_attention",
    "mlp": "none",
    "moe": "none",
}


def _config_pattern(config) -> list[str]:
    if config.model_type == "nemotron_h":
        return list(config.layers_block_type)
    return list(config.layer_types)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (n,), generator=generator)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _forwarded_cache(model, n: int, seed: int = 0) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.backbone(input_ids=_tokens(n, seed).unsqueeze(0), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_is_hybrid(models, name):
    model = models[name]
    description = model.description
    assert description.linear_layers, "a hybrid model needs linear/state-space layers"
    assert description.attention_layers, "a hybrid model needs attention layers"
    assert set(description.linear_layers).isdisjoint(description.attention_layers)
    assert description.num_layers == len(model.backbone.layers)
    assert [spec.index for spec in description.layers] == list(range(description.num_layers))
    assert description.parameters >= description.active_parameters > 0


@pytest.mark.parametrize("name", NAMES)
def test_layer_kinds_match_config_pattern(models, name):
    model = models[name]
    pattern = _config_pattern(model.config)
    expected = [PATTERN_KINDS[layer_type] for layer_type in pattern]
    assert [spec.kind for spec in model.description.layers] == expected


@pytest.mark.parametrize("name", NAMES)
def test_linear_and_attention_specs_are_consistent(models, name):
    for spec in models[name].description.layers:
        if spec.kind == "linear":
            assert spec.state_bytes > 0 and spec.kv_bytes_per_token == 0
            # the five built-ins each keep one conv window and one recurrent state per linear layer
            assert [name for name, _, _ in spec.state_tensors] == ["conv.0", "recurrent.0"]
            assert not spec.token_dims
        elif spec.kind in ("attention", "indexed_attention"):
            assert spec.kv_bytes_per_token > 0 and spec.state_bytes == 0
            assert dict(spec.token_dims).keys() >= {"keys", "values"} and not spec.state_tensors
        else:
            assert spec.state_bytes == 0 and spec.kv_bytes_per_token == 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_tokens", [19, 53])
def test_state_bytes_match_a_real_cache(models, name, n_tokens):
    model = models[name]
    cache = _forwarded_cache(model, n_tokens)
    measured = 0
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            # every state slot the layer keeps, not only slot 0
            measured += sum(_nbytes(t) for t in layer.conv_states.values())
            measured += sum(_nbytes(t) for t in layer.recurrent_states.values())
    assert measured > 0
    assert model.description.state_bytes == measured


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_tokens", [19, 53])
def test_kv_bytes_per_token_match_a_real_cache(models, name, n_tokens):
    model = models[name]
    cache = _forwarded_cache(model, n_tokens)
    measured = 0
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        # every tensor an attention layer holds (keys, values, DSA indexer keys, ...)
        measured += sum(_nbytes(v) for v in vars(layer).values() if torch.is_tensor(v))
    assert measured > 0
    assert model.description.kv_bytes_per_token * n_tokens == measured


def _all_tensors(model) -> dict[str, torch.Tensor]:
    tensors = {f"backbone.{k}": v for k, v in model.backbone.state_dict().items()}
    tensors.update({f"lm_head.{k}": v for k, v in model.lm_head.state_dict().items()})
    return tensors


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_weights_different_seed_different(models, name):
    first = _all_tensors(models[name])  # seed 0
    again = _all_tensors(load_model(name, seed=0))
    assert first.keys() == again.keys()
    for key in first:
        assert torch.equal(first[key], again[key]), key
    other = _all_tensors(load_model(name, seed=1))
    assert other.keys() == first.keys()
    differing = [key for key in first if not torch.equal(first[key], other[key])]
    assert "lm_head.weight" in differing
    assert any(key.startswith("backbone.") for key in differing)


def test_unknown_model_name():
    with pytest.raises(HybridKVError, match="tiny-no-such-model"):
        load_model("tiny-no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(HybridKVError, match="config.json"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "config_text",
    [
        "{not json",
        json.dumps({"model_type": "no_such_architecture_xyz"}),
        json.dumps({}),
        json.dumps([]),  # valid JSON, but not a config object
    ],
)
def test_broken_config_raises_hybridkv_error(tmp_path, config_text):
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(HybridKVError):
        load_model(str(tmp_path))


def test_config_without_weights_raises_hybridkv_error(tmp_path):
    RANDOM_MODELS["random-qwen3-next"]().save_pretrained(tmp_path)
    with pytest.raises(HybridKVError):
        load_model(str(tmp_path))


def test_bare_glm5_text_checkpoint_is_refused(tmp_path):
    RANDOM_MODELS["random-glm5-next"]().save_pretrained(tmp_path)
    with pytest.raises(HybridKVError, match="bare text-decoder checkpoint needs model.safetensors"):
        load_model(str(tmp_path))


def test_plain_transformer_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(HybridKVError, match="no linear"):
        load_model(str(tmp_path))


def _hybrid_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model.forward(tokens, model.new_cache(), start=0, logits_to_keep=tokens.numel())


def test_sharded_qwen3_next_checkpoint_matches_in_memory_model(tmp_path):
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(7)
    reference = Qwen3NextForCausalLM(RANDOM_MODELS["random-qwen3-next"]()).eval()
    reference.save_pretrained(tmp_path, max_shard_size="1MB")
    shards = list(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1, "the checkpoint should be sharded"

    loaded = load_model(str(tmp_path))
    assert loaded.config.model_type == "qwen3_next"
    tokens = _tokens(40, seed=3)
    with torch.inference_mode():
        expected = reference(input_ids=tokens.unsqueeze(0)).logits[0].float()
    got = _hybrid_logits(loaded, tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # and it is not simply the seed-0 built-in model
    builtin = load_model("random-qwen3-next")
    assert not torch.allclose(_hybrid_logits(builtin, tokens), expected, atol=1e-3)


def test_glm5_multimodal_checkpoint_loads_text_decoder(tmp_path):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    text_config = RANDOM_MODELS["random-glm5-next"]().to_dict()
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": text_config["hidden_size"],
        "projection_intermediate_size": 64,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Glm5NextConfig(text_config=text_config, vision_config=vision_config)
    torch.manual_seed(11)
    full = Glm5NextForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path, max_shard_size="1MB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "the checkpoint should be sharded"

    loaded = load_model(str(tmp_path))
    assert loaded.config.model_type == "glm5_next_text"
    assert {spec.kind for spec in loaded.description.layers} == {"linear", "indexed_attention"}

    tokens = _tokens(40, seed=5)
    with torch.inference_mode():
        hidden = full.model.language_model(input_ids=tokens.unsqueeze(0)).last_hidden_state
        expected = full.lm_head(hidden)[0].float()
    got = _hybrid_logits(loaded, tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_logits_to_keep_returns_the_last_positions(models):
    model = models["random-olmo-hybrid"]
    tokens = _tokens(30, seed=9)
    all_logits = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=30)
    last = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=4)
    assert all_logits.shape == (30, TINY_VOCAB) and all_logits.dtype == torch.float32
    torch.testing.assert_close(last, all_logits[-4:], atol=1e-5, rtol=0)
    assert model.forward(tokens, model.new_cache(), start=0, logits_to_keep=0) is None


def test_glm5_sparse_attention_is_chunk_invariant_only_up_to_index_topk(models):
    """transformers' DSA indexer picks top-k key pools; beyond index_topk the pick can change
    when the prompt is split into prefix + suffix passes, so glm5 exactness tests stay ≤ 256."""
    model = models["random-glm5-next"]
    topk = model.config.index_topk
    assert topk == 256

    def split_vs_one_pass(tokens: torch.Tensor, split: int) -> float:
        keep = tokens.numel() - split
        one = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=keep)
        cache = model.new_cache()
        model.forward(tokens[:split], cache, start=0)
        two = model.forward(tokens[split:], cache, start=split, logits_to_keep=keep)
        return (one - two).abs().max().item()

    long_diffs, short_diffs = [], []
    for seed in (100, 101, 103):
        tokens = _tokens(600, seed=seed)
        long_diffs.append(split_vs_one_pass(tokens, 300))
        short_diffs.append(split_vs_one_pass(tokens[:topk], 128))
        short_diffs.append(split_vs_one_pass(tokens[:200], 77))
    # Whether the top-k pick flips is prompt-dependent; on these prompts it does, by far more
    # than float noise, while short prompts (every pool selected) agree to float precision.
    assert max(long_diffs) > 1e-3, long_diffs
    assert max(short_diffs) < 1e-4, short_diffs


def test_glm5_3_flash_cache_sizes():
    """GLM-5.3-Flash's sizes from its config (the formulas are checked against the tiny model in test_plan)."""
    from hybridkv.models.arch import glm5_next

    full = glm5_next.cache_sizes()  # GLM-5.3-Flash: 34 KDA + 11 MLA/DSA layers
    assert (full.linear_layers, full.attention_layers) == (34, 11)
    assert full.kv_bytes_per_token_per_layer == (512 + 0 + 2 * 128 + 1) * 2  # latent + indexer key, bf16
    assert full.state_bytes_per_layer == 64 * 128 * 128 * 4 + 3 * 64 * 128 * 4 * 2
    # the library's own modules at full size, on the meta device, cache exactly that
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    from hybridkv.models.meta import cache_sizes

    meta = cache_sizes(Glm5NextTextConfig())
    assert (meta.linear_layers, meta.attention_layers) == (34, 11)
    assert (meta.kv_bytes_per_token, meta.state_bytes_per_checkpoint) == (
        full.kv_bytes_per_token,
        full.state_bytes_per_checkpoint,
    )
