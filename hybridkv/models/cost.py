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
class FeedForward:
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


def dense_mlp(config, d: int) -> FeedForward:
    return FeedForward(6 * d * config.intermediate_size, 3 * d * config.intermediate_size)


def moe(config, d: int) -> FeedForward:
    experts = first_set(config, "num_experts_per_tok", default=0)
    inter = first_set(config, "moe_intermediate_size", "intermediate_size")
    shared = first_set(config, "n_shared_experts", default=0) * 3 * d * inter
    if shared_inter := first_set(config, "shared_expert_intermediate_size"):
        shared = 3 * d * shared_inter + d  # Qwen3-Next: one gated shared expert
    routed = first_set(config, "n_routed_experts", "num_experts", default=0)
    router = d * routed
    if not experts:
        return dense_mlp(config, d)
    return FeedForward(2 * (experts * 3 * d * inter + shared + router), shared + router, 3 * d * inter, routed, experts)


def generic_cost_model(config, backbone, description) -> CostModel:
    """The cost model of any family, from its decoder built on the meta device and its description.

    Per layer: 2 FLOPs per active parameter (routed experts at top-k of E), ~6 per recurrent-state
    entry for the recurrence, and for attention layers the context term of
    `description.attention_flops_per_context_token`; bytes as the hand-written models count them,
    with the KV and state sizes the description read off the cache; sliding-window layers attend
    their window only. It does not know a family's sparse attention (DSA) or extra mixing, which
    the family's own cost model adds where it has one.
    """
    n_experts = first_set(config, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    top_k = first_set(config, "num_experts_per_tok", default=1)
    attention_layers = len(description.attention_layers) or 1
    per_context = description.attention_flops_per_context_token / attention_layers
    activations = 4 * config.hidden_size * WEIGHT_BYTES
    layers = []
    for spec, layer in zip(description.layers, backbone.layers, strict=True):
        params = sum(p.numel() for p in layer.parameters())
        routed = sum(
            sum(p.numel() for p in module.parameters(recurse=False))
            for module in layer.modules()
            if type(module).__name__.endswith("Experts")  # transformers' fused routed-expert modules
        )
        active = params - routed + (routed * top_k / n_experts if n_experts else 0)
        recurrent = sum(_numel(shape) for name, shape, _ in spec.state_tensors if name.startswith("recurrent"))
        layers.append(
            LayerCost(
                "attention" if spec.token_dims else "linear",
                flops_per_token=2 * active + 6 * recurrent,
                flops_per_context_token=per_context if spec.token_dims else 0.0,
                max_attended=spec.window,
                weight_bytes=(params - routed) * WEIGHT_BYTES,
                expert_bytes=routed / n_experts * WEIGHT_BYTES if n_experts and routed else 0.0,
                experts=n_experts if routed else 0,
                experts_per_token=top_k if routed else 0,
                activation_bytes_per_token=activations,
                kv_bytes_per_token=spec.kv_bytes_per_token,
                state_bytes=spec.state_bytes,
            )
        )
    head = config.hidden_size * config.vocab_size
    return CostModel(config.model_type, tuple(layers), 2 * head, head * WEIGHT_BYTES)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
