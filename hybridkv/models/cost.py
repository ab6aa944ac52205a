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

Bytes moved per forward call (bf16 weights and KV, float32 states):

- weights once per call: every dense projection, the shared experts and the router, and each
  routed expert that at least one token of the call selects (E·(1 − (1 − k/E)^n) of E for n tokens);
- activations: a few reads and writes of the residual streams per token and layer;
- attention context: a dense kernel reads the cached KV once per block of `QUERY_BLOCK` queries;
  a sparse (DSA) kernel gathers each query's top-k latents separately, while the indexer's keys
  are read densely;
- linear layers: the recurrent and conv state read and written once per call.

`roofline_speedup` turns both into time on a `Machine` (max of FLOPs / peak and bytes /
bandwidth per call): short calls are weight-bound, which the FLOP ratio alone hides.

Not counted: norms, softmax, rotary embeddings and kernel launch overheads. Predictions are
what an ideal implementation would see. On transformers' CPU code the measured speedups of
short tails exceed the FLOP ratio: its linear-layer fallback (a Python loop over chunks) runs
at far fewer FLOP/s than attention's matmuls (see benchmarks/NOTES.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.errors import HybridKVError
from hybridkv.models.describe import first_set

QUERY_BLOCK = 128  # queries that share one read of the context in a dense attention kernel
WEIGHT_BYTES = 2  # bfloat16 weights, KV and activations
STATE_BYTES = 4  # float32 recurrent states


@dataclass(frozen=True)
class Machine:
    name: str
    flops_per_s: float  # dense bf16 peak
    bytes_per_s: float  # memory bandwidth


H200 = Machine("H200", flops_per_s=989e12, bytes_per_s=4.8e12)


@dataclass(frozen=True)
class LayerCost:
    kind: str  # "linear" or "attention"
    flops_per_token: float  # independent of the context: projections, MLP/MoE, recurrence
    flops_per_context_token: float = 0.0  # per attended earlier token (attention only)
    max_attended: int | None = None  # DSA top-k: at most this many tokens attended
    flops_per_pooled_token: float = 0.0  # the DSA indexer: per context token, never capped
    weight_bytes: float = 0.0  # read once per call: projections, shared experts, router
    expert_bytes: float = 0.0  # one routed expert's weights
    experts: int = 0  # routed experts E
    experts_per_token: int = 0  # top-k
    activation_bytes_per_token: float = 0.0
    kv_bytes_per_token: float = 0.0  # attention: cached entries gathered per attended token (sparse) or block
    index_bytes_per_token: float = 0.0  # DSA indexer keys, always read densely
    state_bytes: float = 0.0  # linear: recurrent + conv state, read and written once per call

    def weights_read(self, tokens: int) -> float:
        if tokens == 0:
            return 0.0
        if not self.experts:
            return self.weight_bytes
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)
        return self.weight_bytes + self.expert_bytes * touched


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
    head_bytes: float = 0.0  # its weights, read once

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

    def prefill_bytes(self, start: int, end: int) -> float:
        """Bytes moved to push positions [start, end) through the model in one call."""
        tokens = end - start
        if tokens <= 0:
            return 0.0
        total = self.head_bytes
        dense_reads = _attended(start, end, None) / QUERY_BLOCK  # context tokens read, per block of queries
        for layer in self.layers:
            total += layer.weights_read(tokens) + layer.activation_bytes_per_token * tokens
            total += 2 * layer.state_bytes
            if layer.max_attended is not None:
                total += layer.kv_bytes_per_token * _attended(start, end, layer.max_attended)
            else:
                total += layer.kv_bytes_per_token * dense_reads
            total += layer.index_bytes_per_token * dense_reads
        return total

    def seconds(self, start: int, end: int, machine: Machine = H200) -> float:
        """Roofline time of one call: the larger of compute time and memory time."""
        return max(
            self.prefill_flops(start, end) / machine.flops_per_s, self.prefill_bytes(start, end) / machine.bytes_per_s
        )

    def roofline_speedup(self, prompt: int, recompute_from: int, machine: Machine = H200) -> float:
        """Full prefill over [recompute_from, prompt), both as roofline time on `machine`."""
        return self.seconds(0, prompt, machine) / self.seconds(recompute_from, prompt, machine)


