"""`hybridkv plan`: what each caching scheme costs a deployment, from a model's config alone.

For a workload — prefix lengths, how many new distinct prefixes arrive per second, how long each
is kept — it gives the cache memory of

- `checkpoint-every-B`: attention KV of every token plus the linear states every B tokens (vLLM's
  hybrid prefix cache is B = its block size: 3,584 tokens for GLM-5.3-Flash);
- `tail-replay`: attention KV only (states are rebuilt by replaying a tail on a hit);

and, per method, the tokens recomputed on a hit and the speedup over full prefill that the cost
model (`hybridkv.models.cost`) predicts: from FLOPs alone, and as roofline time on an H200
(FLOPs and bytes moved), where a short call is bound by reading the weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hybridkv.errors import HybridKVError
from hybridkv.methods import METHODS, Budget, PositionsMatch
from hybridkv.models.cost import H200
from hybridkv.models.meta import cache_sizes, cost_model

GLM_5_3_FLASH = "glm-5.3-flash"


@dataclass(frozen=True)
class Deployment:
    """The deployment `hybridkv plan` sizes. A field's `help` is its flag's text (`flag` names it where
    the field's name does not)."""

    prefix_lengths: tuple[int, ...] = field(default=(8192, 16384, 32768), metadata={"help": "matched prefix lengths"})
    suffix_tokens: int = field(default=64, metadata={"help": "new tokens after the matched prefix"})
    new_prefixes_per_s: float = field(
        default=1.0, metadata={"help": "new distinct prefixes per second", "flag": "--rate"}
    )
    retention_s: float = field(default=600.0, metadata={"help": "seconds each prefix is kept", "flag": "--retention"})
    budgets: tuple[str, ...] = field(
        default=("0.02", "0.05", "0.1"), metadata={"help": "tail-replay budgets (fractions or e.g. 256tok)"}
    )
    intervals: tuple[int, ...] = field(default=(1024, 3584), metadata={"help": "checkpoint intervals B to compare"})


@dataclass
class Plan:
    model: str
    kv_bytes_per_token: int
    state_bytes_per_checkpoint: int
    linear_layers: int
    attention_layers: int
    schemes: list[dict] = field(default_factory=list)
    predictions: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def load_config(model: str):
    """A config without weights: GLM-5.3-Flash's defaults, a built-in tiny model's, or a checkpoint's."""
    from pathlib import Path

    if model == GLM_5_3_FLASH:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

        return Glm5NextTextConfig()
    from hybridkv.models.tiny import RANDOM_MODELS, TRAINED_MODELS

    if model in RANDOM_MODELS:
        return RANDOM_MODELS[model]()
    if model in TRAINED_MODELS:
        model = str(TRAINED_MODELS[model])
    if Path(model).is_dir():
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(model).get_text_config()
        except (OSError, ValueError, KeyError) as err:
            raise HybridKVError(f"{model}: cannot read its config ({err})") from err
    raise HybridKVError(f"unknown model {model!r}: {GLM_5_3_FLASH}, a built-in tiny model, or a checkpoint directory")


def make_plan(model: str, workload: Deployment = Deployment()) -> Plan:
    config = load_config(model)
    sizes = cache_sizes(config)
    costs = cost_model(config)
    kv_per_token, state_per_checkpoint = sizes.kv_bytes_per_token, sizes.state_bytes_per_checkpoint
    plan = Plan(model, kv_per_token, state_per_checkpoint, sizes.linear_layers, sizes.attention_layers)
    kept = workload.new_prefixes_per_s * workload.retention_s  # distinct prefixes held at once
    for length in workload.prefix_lengths:
        kv = length * kv_per_token
        plan.schemes.append(
            {"scheme": "tail-replay", "prefix_length": length, "bytes_per_prefix": kv, "total_bytes": kv * kept}
        )
        for interval in workload.intervals:
            per_prefix = kv + (length // interval) * state_per_checkpoint
            plan.schemes.append(
                {
                    "scheme": f"checkpoint-every-{interval}",
                    "prefix_length": length,
                    "bytes_per_prefix": per_prefix,
                    "total_bytes": per_prefix * kept,
                }
            )
        prompt = length + workload.suffix_tokens
        # Where each scheme starts recomputing: the methods' own recipes, on a match of the whole
        # prefix with checkpoints where the scheme would have stored them.
        plain = PositionsMatch(length)
        starts: list[tuple[str, str | None, int]] = [
            ("full", None, METHODS["full"].recipe(plain, None).state_position),
            ("zero-state", None, METHODS["zero-state"].recipe(plain, None).state_position),
        ]
        for b in workload.intervals:
            grid = PositionsMatch(length, tuple(range(b, length + 1, b)))
            starts.append((f"checkpoint-every-{b}", None, METHODS["checkpoint"].recipe(grid, None).state_position))
        for text in workload.budgets:
            recipe = METHODS["tail-replay"].recipe(plain, Budget.parse(text))
            starts.append(("tail-replay", text, recipe.state_position))
        for method, budget, start in starts:
            plan.predictions.append(
                {
                    "method": method,
                    "budget": budget,
                    "prefix_length": length,
                    "recomputed_tokens": prompt - start,
                    "predicted_speedup": costs.speedup_bound(prompt, start),
                    "roofline_speedup": costs.roofline_speedup(prompt, start, H200),
                }
            )
    return plan


def plan_table(plan: Plan, workload: Deployment) -> str:
    mib = 1024 * 1024
    lines = [
        f"{plan.model}: {plan.linear_layers} linear + {plan.attention_layers} attention layers; "
        f"KV {plan.kv_bytes_per_token:,} B/token; linear states {plan.state_bytes_per_checkpoint / mib:.1f} MiB "
        "per checkpoint",
        f"workload: {workload.new_prefixes_per_s:g} new prefixes/s kept {workload.retention_s:g} s "
        f"({workload.new_prefixes_per_s * workload.retention_s:g} held), {workload.suffix_tokens}-token suffixes",
        "",
        "| scheme | prefix | MiB per prefix | GiB held |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {s['scheme']} | {s['prefix_length']} | {s['bytes_per_prefix'] / mib:.1f} | "
        f"{s['total_bytes'] / 1024**3:.1f} |"
        for s in plan.schemes
    ]
    lines += [
        "",
        "| method | budget | prefix | recomputed tokens | predicted speedup, FLOPs | H200 roofline, batch of one |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['method']} | {p['budget'] or '—'} | {p['prefix_length']} | {p['recomputed_tokens']} | "
        f"{p['predicted_speedup']:.1f}x | {p['roofline_speedup']:.1f}x |"
        for p in plan.predictions
    ]
    return "\n".join(lines)
