"""The multi-turn workload: each turn's context is exactly the previous turn's prompt."""

from __future__ import annotations

from hybridkv.eval.workloads.multi_turn import TOKENS_TO_GENERATE, generate
from hybridkv.models.tokenizer import ByteTokenizer


def test_every_turn_extends_the_previous_prompt_and_needs_the_cache():
    tokenizer = ByteTokenizer()
    samples = generate("multi-turn", 4096, 10, tokenizer, seed=5)
    assert len(samples) == 10 and len({s.id for s in samples}) == 10
    by_conversation: dict[int, list] = {}
    for sample in samples:
        by_conversation.setdefault(sample.meta["conversation"], []).append(sample)
        assert len(tokenizer.encode(sample.context + sample.question)) + TOKENS_TO_GENERATE["multi-turn"] <= 4096
        (gold,) = sample.golds
        assert gold in sample.context and gold not in sample.question  # only the cached turns hold the answer
        assert sample.question.endswith("Assistant:")
    for turns in by_conversation.values():
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.context == earlier.context + earlier.question  # the new turn's cache is the old prompt
    final = by_conversation[0][-1]
    assert len(tokenizer.encode(final.context + final.question)) > 0.8 * 4096  # grown to fill the length


def test_generation_is_seeded():
    tokenizer = ByteTokenizer()
    assert generate("multi-turn", 2048, 3, tokenizer, seed=1) == generate("multi-turn", 2048, 3, tokenizer, seed=1)
    assert generate("multi-turn", 2048, 3, tokenizer, seed=1) != generate("multi-turn", 2048, 3, tokenizer, seed=2)
