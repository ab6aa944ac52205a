"""A prefill cost model from a model's config alone (no weights): FLOPs per token for each layer
kind, so a method's predicted TTFT ratio against full prefill follows from which tokens it
pushes through the model.

Counted (2 FLOPs per multiply-accumulate, forward only):

- every layer: its projections, its MLP or MoE (routed experts per token + shared experts +
  router), GLM's hyper-connection mixing;
- attention: per attended context token, query·key and weights·value for every head; DSA's top-k
  caps the attended tokens of GLM's MLA, while its indexer scores every k-pooled context token;
- linear layers (KDA / Gated DeltaNet): the short convolution and the recurrence, ~6 FLOPs per
  state entry per token (state decay and update, and the output read-out, in chunked form);
- the LM head once per prompt (only the last position's logits are needed).

Not counted: norms, activations, softmax, rotary embeddings, memory traffic and kernel launch
overheads. A prediction is meant as the speedup an ideal implementation would see. On transformers' CPU code the
measured speedups of short tails exceed it: full prefill there costs more than its FLOPs (see benchmarks/NOTES.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.errors import HybridKVError


@dataclass(frozen=True)
class LayerCost:
    kind: str  # "linear" or "attention"
    flops_per_token: float  # independent of the context: projections, MLP/MoE, recurrence
    flops_per_context_token: float = 0.0  # per attended earlier token (attention only)
    max_attended: int | None = None  # DSA top-k: at most this many tokens attended
    flops_per_pooled_token: float = 0.0  # the DSA indexer: per context token, never capped


def _attended(start: int, end: int, cap: int | None) -> float:
    """Σ over positions p in [start, end) of min(p + 1, cap): tokens attended by each query."""
    if end <= start:
        return 0.0
    if cap is None or cap >= end:
        return (start + 1 + end) * (end - start) / 2
    split = max(start, min(end, cap))  # positions below `split` attend p + 1 < cap tokens
    return _attended(start, split, None) + cap * (end - split)


@dataclass(frozen=True)
class CostModel:
    model_type: str
    layers: tuple[LayerCost, ...]
    head_flops: float  # the LM head, once per prompt

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to push positions [start, end) through the model, attending to [0, p] each."""
        total = self.head_flops if end > start else 0.0
        for layer in self.layers:
            total += layer.flops_per_token * (end - start)
            total += layer.flops_per_context_token * _attended(start, end, layer.max_attended)
            total += layer.flops_per_pooled_token * _attended(start, end, None)
        return total

    def speedup_bound(self, prompt: int, recompute_from: int) -> float:
        """Full prefill of `prompt` tokens over a method that computes only [recompute_from, prompt)."""
        return self.prefill_flops(0, prompt) / self.prefill_flops(recompute_from, prompt)


def _get(config, *names: str, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _moe(config, d: int) -> float:
    experts = _get(config, "num_experts_per_tok", default=0)
    inter = _get(config, "moe_intermediate_size", "intermediate_size")
    shared = _get(config, "n_shared_experts", default=0) * 6 * d * inter
    if shared_inter := _get(config, "shared_expert_intermediate_size"):
        shared = 6 * d * shared_inter + 2 * d  # Qwen3-Next: one gated shared expert
    router = 2 * d * _get(config, "n_routed_experts", "num_experts", default=0)
    if not experts:
        return 6 * d * config.intermediate_size
    return experts * 6 * d * inter + shared + router


def _glm5_next(config) -> CostModel:
    d, nq = config.hidden_size, config.num_attention_heads
    qk, v, qlr, klr = config.qk_head_dim, config.v_head_dim, config.q_lora_rank, config.kv_lora_rank
    ih, inh, kpool = config.index_head_dim, config.index_n_heads, config.index_kpool
    heads, hd = config.linear_num_heads, config.linear_head_dim
    mlp = _moe(config, d) + 8 * config.hc_mult * d  # hyper-connections: mixing hc_mult streams
    mla = LayerCost(
        "attention",
        flops_per_token=2 * (d * qlr + qlr * nq * qk + d * (klr + config.qk_rope_head_dim))
        + 2 * klr * nq * (config.qk_nope_head_dim + v)
        + 2 * nq * v * d
        + 2 * (qlr * inh * ih + d * ih + d * inh)  # indexer projections
        + mlp,
        flops_per_context_token=2 * nq * (qk + v),
        max_attended=config.index_topk,
        flops_per_pooled_token=2 * inh * ih / kpool,
    )
    kda = LayerCost(
        "linear",
        flops_per_token=2 * d * heads * hd * 5  # q, k, v, channel-wise decay gate, output gate
        + 2 * d * heads  # beta
        + 2 * heads * hd * d  # output projection
        + 2 * 3 * heads * hd * config.linear_conv_kernel_dim  # short convolutions on q, k, v
        + 6 * heads * hd * hd  # recurrence
        + mlp,
    )
    layers = tuple(mla if kind == "indexed_attention" else kda for kind in config.layer_types)
    return CostModel(config.model_type, layers, 2 * d * config.vocab_size)


def _qwen3_next(config) -> CostModel:
    d, nq, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    mlp = _moe(config, d)
    attention = LayerCost(
        "attention",
        flops_per_token=2 * d * (2 * nq * hd + 2 * nkv * hd) + 2 * nq * hd * d + mlp,  # gated q, k, v, o
        flops_per_context_token=4 * nq * hd,
    )
    conv_channels = 2 * hk * dk + hv * dv
    gdn = LayerCost(
        "linear",
        flops_per_token=2 * d * (conv_channels + hv * dv + 2 * hv)  # q, k, v, z, b, a
        + 2 * hv * dv * d
        + 2 * conv_channels * config.linear_conv_kernel_dim
        + 6 * hv * dk * dv
        + mlp,
    )
    layers = tuple(attention if kind == "full_attention" else gdn for kind in config.layer_types)
    return CostModel(config.model_type, layers, 2 * d * config.vocab_size)


_BUILDERS = {"glm5_next": _glm5_next, "glm5_next_text": _glm5_next, "qwen3_next": _qwen3_next}


def cost_model(config, dense_attention: bool = False) -> CostModel:
    """The cost model of a transformers config (a multimodal config's text part is used).

    `dense_attention`: every query scores every earlier token even where DSA selects top-k, as
    transformers' implementation does (it masks the dense scores); a serving kernel that computes
    only the selected tokens (vLLM's sparse MLA) is the default.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    builder = _BUILDERS.get(text.model_type)
    if builder is None:
        raise HybridKVError(
            f"no cost model for model type {text.model_type!r} yet; known: {', '.join(sorted(_BUILDERS))}"
        )
    model = builder(text)
    if dense_attention:
        model = replace(model, layers=tuple(replace(layer, max_attended=None) for layer in model.layers))
    return model
