"""GLM-5.3-Flash (`glm5_next`): 3 KDA linear layers : 1 MLA attention layer with a DSA indexer, NoPE,
hyper-connections, MoE after the first dense layers. The project's target model.

Cache sizes, from the config alone (no weights):

    attention KV per token, per MLA layer:  (kv_lora_rank + qk_rope_head_dim) latent entries
                                            + the DSA indexer's packed key: index_head_dim key
                                              + index_head_dim k-pool gate scores + 1 valid flag
    KDA state per linear layer:             heads × head_dim × head_dim recurrent (float32)
                                            + 3 × heads × head_dim channels × conv kernel (q, k, v
                                              short-conv windows, model dtype)

They feed GLM's own cost model below (its DSA indexer and hyper-connections need more than the
generic one sees) and the store benchmark's entry sizes; the meta-device description of the
full-size config must agree with them (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedConfig

from hybridkv.models.arch.base import SPECIAL_TOKENS, TINY_VOCAB, Architecture
from hybridkv.models.cost import STATE_BYTES, WEIGHT_BYTES, CostModel, LayerCost, dense_mlp, moe
from hybridkv.models.gates import kda_probe
from hybridkv.models.rope import no_shift


def tiny_config(**overrides) -> PreTrainedConfig:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(
        **dict(
            vocab_size=TINY_VOCAB,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            kv_lora_rank=64,
            q_lora_rank=96,
            qk_nope_head_dim=32,
            v_head_dim=32,
            index_topk=256,
            index_head_dim=32,
            index_n_heads=4,
            index_kpool=16,
            linear_head_dim=32,
            linear_num_heads=4,
            hc_mult=4,
            pad_token_id=0,
            max_position_embeddings=65536,
        )
        | overrides
    )


@dataclass(frozen=True)
class Glm5Sizes:
    """GLM-5.3-Flash's cache by the formulas above: per MLA layer and token, per KDA layer."""

    linear_layers: int
    attention_layers: int
    kv_bytes_per_token_per_layer: int
    state_bytes_per_layer: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.attention_layers

    @property
    def state_bytes_per_checkpoint(self) -> int:
        return self.state_bytes_per_layer * self.linear_layers


def cache_sizes(config: PreTrainedConfig | None = None, dtype_bytes: int = 2, state_dtype_bytes: int = 4) -> Glm5Sizes:
    """Defaults: GLM-5.3-Flash (transformers' Glm5NextTextConfig defaults) in bfloat16, float32 states."""
    if config is None:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

        config = Glm5NextTextConfig()
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    indexer = 2 * config.index_head_dim + 1
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    recurrent = heads * head_dim * head_dim * state_dtype_bytes
    conv = 3 * heads * head_dim * config.linear_conv_kernel_dim * dtype_bytes
    return Glm5Sizes(
        linear_layers=config.layer_types.count("linear_attention"),
        attention_layers=config.layer_types.count("indexed_attention"),
        kv_bytes_per_token_per_layer=(latent + indexer) * dtype_bytes,
        state_bytes_per_layer=recurrent + conv,
    )


def cost_model(config: PreTrainedConfig) -> CostModel:
    d, nq = config.hidden_size, config.num_attention_heads
    qk, v, qlr, klr = config.qk_head_dim, config.v_head_dim, config.q_lora_rank, config.kv_lora_rank
    ih, inh, kpool = config.index_head_dim, config.index_n_heads, config.index_kpool
    heads, hd, m = config.linear_num_heads, config.linear_head_dim, config.hc_mult
    # Two hyper-connections per layer: each projects the m streams to m² + 2m mixing weights,
    # mixes the streams (m² d) and folds them in and out (2 m d).
    hc_params = 2 * m * d * (m * m + 2 * m)
    hc_macs = hc_params + 2 * (m * m * d + 2 * m * d)
    sizes = cache_sizes(config, WEIGHT_BYTES, STATE_BYTES)
    activations = 4 * m * d * WEIGHT_BYTES  # the streams read and written, in and out
    latent = (klr + config.qk_rope_head_dim) * WEIGHT_BYTES
    mla_params = (
        d * qlr + qlr * nq * qk + d * (klr + config.qk_rope_head_dim)
        + klr * nq * (config.qk_nope_head_dim + v) + nq * v * d
        + qlr * inh * ih + 2 * d * ih + d * inh  # indexer: q, k, k-pool gate, head weights
    )  # fmt: skip
    mla = LayerCost(
        "attention",
        flops_per_token=2 * (mla_params + hc_macs),
        flops_per_context_token=2 * nq * (qk + v),
        max_attended=config.index_topk,
        flops_per_pooled_token=2 * inh * ih / kpool,
        weight_bytes=(mla_params + hc_params) * WEIGHT_BYTES,
        activation_bytes_per_token=activations,
        kv_bytes_per_token=latent,
        index_bytes_per_token=sizes.kv_bytes_per_token_per_layer - latent,
    )
    kda_params = (
        d * heads * hd * 3  # q, k, v
        + 2 * (d * hd + hd * heads * hd)  # channel-wise decay gate and output gate, low rank
        + d * heads  # beta
        + heads * hd * d  # output projection
        + 3 * heads * hd * config.linear_conv_kernel_dim  # short convolutions on q, k, v
    )
    kda = LayerCost(
        "linear",
        flops_per_token=2 * (kda_params + hc_macs) + 6 * heads * hd * hd,  # + the recurrence
        weight_bytes=(kda_params + hc_params) * WEIGHT_BYTES,
        activation_bytes_per_token=activations,
        state_bytes=sizes.state_bytes_per_layer,
    )
    feed_forward = {"dense": dense_mlp(config, d), "sparse": moe(config, d)}
    layers = tuple(
        feed_forward[mlp].add_to(mla if kind == "indexed_attention" else kda)
        for kind, mlp in zip(config.layer_types, config.mlp_layer_types, strict=True)
    )
    head = d * config.vocab_size
    return CostModel(config.model_type, layers, 2 * head, head * WEIGHT_BYTES)


def decoder_and_head(config: PreTrainedConfig) -> tuple[nn.Module, nn.Module]:
    """GLM-5.3-Flash's text decoder and an LM head, which transformers only has inside the multimodal
    model: the decoder's own initialisation covers the head too (as the multimodal model's does)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    backbone = Glm5NextTextModel(config)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    backbone._init_weights(lm_head)
    return backbone, lm_head


ARCHITECTURE = Architecture(
    name="glm5-next",
    model_types=("glm5_next", "glm5_next_text"),
    tiny_config=tiny_config,
    decay_probe=kda_probe,
    cost_model=cost_model,
    decoder_and_head=decoder_and_head,
    # GLM-5.3-Flash's pattern once (3 KDA, then MLA/DSA), shaped for speed: 4 layers and 2
    # hyper-connection streams train 2x faster per token than 8 layers and 4 streams (5,000 vs
    # 2,500 tokens/s here), and one MLA layer after three KDA layers is enough for retrieval, since
    # the KDA layers give it the recent-token features that key matching needs. The DSA indexer
    # keeps GLM-5.3-Flash's own 2,048 tokens (128 pools of 16) per query.
    trained_shape=dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        hc_mult=2,
        index_topk=2048,
        **SPECIAL_TOKENS,
    ),
    shift_keys=no_shift,  # NoPE MLA; its DSA indexer keys carry no rotary embedding either
)