@dataclass(frozen=True)
class _FeedForward:
    flops_per_token: float
    dense_params: float  # shared experts and router (or the whole MLP of a dense model)
    expert_params: float = 0.0  # one routed expert
    experts: int = 0
    experts_per_token: int = 0

    def add_to(self, cost: LayerCost) -> LayerCost:
        """`cost` (a mixer) followed by this feed-forward block."""
        return replace(
            cost,
            flops_per_token=cost.flops_per_token + self.flops_per_token,
            weight_bytes=cost.weight_bytes + self.dense_params * WEIGHT_BYTES,
            expert_bytes=self.expert_params * WEIGHT_BYTES,
            experts=self.experts,
            experts_per_token=self.experts_per_token,
        )


def _dense_mlp(config, d: int) -> _FeedForward:
    return _FeedForward(6 * d * config.intermediate_size, 3 * d * config.intermediate_size)


def _moe(config, d: int) -> _FeedForward:
    experts = first_set(config, "num_experts_per_tok", default=0)
    inter = first_set(config, "moe_intermediate_size", "intermediate_size")
    shared = first_set(config, "n_shared_experts", default=0) * 3 * d * inter
    if shared_inter := first_set(config, "shared_expert_intermediate_size"):
        shared = 3 * d * shared_inter + d  # Qwen3-Next: one gated shared expert
    routed = first_set(config, "n_routed_experts", "num_experts", default=0)
    router = d * routed
    if not experts:
        return _dense_mlp(config, d)
    return _FeedForward(
        2 * (experts * 3 * d * inter + shared + router), shared + router, 3 * d * inter, routed, experts
    )


def _glm5_next(config) -> CostModel:
    from hybridkv.models.glm5 import Glm5CacheSizes

    d, nq = config.hidden_size, config.num_attention_heads
    qk, v, qlr, klr = config.qk_head_dim, config.v_head_dim, config.q_lora_rank, config.kv_lora_rank
    ih, inh, kpool = config.index_head_dim, config.index_n_heads, config.index_kpool
    heads, hd, m = config.linear_num_heads, config.linear_head_dim, config.hc_mult
    # Two hyper-connections per layer: each projects the m streams to m² + 2m mixing weights,
    # mixes the streams (m² d) and folds them in and out (2 m d).
    hc_params = 2 * m * d * (m * m + 2 * m)
    hc_macs = hc_params + 2 * (m * m * d + 2 * m * d)
    sizes = Glm5CacheSizes.from_config(config, WEIGHT_BYTES, STATE_BYTES)
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
    feed_forward = {"dense": _dense_mlp(config, d), "sparse": _moe(config, d)}
    layers = tuple(
        feed_forward[mlp].add_to(mla if kind == "indexed_attention" else kda)
        for kind, mlp in zip(config.layer_types, config.mlp_layer_types, strict=True)
    )
    head = d * config.vocab_size
    return CostModel(config.model_type, layers, 2 * head, head * WEIGHT_BYTES)


def _qwen3_next(config) -> CostModel:
    d, nq, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    ffn = _moe(config, d)
    activations = 4 * d * WEIGHT_BYTES
    attention_params = d * (2 * nq * hd + 2 * nkv * hd) + nq * hd * d  # gated q, k, v, o
    attention = LayerCost(
        "attention",
        flops_per_token=2 * attention_params,
        flops_per_context_token=4 * nq * hd,
        weight_bytes=attention_params * WEIGHT_BYTES,
        activation_bytes_per_token=activations,
        kv_bytes_per_token=2 * nkv * hd * WEIGHT_BYTES,
    )
    conv_channels = 2 * hk * dk + hv * dv
    gdn_params = d * (conv_channels + hv * dv + 2 * hv) + hv * dv * d + conv_channels * config.linear_conv_kernel_dim
    gdn = LayerCost(
        "linear",
        flops_per_token=2 * gdn_params + 6 * hv * dk * dv,  # q, k, v, z, b, a; the recurrence
        weight_bytes=gdn_params * WEIGHT_BYTES,
        activation_bytes_per_token=activations,
        state_bytes=hv * dk * dv * STATE_BYTES + conv_channels * config.linear_conv_kernel_dim * WEIGHT_BYTES,
    )
    attention, gdn = ffn.add_to(attention), ffn.add_to(gdn)
    layers = tuple(attention if kind == "full_attention" else gdn for kind in config.layer_types)
    head = d * config.vocab_size
    return CostModel(config.model_type, layers, 2 * head, head * WEIGHT_BYTES)


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
