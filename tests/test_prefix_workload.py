"""The prefix workload: shared documents, diverging questions, every fact findable exactly once."""

from __future__ import annotations

import pytest

from hybridkv.eval.workloads.prefix import FACTS_PER_DOCUMENT, TOKENS_TO_GENERATE, generate
from hybridkv.models.tokenizer import ByteTokenizer


@pytest.mark.parametrize("length", [2048, 8192])
def test_questions_share_documents_and_fit(length):
    tokenizer = ByteTokenizer()
    samples = generate("prefix", length, 12, tokenizer, seed=3)
    assert len(samples) == 12 and len({s.id for s in samples}) == 12
    documents = {}
    for sample in samples:
        documents.setdefault(sample.meta["document"], set()).add(sample.context)
        prompt_tokens = len(tokenizer.encode(sample.context + sample.question))
        assert prompt_tokens + TOKENS_TO_GENERATE["prefix"] <= length
        assert prompt_tokens > 0.9 * length  # grown to fill the budget, not left short
        (gold,) = sample.golds
        assert sample.context.count(gold) == 1  # the answer is in the shared document exactly once
        key = sample.question.split("magic number for ")[1].split(" mentioned")[0]
        assert f"magic numbers for {key} is: {gold}." in sample.context
        assert gold not in sample.question
    assert len(documents) == 2 and all(len(contexts) == 1 for contexts in documents.values())
    first = [s for s in samples if s.meta["document"] == 0]
    assert len(first) == FACTS_PER_DOCUMENT and len({s.question for s in first}) == FACTS_PER_DOCUMENT


def test_generation_is_seeded():
    tokenizer = ByteTokenizer()
    assert generate("prefix", 2048, 4, tokenizer, seed=1) == generate("prefix", 2048, 4, tokenizer, seed=1)
    assert generate("prefix", 2048, 4, tokenizer, seed=1) != generate("prefix", 2048, 4, tokenizer, seed=2)
