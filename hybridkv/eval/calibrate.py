"""`hybridkv calibrate`: how far back a model's linear layers still remember, measured once.

adaptive-replay reads a prompt's own gates when it is cached (`hybridkv.models.decay`) and
replays only as long a tail as they need. An engine that does not expose its gates (vLLM) cannot
do that per request, so this measures it once per model: run the model on sample prompts, record
each linear layer's worst per-token log-decay, and for every end position in the second half of
each prompt find the shortest tail whose bound on what a zeroed state still contributes falls below
the tolerance (`DecaySummary.shortest_tail`). A layer's horizon is the `quantile` of those tails
over positions and prompts; the model's horizon is its slowest layer's. Positions where no tail
within the prompt reaches the tolerance count as endless, and a layer most of whose positions
never get there has no horizon (None): it remembers past the sample's length, and an engine
should replay its whole budget.

The result (`hybridkv.models.calibration.Calibration`) is written beside the model
(`hybridkv-calibration.json`) for the vLLM connector, which then replays min(horizon, budget)
tokens of each hit.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from hybridkv.errors import HybridKVError
from hybridkv.models.calibration import Calibration
from hybridkv.models.decay import DecaySummary, record_decay, summarise
from hybridkv.models.loader import HybridModel


@dataclass(frozen=True)
class CalibrateConfig:
    """How a model is calibrated. A field's `help` is its `hybridkv calibrate` flag's text."""

    tokens: int = field(default=4096, metadata={"help": "tokens per sample prompt"})
    samples: int = field(default=4, metadata={"help": "sample prompts"})
    tolerance: float = field(default=0.01, metadata={"help": "bound on a zeroed state's surviving share"})
    quantile: float = field(default=0.95, metadata={"help": "of the shortest tails over positions"})
    seed: int = field(default=0, metadata={"help": "which sample prompts (and a random model's weights)"})

    def __post_init__(self) -> None:
        if self.tokens < 256 or self.samples < 1:
            raise HybridKVError(f"calibrate: tokens ({self.tokens}) must be at least 256 and samples at least 1")
        if not 0 < self.tolerance < 1 or not 0 < self.quantile <= 1:
            raise HybridKVError(
                f"calibrate: tolerance {self.tolerance} and quantile {self.quantile} must lie in (0, 1)"
            )


def shortest_tails(summary: DecaySummary, tolerance: float) -> list[list[float]]:
    """Per linear layer, the shortest tail below `tolerance` at every span-aligned end in the
    prompt's second half (math.inf where the whole history before the end does not reach it)."""
    span = summary.span
    ends = range((summary.spans // 2) * span, summary.spans * span + 1, span)
    per_layer = []
    for layer in range(summary.log_decay.shape[1]):
        one = DecaySummary(summary.log_decay[:, layer : layer + 1], span)
        tails = []
        for end in ends:
            tail, bound = one.shortest_tail(end, tolerance, end - span)  # a tail from 0 drops nothing
            tails.append(float(tail) if bound < tolerance else math.inf)
        per_layer.append(tails)
    return per_layer


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]  # the nearest rank


def sample_prompts(model: HybridModel, tokens: int, samples: int, seed: int = 0) -> tuple[list[torch.Tensor], str]:
    """Essay text (RULER's pseudo-essay haystack) through the model's tokenizer, or, for a model
    that ships none, random token ids."""
    from hybridkv.eval.workloads.essay import essay_passage
    from hybridkv.models.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model.name)
    except (HybridKVError, OSError, ValueError):
        tokenizer = None
    if tokenizer is not None:
        prompts = []
        for index in range(samples):
            ids = tokenizer.encode(" ".join(essay_passage((seed * samples + index) * 50_000, tokens)))[:tokens]
            prompts.append(torch.tensor(ids))
        if all(len(p) == tokens for p in prompts):
            return prompts, "essay text"
    rng = random.Random(f"hybridkv-calibrate|{seed}")
    vocab = int(model.config.vocab_size)
    return [torch.tensor([rng.randrange(3, vocab) for _ in range(tokens)]) for _ in range(samples)], "random token ids"


def calibrate(model: HybridModel, config: CalibrateConfig | None = None) -> Calibration:
    config = config or CalibrateConfig()
    tokens, samples, tolerance, quantile = config.tokens, config.samples, config.tolerance, config.quantile
    prompts, text = sample_prompts(model, tokens, samples, config.seed)
    tails: list[list[float]] | None = None
    for prompt in prompts:
        with torch.inference_mode(), record_decay(model) as gates:
            if gates is None:
                raise HybridKVError(f"calibrate: {model.name} has no gate probe for its linear layers")
            model.forward(prompt, model.new_cache(), start=0)
        found = shortest_tails(summarise(gates), tolerance)
        tails = found if tails is None else [a + b for a, b in zip(tails, found, strict=True)]
    layers = [_quantile(t, quantile) for t in tails]
    per_layer = [None if math.isinf(h) else int(h) for h in layers]
    horizon = None if any(h is None for h in per_layer) else max(per_layer)
    return Calibration(model.name, tolerance, quantile, tokens, samples, text, horizon, per_layer)
