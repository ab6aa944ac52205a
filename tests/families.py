"""Tiny random-weight configs for the hybrid model families transformers implements beyond the built-ins.

`tests/test_families.py` saves a random checkpoint of each (as a user's checkpoint would arrive:
`save_pretrained` of the library's own class) and runs the resume invariants on it, or checks the
reason hybridkv gives for refusing it.

Every builder returns a *fresh* config: vocab_size=512, hidden 64, 4 layers (Zamba/Zamba2: 6), few heads,
<=4 experts where the family is MoE, max_position_embeddings >= 4096, special token ids inside the vocabulary
(pad=0, bos=1, eos=2; multimodal placeholder tokens use the top of the vocabulary, 506..511).

Each layer pattern is set explicitly and mixes at least one attention layer with at least one
linear-attention / SSM / recurrent / conv layer.  Families whose *every* layer is a fused
"hybrid" block (falcon_h1, zaya, inkling) are noted inline.

CUDA kernels: in transformers 5.x `use_mamba_kernels` is deprecated and a no-op (it only logs a warning); the
implementation is picked automatically (Hub kernels only with `use_kernels=True`, then mamba-ssm / causal-conv1d /
flash-linear-attention if installed, else the pure PyTorch path).  So we do not pass it; on a CPU-only environment
without those packages everything runs through the torch fallbacks.  Jamba's `use_mambapy` stays False.

Keys:  <model_type>            text / causal-LM layout   (AutoModelForCausalLM)
       <model_type>-vl         multimodal layout          (AutoModelForImageTextToText)
       lfm2_vl                 multimodal only            (AutoModelForImageTextToText)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BambaConfig,
    FalconH1Config,
    GraniteMoeHybridConfig,
    InklingConfig,
    InklingTextConfig,
    JambaConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    Lfm2VlConfig,
    MiniMaxConfig,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen4ExpConfig,
    Qwen4ExpTextConfig,
    RecurrentGemmaConfig,
    Siglip2VisionConfig,
    Zamba2Config,
    ZambaConfig,
    ZayaConfig,
)

VOCAB = 512
HIDDEN = 64
MAX_POS = 4096
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# multimodal placeholder ids (top of the vocab)
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END, AUDIO_TOKEN, AUDIO_BOS = 506, 507, 508, 509, 510, 511

_A, _L = "full_attention", "linear_attention"


def _common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=MAX_POS, **TOKENS, **kw)


# --------------------------------------------------------------------------------------------- Qwen3.5 (GDN)
def _qwen_rope():
    # head_dim 32 * partial_rotary_factor 0.25 = 8 rotary dims -> 4 freqs = sum(mrope_section)
    return {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }


def _qwen_linear_attn():
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


def _qwen_vision(cls_kwargs=None):
    return dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=HIDDEN,
        num_position_embeddings=64,  # 8x8 learned grid (must be a perfect square)
        **(cls_kwargs or {}),
    )


def _qwen_mm_ids():
    return dict(
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


def qwen3_5_text() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=[_L, _L, _L, _A],
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=_qwen_rope(),
        **_qwen_linear_attn(),
    )


def qwen3_5_vl() -> Qwen3_5Config:
    return Qwen3_5Config(
        text_config=qwen3_5_text().to_dict(),
        vision_config=_qwen_vision(),
        **_qwen_mm_ids(),
    )


def qwen3_5_moe_text() -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=[_L, _L, _L, _A],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=_qwen_rope(),
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        **_qwen_linear_attn(),
    )


def qwen3_5_moe_vl() -> Qwen3_5MoeConfig:
    return Qwen3_5MoeConfig(
        text_config=qwen3_5_moe_text().to_dict(),
        vision_config=_qwen_vision(),
        **_qwen_mm_ids(),
    )


# --------------------------------------------------------------------------------------------- Qwen4-Exp
def qwen4_exp_text() -> Qwen4ExpTextConfig:
    # Every attention layer is "indexed_attention" (QSA): the indexer module is always built, so the
    # indexer_* fields are mandatory. Layer 2 (1-indexed) gets a PLE n-gram embedding (only allowed on
    # linear_attention layers); the hashed n-gram table is kept tiny via ngram_vocab_size_base.
    return Qwen4ExpTextConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=[_L, _L, _L, "indexed_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=_qwen_rope(),
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=2,
        hc_lowrank=16,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        ple_layer_ids=[2],
        ple_embed_dim=32,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=64,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=1,
        **_qwen_linear_attn(),
    )


def qwen4_exp_vl() -> Qwen4ExpConfig:
    return Qwen4ExpConfig(
        text_config=qwen4_exp_text().to_dict(),
        vision_config=_qwen_vision(),
        **_qwen_mm_ids(),
    )


# --------------------------------------------------------------------------------------------- Mamba2 hybrids
def _mamba2(**kw):
    return dict(
        mamba_n_heads=8,  # mamba_d_head = 2*64/8 = 16
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        **kw,
    )


def granitemoehybrid() -> GraniteMoeHybridConfig:
    return GraniteMoeHybridConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=[_L, _A, _L, _L],  # == layers_block_type
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        position_embedding_type="rope",
        **_mamba2(),
    )


def bamba() -> BambaConfig:
    return BambaConfig(
        **_common(),
        num_hidden_layers=4,
        attn_layer_indices=[1],  # -> layers_block_type [linear, full, linear, linear]
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_mamba2(),
    )


def falcon_h1() -> FalconH1Config:
    # Falcon-H1 has no per-layer choice: every layer is "hybrid" = attention and Mamba2 mixer run in parallel.
    return FalconH1Config(
        **_common(),
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=128,
        # µP multipliers on the SSM projection (z, x, B, C, Δ): a Δ scale that is not 1 is what
        # tests the decay probe reads Δ after them
        ssm_multipliers=[1.0, 1.0, 1.0, 1.0, 0.37],
        **_mamba2(),
    )


# --------------------------------------------------------------------------------------------- Zamba / Zamba2
def zamba() -> ZambaConfig:
    # "hybrid" = mamba block preceded by the shared attention+MLP block; "linear_attention" = plain mamba block.
    return ZambaConfig(
        **_common(),
        num_hidden_layers=6,
        layers_block_type=[_L, _L, "hybrid", _L, _L, "hybrid"],
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_mamba_heads=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
    )


def zamba2() -> Zamba2Config:
    return Zamba2Config(
        **_common(),
        num_hidden_layers=6,
        layers_block_type=[_L, _L, "hybrid", _L, _L, "hybrid"],
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_mamba_heads=8,  # mamba_headdim = 128/8 = 16
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        chunk_size=16,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
    )


# --------------------------------------------------------------------------------------------- Zaya (CCA)
def zaya() -> ZayaConfig:
    # Zaya layers are all attention-with-CCA: q/k pass through a causal conv and v through a recurrent
    # state, so every layer carries conv/recurrent state *and* KV.  Mix full ("hybrid") and sliding.
    return ZayaConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        sliding_window=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=1,  # ZAYA only supports top-1
        router_hidden_size=16,
    )


# --------------------------------------------------------------------------------------------- Inkling
def inkling_text() -> InklingTextConfig:
    # Every Inkling layer = attention (full for "hybrid", sliding for "hybrid_sliding") + 4 short convs
    # (k, v, post-attn, post-mlp), so each layer has both KV and conv state.
    return InklingTextConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=8,
        d_rel=4,
        rel_extent=16,
        conv_kernel_size=4,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        logits_mup_width_multiplier=1.0,
    )


def inkling_vl() -> InklingConfig:
    return InklingConfig(
        text_config=inkling_text().to_dict(),
        # The vision tower is a stack of fold+linear layers planned by `plan_out_scales`; it needs
        # num_hidden_layers >= 1 + #prime_factors(patch_size) + #prime_factors(temporal_patch_size),
        # otherwise it falls back to scipy.optimize.linear_sum_assignment (scipy is not installed here).
        # patch 4 (2*2) + temporal 2 -> 4 scales -> 4 layers.
        vision_config=dict(
            patch_size=4,
            temporal_patch_size=2,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
        ),
        audio_config=dict(n_mel_bins=8, mel_vocab_size=16),
        image_token_id=IMAGE_TOKEN,
        audio_token_id=AUDIO_TOKEN,
        image_bos_token_id=VISION_START,
        audio_bos_token_id=AUDIO_BOS,
    )


# --------------------------------------------------------------------------------------------- LFM2 (short conv)
def lfm2() -> Lfm2Config:
    return Lfm2Config(
        **_common(),
        num_hidden_layers=4,
        layer_types=["conv", _A, "conv", _A],
        intermediate_size=128,
        block_auto_adjust_ff_dim=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
    )


def lfm2_moe() -> Lfm2MoeConfig:
    return Lfm2MoeConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=["conv", _A, "conv", _A],
        num_dense_layers=1,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
    )


def lfm2_vl() -> Lfm2VlConfig:
    text = lfm2().to_dict()
    vision = Siglip2VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=16,
        num_patches=64,
    ).to_dict()
    return Lfm2VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        projector_hidden_size=64,
        downsample_factor=2,
    )


# --------------------------------------------------------------------------------------------- MiniMax (lightning)
def minimax() -> MiniMaxConfig:
    return MiniMaxConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=[_L, _A, _L, _A],
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        block_size=8,
    )


# --------------------------------------------------------------------------------------------- Jamba (Mamba1)
def jamba() -> JambaConfig:
    # layers_block_type derives from attn_layer_period/offset: period 4, offset 2 -> [m, m, attn, m];
    # MoE on odd layers (expert_layer_period 2, offset 1).
    return JambaConfig(
        **_common(),
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mambapy=False,
    )


# --------------------------------------------------------------------------------------------- RecurrentGemma
def recurrent_gemma() -> RecurrentGemmaConfig:
    # No max_position_embeddings field: attention is local with attention_window_size; RG-LRU is unbounded.
    return RecurrentGemmaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_hidden_layers=4,
        block_types=["recurrent", "recurrent", "attention"],  # -> [rec, rec, attn, rec]
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=64,
        attention_window_size=16,
        conv1d_width=4,
    )


FAMILIES: dict[str, Callable[[], transformers.PreTrainedConfig]] = {
    "qwen3_5": qwen3_5_text,
    "qwen3_5-vl": qwen3_5_vl,
    "qwen3_5_moe": qwen3_5_moe_text,
    "qwen3_5_moe-vl": qwen3_5_moe_vl,
    "granitemoehybrid": granitemoehybrid,
    "bamba": bamba,
    "falcon_h1": falcon_h1,
    "zamba": zamba,
    "zamba2": zamba2,
    "zaya": zaya,
    "inkling": inkling_text,
    "inkling-vl": inkling_vl,
    "lfm2": lfm2,
    "lfm2_moe": lfm2_moe,
    "lfm2_vl": lfm2_vl,
    "minimax": minimax,
    "qwen4_exp": qwen4_exp_text,
    "qwen4_exp-vl": qwen4_exp_vl,
    "jamba": jamba,
    "recurrent_gemma": recurrent_gemma,
}

MULTIMODAL = {"qwen3_5-vl", "qwen3_5_moe-vl", "inkling-vl", "lfm2_vl", "qwen4_exp-vl"}


def auto_class_for(key: str):
    return AutoModelForImageTextToText if key in MULTIMODAL else AutoModelForCausalLM


def build_model(key: str):
    torch.manual_seed(0)
    config = FAMILIES[key]()
    return auto_class_for(key).from_config(config, dtype=torch.float32)


def save_random_checkpoint(key: str, directory: str | os.PathLike) -> None:
    model = build_model(key)
    model.to(torch.float32)
    model.save_pretrained(directory)
