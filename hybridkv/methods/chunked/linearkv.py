"""linearkv (linear, LinearKV): one cached state initialises each linear layer.

Past a chunk, a linear layer carries that chunk's own end state (encoded on its own, from zero),
so recomputed tokens of the next chunk continue from the most recent local context. At the
question it starts from one chunk's end state:

- `linearkv`: the last chunk's, the one nearest the question (what a linear layer would carry
  anyway, and the choice that needs no look at the question);
- `linearkv-relevant`: the chunk that shares the most of the question's token 4-grams (a lexical
  retriever's score on the model's own tokens; ties go to the later chunk). The LinearKV abstract
  does not say which state it takes; a question about one passage is best served by that
  passage's state, and the overlap is how a retriever would find it without running the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.cache.chunks import EncodedChunk
from hybridkv.models import HybridModel
from hybridkv.models.kv import LinearStates

NGRAM = 4


def _ngrams(tokens: torch.Tensor) -> set[tuple[int, ...]]:
    ids = tokens.tolist()
    return {tuple(ids[i : i + NGRAM]) for i in range(len(ids) - NGRAM + 1)}


def most_relevant(chunks: list[EncodedChunk], question: torch.Tensor) -> int:
    """The index of the chunk sharing the most question 4-grams (the last one on a tie)."""
    asked = _ngrams(question)
    scores = [len(asked & _ngrams(chunk.tokens)) for chunk in chunks]
    return max(range(len(chunks)), key=lambda i: (scores[i], i))


@dataclass(frozen=True)
class LinearKV:
    relevant: bool = False
    needs_maps: bool = False
    stores_states: bool = True

    @property
    def name(self) -> str:
        return "linearkv-relevant" if self.relevant else "linearkv"

    def seam(self, chunk: EncodedChunk) -> int:
        return 0

    def after(self, model: HybridModel, chunk: EncodedChunk, at_seam: LinearStates | None) -> LinearStates:
        return chunk.end_states

    def at_question(self, chunks: list[EncodedChunk], carried: LinearStates, question: torch.Tensor) -> LinearStates:
        if not self.relevant:
            return carried
        return chunks[most_relevant(chunks, question)].end_states
