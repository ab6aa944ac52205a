"""Position-independent reuse: one attention policy and one linear policy, one executor.

A prompt is chunks encoded on their own (`hybridkv.cache.chunks.EncodedChunk`: retrieved
passages, agent reports, a shared header) and then a question. Each chunk's attention KV was
computed at other positions after other text, and each linear layer has one state per chunk.
A method is a pair, as a prefix method is a `Recipe`:

* **attention policy**: which tokens of each chunk to recompute (EPIC: each chunk's first k;
  CacheBlend, ProphetKV: tokens chosen by deviation or relevance); every other token's KV is
  used as stored;
* **linear policy**: the state each linear layer carries past a chunk whose tokens were not all
  recomputed (zero; LinearKV: one cached state; compose: HYPIC's exact composition), and the state
  it starts the question from.

`execute_chunks` runs any pair: chunk by chunk, the stored KV of skipped tokens is appended to
the cache and each run of recomputed tokens is a forward at its place in the prompt, so it sees
(attends to) the whole assembled context before it; its linear layers start from the state the
policy carried there. A chunk recomputed whole leaves the states its forward computed, so
recomputing every token is full prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from hybridkv.cache.assemble import zero_states
from hybridkv.cache.chunks import EncodedChunk
from hybridkv.models import HybridModel
from hybridkv.models.adapter import read_states, shift_kv, write_kv, write_states
from hybridkv.models.kv import LinearStates


class AttentionPolicy(Protocol):
    name: str
    corrects_positions: bool  # stored keys are moved to where their chunk now sits (RoPE re-rotated)

    def recompute(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> list[list[int]]:
        """For each chunk, the indices (inside it) of the tokens whose KV is recomputed."""
        ...

    def selection_layer_tokens(self, model: HybridModel, chunks: list[EncodedChunk], question: torch.Tensor) -> int:
        """Tokens × layers that choosing them pushed through the model (0 for a fixed rule)."""
        ...


class LinearPolicy(Protocol):
    name: str
    needs_maps: bool  # the chunks must be encoded with their composition maps
    stores_states: bool  # the chunks' end states are kept and read (False: every chunk's states start from zero)

    def seam(self, chunk: EncodedChunk) -> int:
        """The first tokens of a chunk that must be recomputed for this policy (0: none)."""
        ...

    def after(self, model: HybridModel, chunk: EncodedChunk, at_seam: LinearStates | None) -> LinearStates:
        """The states carried past a chunk not recomputed whole (`at_seam`: the states after its seam)."""
        ...

    def at_question(self, chunks: list[EncodedChunk], carried: LinearStates, question: torch.Tensor) -> LinearStates:
        """The states the question starts from, given those carried past the last chunk (asked only
        when some context token was not recomputed: otherwise the carried states are exact)."""
        ...


@dataclass(frozen=True)
class ChunkOutcome:
    logits: torch.Tensor  # float32 [logits_to_keep, vocab]
    cache: DynamicCache  # ready to decode after the question
    reused_tokens: int  # context tokens whose stored KV was used
    recomputed_tokens: int  # context and question tokens pushed through the model
    selection_layer_tokens: int = 0  # tokens × layers run to choose what to recompute


def runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as contiguous [start, end) runs."""
    spans: list[tuple[int, int]] = []
    for index in sorted(set(indices)):
        if spans and spans[-1][1] == index:
            spans[-1] = (spans[-1][0], index + 1)
        else:
            spans.append((index, index + 1))
    return spans


# A run of recomputed tokens that starts inside a chunk has no state of its own for the linear
# layers: the state there is the chunk's (and the context's) up to that token, which nothing
# stored holds. The executor replays the WARMUP tokens before such a run from the state it has
# (the last run's, or the one carried into the chunk): the short convolutions' windows become
# exact after K - 1 tokens, and gates that forget fast rebuild the rest (Tail-Replay's bet, per
# run). Without it a token picked mid-chunk (ProphetKV's fact sentence) was recomputed from a
# state that skipped everything between the runs and its KV came out worse than the stored one.
WARMUP = 32


