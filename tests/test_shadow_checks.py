"""What the shadow process computes for a served answer (`shadow.check`), on the trained servable
model (tiny-qwen3-next-vllm), whose needle answers are decisive (top-1 leads of 1.5 nats and more
up to its end of text): a served answer that is exact greedy passes, one wrong digit is found where
it is, and an answer that runs on past exact greedy's end diverges at that end."""

from __future__ import annotations

import pytest
import torch

from hybridkv.eval.workloads import get_workload
from hybridkv.integrations.vllm.shadow import EXACT, FULL, ZERO, ShadowJob, check, check_answer
from hybridkv.models.tiny import WEIGHTS_DIR
from hybridkv.models.tokenizer import load_tokenizer

MODEL = WEIGHTS_DIR / "tiny-qwen3-next-vllm"
LEAD = 1.0  # every answer token's top-1 lead over the second, in nats, for the test to mean anything


@pytest.fixture(scope="module")
def answered(models):
    """A needle prompt, and the model's greedy answer to it up to its end-of-text token, decoded one
    token at a time on a cache (another code path than the shadow's one teacher-forced pass)."""
    model = models[str(MODEL)]
    tokenizer = load_tokenizer(str(MODEL))
    sample = get_workload("ruler").generate("niah_single_1", 1024, 1, tokenizer, 7)[0]
    prompt = [t for piece in sample.segments() for t in tokenizer.encode(piece)] + tokenizer.encode(sample.question)
    ends = model.eos_ids
    cache, answer, leads = model.new_cache(), [], []
    logits = model.forward(torch.tensor(prompt), cache, 0, 1)
    while not answer or answer[-1] not in ends:
        assert len(answer) < 32, "the model never ended its answer"
        top = logits[-1].log_softmax(-1).topk(2)
        answer.append(int(top.indices[0]))
        leads.append(float(top.values[0] - top.values[1]))
        logits = model.forward(torch.tensor(answer[-1:]), cache, len(prompt) + len(answer) - 1, 1)
    assert min(leads) >= LEAD, leads  # decisive: no near-tie for two code paths to split
    assert sample.golds[0] in tokenizer.decode(answer)  # and right: the model solves it
    return model, prompt, answer


def test_a_served_answer_equal_to_exact_greedy_passes(answered):
    model, prompt, answer = answered
    assert check_answer(model, prompt, answer) == (None, None, 0)
    assert check_answer(model, prompt, answer[:1]) == (None, None, 0)  # a one-token answer too


def test_a_wrong_token_is_found_where_it_is_with_its_gap(answered):
    model, prompt, answer = answered
    for at in (0, 3, len(answer) - 2):
        wrong = (answer[at] + 1) % model.config.vocab_size
        served = answer[:at] + [wrong] + answer[at + 1 :]
        diverged_at, gap, mismatches = check_answer(model, prompt, served)
        assert diverged_at == at and mismatches >= 1
        # the gap is log p(exact argmax) - log p(served) at that position, from the exact prefix
        logits = model.forward(torch.tensor(prompt + answer[:at]), model.new_cache(), 0, 1)[-1].double()
        log_p = logits.log_softmax(-1)
        assert gap == pytest.approx(float(log_p.max() - log_p[wrong]), rel=1e-4)
        assert gap >= LEAD


def test_an_answer_running_on_past_exact_greedys_end_diverges_at_that_end(answered):
    """Exact greedy ends with its end-of-text token; a served answer that carries on instead (as
    zero-state tails on tiny-nemotron-h do) parts from it at the answer's end, not before."""
    model, prompt, answer = answered
    run_on = answer[:-1] + [answer[-2], answer[-3]]  # no end-of-text: two more tokens instead
    assert check_answer(model, prompt, run_on)[0] == len(answer) - 1


def test_a_zero_state_job_also_checks_its_recipes_first_token_and_other_kinds_do_not(answered):
    model, prompt, answer = answered
    s = len(prompt) - 40
    zero = check(model, ShadowJob("z", prompt, ZERO, "zero@0.05", s, answer))
    assert (zero.answer_length, zero.diverged_at, zero.error) == (len(answer), None, None)
    assert zero.top1_agrees is not None and zero.kl >= 0.0 and zero.reproduced is (zero.top1_agrees is True)
    for kind in (FULL, EXACT):
        other = check(model, ShadowJob("x", prompt, kind, kind, s if kind == EXACT else 0, answer))
        assert (other.answer_length, other.top1_agrees, other.kl, other.reproduced) == (len(answer), None, None, None)
    # a sampled (not greedy) zero-state resume: its first token alone
    sampled = check(model, ShadowJob("s", prompt, ZERO, "zero@0.05", s, None))
    assert sampled.answer_length == 0 and sampled.top1_agrees is not None and sampled.reproduced is None
