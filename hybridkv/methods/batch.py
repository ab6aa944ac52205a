"""Several requests' resumes as one batched forward.

Each request keeps its own recipe (exact KV up to n_i, linear states from s_i); what they must
share is the number of tokens to push through the model, end_i − s_i, so that every row's new
tokens line up without padding between a row's cached KV and its tokens (padding there would
decay seeded states and break GLM's k-pool grouping). Rows' cached KV is left-padded to the
longest and masked. A server batches requests by that span; the benchmark builds them so.
"""

from __future__ import annotations

import torch

from hybridkv.cache import Hit, assemble_batch, exact_attention_for_first_tokens, split_batch
from hybridkv.errors import HybridKVError
from hybridkv.methods.base import Outcome, Recipe, check_hit
from hybridkv.models import HybridModel


def execute_batch(
    model: HybridModel, prompts: list[torch.Tensor], hits: list[Hit], recipes: list[Recipe], logits_to_keep: int = 1
) -> list[Outcome]:
    """`execute` for each (prompt, hit, recipe), in one forward; outcomes in the same order."""
    if not len(prompts) == len(hits) == len(recipes) >= 1:
        raise HybridKVError("a batch needs one hit and one recipe per prompt, and at least one prompt")
    prompts = [prompt.reshape(-1) for prompt in prompts]
    spans = {prompt.numel() - recipe.state_position for prompt, recipe in zip(prompts, recipes, strict=True)}
    if len(spans) != 1:
        raise HybridKVError(
            "requests in one batch must compute the same number of tokens (prompt − state position); "
            f"got {sorted(spans)}"
        )
    span = spans.pop()
    kvs, states, exact = [], [], []
    for prompt, hit, recipe in zip(prompts, hits, recipes, strict=True):
        check_hit(prompt, hit)
        n, s = recipe.exact_kv_tokens, recipe.state_position
        if n > hit.length:
            raise ValueError(f"recipe reuses {n} KV tokens but only {hit.length} are matched")
        if logits_to_keep > prompt.numel() - n:
            raise ValueError(f"{logits_to_keep} logits asked but only {prompt.numel() - n} positions are computed")
        seed = hit.cached.checkpoints.get(s) if recipe.state_seed else None
        if recipe.state_seed and seed is None:
            raise ValueError(f"no stored checkpoint at position {s}")
        kvs.append(hit.cached.kv_prefix(model, s) if s > 0 else None)
        states.append(seed)
        exact.append(hit.cached.kv_range(model, s, n) if n > s else None)
    cache, padding = assemble_batch(model, kvs, states)
    longest = padding.shape[1]
    mask = torch.cat([padding, torch.ones(len(prompts), span, dtype=torch.bool)], dim=1)
    tokens = torch.stack([prompt[r.state_position :] for prompt, r in zip(prompts, recipes, strict=True)])
    positions = torch.stack([torch.arange(r.state_position, r.state_position + span) for r in recipes])
    with exact_attention_for_first_tokens(model, cache, exact):
        logits = model.forward_batch(tokens, cache, positions, mask.long(), logits_to_keep)
    return [
        Outcome(
            logits=logits[row],
            cache=split_batch(model, cache, row, longest - recipe.state_position),
            reused_tokens=recipe.exact_kv_tokens,
            replayed_tokens=hit.length - recipe.state_position,
            recomputed_tokens=prompt.numel() - recipe.exact_kv_tokens,
        )
        for row, (prompt, hit, recipe) in enumerate(zip(prompts, hits, recipes, strict=True))
    ]