def with_warmup(spans: list[tuple[int, int]], warmup: int) -> list[tuple[int, int]]:
    """Each run that starts inside the chunk begins `warmup` tokens earlier (not before the chunk or
    the run before it); runs that then touch are merged."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        start = max(start - warmup, out[-1][1] if out else 0) if start > 0 else 0
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def top_within_budget(scores: list[torch.Tensor], budget: int, skip_chunks: int = 0) -> list[list[int]]:
    """For each chunk, the indices of the best-scored tokens (over all chunks after the first
    `skip_chunks`, best first) that the executor can recompute in `budget` tokens, counting the
    warm-up it puts before every run that starts inside a chunk. Tokens are taken best first; one
    that would not fit is passed over (a cheaper one further down may). A score of -inf is never
    picked."""
    picks: list[list[int]] = [[] for _ in scores]
    ranked = [(float(value), chunk, index) for chunk, score in enumerate(scores) if chunk >= skip_chunks
              for index, value in enumerate(score.tolist()) if value != float("-inf")]  # fmt: skip
    ranked.sort(key=lambda item: -item[0])
    # What `with_warmup` recomputes is the union of [index - WARMUP, index] over the picks, so a
    # token's cost is the part of its own window not yet covered.
    covered = [[False] * score.numel() for score in scores]
    spent = 0
    for _, chunk, index in ranked:
        window = range(max(index - WARMUP, 0), index + 1)
        grown = sum(not covered[chunk][i] for i in window)
        if spent + grown > budget:
            continue
        for i in window:
            covered[chunk][i] = True
        picks[chunk].append(index)
        spent += grown
    return [sorted(chosen) for chosen in picks]


def execute_chunks(
    model: HybridModel,
    chunks: list[EncodedChunk],
    question: torch.Tensor,
    attention: AttentionPolicy,
    linear: LinearPolicy,
    logits_to_keep: int = 1,
) -> ChunkOutcome:
    question = question.reshape(-1).to(torch.long)
    picks = attention.recompute(model, chunks, question)

    def stored(chunk: EncodedChunk, at: int, start: int, end: int) -> None:
        kv = chunk.kv.narrow(start, end)
        if attention.corrects_positions:
            kv = shift_kv(model, kv, at - chunk.start)
        write_kv(cache, kv, append=True)

    cache = model.new_cache()
    carried = zero_states(model)
    exact = True  # every chunk so far recomputed whole: the carried states are the prompt's own
    position = recomputed = 0
    for chunk, picked in zip(chunks, picks, strict=True):
        seam = linear.seam(chunk)
        spans = with_warmup(runs([*picked, *range(seam)]), WARMUP)
        if spans:
            write_states(cache, carried)  # what the recomputed tokens' linear layers start from
        at_seam, cursor = None, 0
        for start, end in spans:
            recomputed += end - start
            if start > cursor:
                stored(chunk, position, cursor, start)
            if start < seam < end:  # read the states at the seam, where the maps start
                model.forward(chunk.tokens[start:seam], cache, start=position + start)
                at_seam = read_states(model.description, cache)
                start = seam
            model.forward(chunk.tokens[start:end], cache, start=position + start)
            if end == seam:
                at_seam = read_states(model.description, cache)
            cursor = end
        if cursor < len(chunk):
            stored(chunk, position, cursor, len(chunk))
        whole = spans == [(0, len(chunk))]
        carried = read_states(model.description, cache) if whole else linear.after(model, chunk, at_seam)
        exact = exact and whole
        position += len(chunk)
    write_states(cache, carried if exact else linear.at_question(chunks, carried, question))
    logits = model.forward(question, cache, start=position, logits_to_keep=logits_to_keep)
    context = sum(len(chunk) for chunk in chunks)
    selection = attention.selection_layer_tokens(model, chunks, question)
    return ChunkOutcome(logits, cache, context - recomputed, recomputed + question.numel(), selection)
