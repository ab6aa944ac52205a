"""Several requests' resumes as one batched forward.

Each request keeps its own recipe (exact KV up to n_i, linear states from s_i); what they must
share is the number of tokens to push through the model, end_i − s_i, so that every row's new
tokens line up without padding between a row's cached KV and its tokens (padding there would
decay seeded states and break GLM's k-pool grouping). Rows' cached KV is left-padded to the
longest and masked. A server batches requests by that span; the benchmark builds them so.
"""

from __future__ import annotations

import torch

from hybridkv.cache import CachedMatch, assemble_batch, split_batch
from hybridkv.errors import HybridKVError
from hybridkv.methods.base import Outcome, Recipe, outcome, resume_pieces
from hybridkv.models import HybridModel
from hybridkv.models.adapter import exact_kv_for_first_tokens


def execute_batch(
    model: HybridModel,
    prompts: list[torch.Tensor],
    hits: list[CachedMatch],
    recipes: list[Recipe],
    logits_to_keep: int = 1,
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
    pieces = [
        resume_pieces(model, prompt, hit, recipe, logits_to_keep)
        for prompt, hit, recipe in zip(prompts, hits, recipes, strict=True)
    ]
    cache, padding = assemble_batch(model, [p.kv for p in pieces], [p.seed for p in pieces])
    longest = padding.shape[1]
    mask = torch.cat([padding, torch.ones(len(prompts), span, dtype=torch.bool)], dim=1)
    tokens = torch.stack([prompt[r.state_position :] for prompt, r in zip(prompts, recipes, strict=True)])
    positions = torch.stack([torch.arange(r.state_position, r.state_position + span) for r in recipes])
    with exact_kv_for_first_tokens(model.description, cache, [p.tail_kv for p in pieces]):
        logits = model.forward_batch(tokens, cache, positions, mask.long(), logits_to_keep)
    return [
        outcome(prompt, hit, recipe, logits[row], split_batch(model, cache, row, longest - recipe.state_position))
        for row, (prompt, hit, recipe) in enumerate(zip(prompts, hits, recipes, strict=True))
    ]
