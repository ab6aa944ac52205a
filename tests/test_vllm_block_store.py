"""The vLLM connector's bytes without vLLM: block entries, token-level matching, replay starts,
checkpoints, corrupt entries and tenants' namespaces."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybridkv.cache.variants import MAX_VARIANTS
from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import BlockStore, EntryWorths
from hybridkv.methods import Budget, PositionsMatch
from hybridkv.methods.seeded_replay import SeededReplay
from hybridkv.store.base import NO_WORTH, Worth
from hybridkv.store.guarded import GuardedStore
from hybridkv.store.memory import MemoryStore
from tests.helpers import RoundTripStore

BLOCK = 16
SEEDED = SeededReplay()  # what the connector runs by default
LAYOUT = {"attn.0": 64, "attn.1": 64}
STATES = {"gdn.0": 40}


def pages_for(tokens: list[int], first: int = 0) -> list[dict[str, torch.Tensor]]:
    """Block pages whose bytes say which tokens they hold, so a load can be checked exactly."""
    out = []
    for start in range(first * BLOCK, len(tokens), BLOCK):
        seed = sum(tokens[start : start + BLOCK]) + start
        out.append({name: torch.arange(seed, seed + 64, dtype=torch.int64).to(torch.uint8) for name in LAYOUT})
    return out


@pytest.fixture
def blocks() -> BlockStore:
    return BlockStore(GuardedStore(MemoryStore()), "ab" * 32, BLOCK)


def _start(matched: int, budget: Budget, checkpoints: tuple[int, ...]) -> tuple[int, bool]:
    recipe = SeededReplay().recipe(PositionsMatch(matched, checkpoints), budget)
    return recipe.state_position, recipe.state_seed


def test_the_block_store_start_is_seeded_replays_choice_from_block_metadata():
    assert _start(1000, Budget(fraction=0.05), ()) == (950, False)
    assert _start(1000, Budget(fraction=0.05), (960, 990, 1200)) == (990, True)
    assert _start(1000, Budget(fraction=0.05), (900,)) == (950, False)  # outside the budget
    assert _start(1000, Budget(fraction=1.0), ()) == (0, False)
    assert _start(100, Budget(tokens=256), ()) == (0, False)


def test_matching_is_token_level_inside_a_block_and_never_takes_the_last_token(blocks):
    stored = list(range(3, 3 + 50))  # 3 full blocks and a partial one
    assert blocks.save_blocks(stored, 0, pages_for(stored)) == 4
    diverging = stored[:37] + [999] * 20
    found = blocks.match(diverging, LAYOUT)
    assert found.length == 37 and len(found.blocks) == 3
    assert [b["attn.0"].tolist() for b in found.blocks] == [p["attn.0"].tolist() for p in pages_for(stored)[:3]]
    assert blocks.match(stored, LAYOUT).length == 49  # one token is always left to compute
    assert blocks.match([7] + stored[1:], LAYOUT).length == 0


def test_prompts_diverging_inside_a_block_each_keep_their_blocks(blocks):
    """A RAG header followed by different passages: every passage set keeps its own blocks, the
    first one included, whichever was stored last; so do prompts shorter than one block."""
    header = [1, 2, 3, 4, 5]
    passages = [header + list(range(100 * k, 100 * k + 50)) for k in range(1, 4)]  # 3.4 blocks each
    short = [header + [900 + k] * 6 for k in range(3)]  # inside block 0
    for prompt in passages + short:
        blocks.save_blocks(prompt, 0, pages_for(prompt))
    for prompt in passages + short:
        found = blocks.match(prompt + [7], LAYOUT)
        assert found.length == len(prompt)
        assert [b["attn.0"].tolist() for b in found.blocks] == [p["attn.0"].tolist() for p in pages_for(prompt)]
    assert blocks.match(header + [4242] * 30, LAYOUT).length == len(header)  # the shared start, from any


def test_a_slot_lists_a_bounded_number_of_blocks_the_newest_first(blocks):
    prompts = [[1, 2, 3] + [50 + k] * 8 for k in range(MAX_VARIANTS + 1)]
    for prompt in prompts:
        blocks.save_blocks(prompt, 0, pages_for(prompt))
    assert blocks.match(prompts[0] + [7], LAYOUT).length == 3  # the oldest left the list
    assert all(blocks.match(p + [7], LAYOUT).length == len(p) for p in prompts[1:])


def test_a_match_ending_where_a_shorter_prompt_ended_resumes_from_its_checkpoint(blocks):
    """P, then P extended (a conversation's next turn) are stored; a request diverging right after
    P finds both blocks equally long, and takes P's, whose entry records the state at its end."""
    prompt = list(range(5, 45))  # ends inside block 2
    state = {"gdn.0": torch.arange(40, dtype=torch.uint8)}
    blocks.save_blocks(prompt, 0, pages_for(prompt), state_at=len(prompt))
    blocks.save_state(prompt, len(prompt), state)
    extended = prompt + list(range(300, 310))
    blocks.save_blocks(extended, 2, pages_for(extended, first=2))
    resume = blocks.resume(prompt + [999] * 10, LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert (resume.matched, resume.start) == (40, 40) and resume.states is not None


def test_a_second_question_on_a_shared_document_resumes_from_the_document_s_checkpoint(blocks):
    """The document D (state stored at its end), then D + question 1 (its blocks after D's start,
    its own state at its end). Question 2 shares question 1's first words, so its match runs past
    D's end through question 1's block, which marks no state at D's end: the resume still starts
    exactly there, from D's state, instead of replaying a tail from zeros."""
    document = list(range(5, 45))  # ends inside block 2
    state = {"gdn.0": torch.arange(40, dtype=torch.uint8)}
    blocks.save_blocks(document, 0, pages_for(document), state_at=len(document))
    blocks.save_state(document, len(document), state)
    first = document + [300, 301, 302, 303, 304]
    blocks.save_blocks(first, 2, pages_for(first, first=2), state_at=len(first))
    blocks.save_state(first, len(first), {"gdn.0": torch.zeros(40, dtype=torch.uint8)})
    second = document + [300, 301, 999, 998, 997]
    resume = blocks.resume(second, LAYOUT, STATES, SEEDED, Budget(fraction=0.2))
    assert (resume.matched, resume.start, resume.exact) == (42, 40, True)
    assert torch.equal(resume.states["gdn.0"], state["gdn.0"]) and len(resume.blocks) == 3
    # A state that never was stored there (a zero-state server's document) is a zero-state tail.
    blocks.store.delete(blocks.state_key(document, len(document)))
    resume = blocks.resume(second, LAYOUT, STATES, SEEDED, Budget(fraction=0.2))
    assert (resume.start, resume.states, resume.exact) == (34, None, False)


def test_a_checkpoint_at_a_saved_prompts_end_is_found_and_loaded(blocks):
    prompt = list(range(5, 45))
    state = {"gdn.0": torch.arange(40, dtype=torch.uint8)}
    blocks.save_blocks(prompt, 0, pages_for(prompt), state_at=len(prompt))
    assert blocks.save_state(prompt, len(prompt), state)
    longer = prompt + [1, 2, 3]
    resume = blocks.resume(longer, LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert (resume.matched, resume.start) == (40, 40)
    assert torch.equal(resume.states["gdn.0"], state["gdn.0"]) and len(resume.blocks) == 3
    # Without the state entry the same hit falls back to a zero-state tail replay.
    blocks.store.delete(blocks.state_key(prompt, len(prompt)))
    resume = blocks.resume(longer, LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert (resume.start, resume.states) == (38, None) and len(resume.blocks) == 3


def test_pages_of_a_zero_state_replay_never_pass_for_an_exact_resume(blocks):
    """Turn 2 of a conversation resumed from a zero state: its KV after the replay start and its
    final state are approximate. Turn 3 still loads them (a better seed than zeros), but the
    resume says it is not exact; an exactly computed turn says it is."""
    turn2 = list(range(5, 45))
    state = {"gdn.0": torch.arange(40, dtype=torch.uint8)}
    blocks.save_blocks(turn2, 0, pages_for(turn2), state_at=len(turn2), exact=False)
    blocks.save_state(turn2, len(turn2), state, exact=False)
    resume = blocks.resume(turn2 + [1, 2, 3], LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert (resume.start, resume.exact) == (40, False) and resume.states is not None
    exact = list(range(100, 140))
    blocks.save_blocks(exact, 0, pages_for(exact), state_at=len(exact))
    blocks.save_state(exact, len(exact), state)
    assert blocks.resume(exact + [1], LAYOUT, STATES, SEEDED, Budget(fraction=0.05)).exact
    # an exact state on inexact blocks is no exact resume either
    mixed = list(range(200, 240))
    blocks.save_blocks(mixed, 0, pages_for(mixed)[:1], exact=False)
    blocks.save_blocks(mixed, 1, pages_for(mixed, first=1), state_at=len(mixed))
    blocks.save_state(mixed, len(mixed), state)
    resume = blocks.resume(mixed + [1], LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert resume.start == 40 and resume.states is not None and not resume.exact
    # an inexact state on exact blocks is no exact resume either
    late = list(range(400, 440))
    blocks.save_blocks(late, 0, pages_for(late), state_at=len(late))
    blocks.save_state(late, len(late), state, exact=False)
    resume = blocks.resume(late + [1], LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert resume.start == 40 and resume.states is not None and not resume.exact
    # a zero-state tail replay is never exact; a full replay (nothing loaded) is
    assert blocks.resume(exact[:30] + [9, 9], LAYOUT, STATES, SEEDED, Budget(fraction=1.0)).exact
    zero = blocks.resume(exact[:30] + [9, 9], LAYOUT, STATES, SEEDED, Budget(fraction=0.1))
    assert zero.start > 0 and zero.states is None and not zero.exact


def test_a_batched_backend_reads_the_same_match_in_fewer_round_trips_and_verifies_only_what_it_uses():
    prompt = list(range(3, 3 + 20 * BLOCK))  # 20 blocks
    batched = BlockStore(GuardedStore(RoundTripStore()), "ab" * 32, BLOCK)
    single = BlockStore(GuardedStore(MemoryStore()), "ab" * 32, BLOCK)
    for store in (batched, single):
        store.save_blocks(prompt, 0, pages_for(prompt))
    batched.store.inner.trips = 0
    want, got = single.match(prompt + [1], LAYOUT), batched.match(prompt + [1], LAYOUT)
    assert got.length == want.length == len(prompt) and len(got.blocks) == 20
    assert all(torch.equal(a["attn.0"], b["attn.0"]) for a, b in zip(got.blocks, want.blocks, strict=True))
    assert batched.store.inner.trips == 5  # 1 + 2 + 4 + 8 + 5 blocks
    # A match ending inside a batch (blocks 3-6 are read together) leaves the batch's later entries
    # unverified: corrupt blocks 4 and 6, and only block 4 is counted and removed.
    keys = batched.block_keys(prompt)
    for index in (4, 6):
        data = bytearray(batched.store.inner.get(keys[index]))
        data[-40] ^= 0xFF
        batched.store.inner.put(keys[index], bytes(data))
    assert batched.match(prompt + [1], LAYOUT).length == 4 * BLOCK
    assert batched.store.stats()["corrupt"] == 1
    assert batched.store.inner.get(keys[4]) is None and batched.store.inner.get(keys[6]) is not None


def test_corrupt_or_foreign_entries_shorten_the_match_and_are_removed(blocks):
    prompt = list(range(3, 60))
    blocks.save_blocks(prompt, 0, pages_for(prompt))
    keys = blocks.block_keys(prompt)
    data = bytearray(blocks.store.get(keys[2]))
    data[-40] ^= 0xFF
    blocks.store.put(keys[2], bytes(data))
    assert blocks.match(prompt + [1], LAYOUT).length == 2 * BLOCK
    assert blocks.store.get(keys[2]) is None and blocks.store.stats()["corrupt"] == 1
    assert blocks.match(prompt + [1], {"attn.0": 64}).length == 0  # another engine's layout
    other = BlockStore(blocks.store, "cd" * 32, BLOCK)  # another model: its keys never meet ours
    assert other.match(prompt + [1], LAYOUT).length == 0


def test_a_requests_cache_salt_is_its_own_namespace(blocks):
    """vLLM's per-request cache_salt: a tenant reads its own pages, never another's or the unsalted ones."""
    prompt = list(range(3, 40))
    blocks.save_blocks(prompt, 0, pages_for(prompt), salt="tenant-a")
    assert blocks.match(prompt + [1], LAYOUT, salt="tenant-a").length == len(prompt)
    assert blocks.match(prompt + [1], LAYOUT, salt="tenant-b").length == 0
    assert blocks.match(prompt + [1], LAYOUT).length == 0
    state = {"gdn.0": torch.arange(40, dtype=torch.uint8)}
    assert blocks.save_state(prompt, len(prompt), state, salt="tenant-a")
    assert blocks.state_key(prompt, len(prompt), "tenant-a") != blocks.state_key(prompt, len(prompt), "tenant-b")
    # An engine salt and a request salt cannot be confused for another split of the same text.
    one, two = BlockStore(blocks.store, "ab" * 32, BLOCK, "x"), BlockStore(blocks.store, "ab" * 32, BLOCK, "")
    assert one.block_keys(prompt, "y") != two.block_keys(prompt, "xy") and one.block_keys(prompt) != two.block_keys(
        prompt
    )


def test_first_token_fidelity_from_top_k_logprobs():
    from hybridkv.serving.bench import first_token_fidelity

    reference = {1: math.log(0.5), 2: math.log(0.3)}  # 0.2 left for every other token
    assert first_token_fidelity(reference, dict(reference)) == (1.0, 0.0)
    got = {2: math.log(0.6), 1: math.log(0.2)}  # 0.2 left as well
    agree, kl = first_token_fidelity(reference, got)
    expected = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.6)  # the "other" buckets are equal
    assert agree == 0.0 and kl == pytest.approx(expected)
    # A reference token outside `got`'s top k is charged at most `got`'s smallest logprob.
    _, bounded = first_token_fidelity({1: math.log(0.5), 3: math.log(0.4)}, {1: math.log(0.5), 2: math.log(0.1)})
    assert bounded == pytest.approx(0.4 * math.log(0.4 / 0.1) + 0.1 * math.log(0.1 / 0.4))


def test_vllm_bench_rejects_bad_options_before_starting_vllm(capsys):
    from hybridkv.cli import main

    for argv, message in (
        (["--budgets", "2.0"], "outside [0, 1]"),
        (["--model", "/nonexistent/model"], "not a checkpoint directory"),
        (["--workloads", "shared-system,nope"], "unknown nope"),
        (["--clients", "0"], "--clients"),
        (["--min-prefix", "4096", "--max-prefix", "1024"], "--min-prefix"),
    ):
        assert main(["vllm-bench", *argv]) == 2
        assert message in capsys.readouterr().err


def test_server_workloads_share_prefixes_where_they_say_and_differ_per_client_count():
    from hybridkv.serving.traffic import Shape, make_sessions

    shape = Shape(min_prefix=300, max_prefix=3000, requests=24, block_size=384)

    def shared(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    turns = make_sessions("multi-turn", shape, 0, 1)
    for conversation in turns:  # every turn extends the last
        assert all(b[: len(a)] == a for a, b in zip(conversation, conversation[1:], strict=False))
    grid = [s[0] for s in make_sessions("grid-aligned", shape, 0, 1)]
    prefixes = {shared(a, b) for a in grid for b in grid if a is not b and a[:8] == b[:8]}
    # Matches end on the grid; two random suffixes may begin with the same token or two by chance.
    assert prefixes and all(p % 384 < 3 for p in prefixes) and len(prefixes) > 1
    rag = [s[0] for s in make_sessions("rag-mix", shape, 0, 1)]
    repeats = sum(any(shared(r, o) > 300 for o in rag[:i]) for i, r in enumerate(rag))
    assert 0 < repeats < len(rag)  # some requests hit passages seen before, some bring new ones
    assert make_sessions("shared-system", shape, 0, 1) != make_sessions("shared-system", shape, 0, 4)
    assert make_sessions("shared-system", shape, 0, 4) == make_sessions("shared-system", shape, 0, 4)


def test_a_trained_model_is_sent_text_and_a_random_weight_model_random_ids(tmp_path):
    from hybridkv.models.tokenizer import load_tokenizer
    from hybridkv.serving.bench import prompt_tokens
    from hybridkv.serving.models import DEFAULT_BENCH_MODEL, bench_checkpoint
    from hybridkv.serving.traffic import Shape, Tokens, make_sessions

    shape = Shape(min_prefix=300, max_prefix=3000, requests=12, block_size=384)
    trained = bench_checkpoint(DEFAULT_BENCH_MODEL, tmp_path)
    tokens = prompt_tokens(str(trained), shape)
    assert tokens.kind == "text" and len(tokens.text) >= 2 * shape.max_prefix
    text = load_tokenizer(str(trained)).decode(list(tokens.text))
    assert text.count(". ") > 100 and text.isascii()  # sentences, not noise
    for name in ("shared-system", "multi-turn", "rag-mix", "grid-aligned"):
        for session in make_sessions(name, shape, 0, 1, tokens):
            for prompt in session:  # each prompt is whole pieces of the text, cut at seeded places
                piece = prompt[:64]
                assert any(list(tokens.text[i : i + 64]) == piece for i in range(len(tokens.text) - 63))
    # the random-id path is the one the grid models always had
    assert prompt_tokens(str(bench_checkpoint("grid-640", tmp_path)), shape) == Tokens()
    assert make_sessions("rag-mix", shape, 0, 1) == make_sessions("rag-mix", shape, 0, 1, Tokens())
    with pytest.raises(HybridKVError, match="longer than the 10-token text"):
        Tokens(text=tuple(range(10))).draw(random.Random(0), 11)


def test_vllm_bench_summary_report_and_plot(tmp_path):
    from hybridkv.serving.bench import BenchPlan, plot, report, summarise
    from hybridkv.serving.server import Reply

    def replies(ttft, top, cached=0, hybridkv=None):
        one = Reply(ttft, {top: -0.1, 9: -3.0}, 100, cached, hybridkv)
        return [[one], [one, one]]  # two sessions, three requests

    plan = BenchPlan("m", ["shared-system"], [4], ["0.05"])
    measured = {
        ("no-cache", None): {"block_size": 2176, "results": {("shared-system", 4): (replies(1.0, 1), 3.0, None)}},
        ("vllm-prefix-cache", None): {
            "block_size": 2176, "results": {("shared-system", 4): (replies(0.25, 1, cached=64), 1.5, None)}
        },
        ("hybridkv", "0.05"): {  # a different top token: agreement 0
            "block_size": 2176,
            "results": {("shared-system", 4): (
                replies(0.5, 9, hybridkv={"matched": 90, "reused": 80}), 1.0,
                {"hook_ms_per_request": 1.5, "wait_ms_per_request": 3.0, "copy_ms_per_request": 0.5,
                 "lookup_ms_per_request": 4.0, "write_ms_per_request": 2.0},
            )},
        },
    }  # fmt: skip
    rows = {r["config"]: r for r in summarise(plan, measured)["rows"]}
    assert rows["vllm-prefix-cache"]["ttft_mean_s"] == 0.25 and rows["vllm-prefix-cache"]["throughput_rps"] == 2.0
    assert rows["vllm-prefix-cache"]["reused_tokens_per_request"] == 64
    assert rows["hybridkv"]["reused_tokens_per_request"] == 80 and rows["hybridkv"]["replayed_tokens_per_request"] == 10
    assert rows["hybridkv"]["top1_agreement"] == 0.0 and rows["hybridkv"]["kl_mean"] > 0
    assert rows["no-cache"]["kl_mean"] == 0.0 and rows["no-cache"]["requests"] == 3
    assert rows["hybridkv"]["hook_ms_per_request"] == 1.5 and rows["no-cache"]["hook_ms_per_request"] is None
    summary = summarise(plan, measured)
    plot(summary, "shared-system", tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"
    text = report(summary)
    assert text.count("\n| 4 | ") == 3 and "hybridkv@0.05" in text  # one row per configuration
    assert "| 1.5 / 3.0 / 0.5 / 4.0 / 2.0 |" in text
    assert "| shared-system | 4 | 0.05 | 2.00 | 1.50 |" in text  # TTFT 0.5 / 0.25, throughput 3.0 / 2.0


def test_cold_requests_are_those_no_cache_reused_a_token_on_and_are_reported_apart():
    """A prefix's first request is prefilled in full by every configuration: the align-mode table
    gives hybridkv's TTFT share on those and the ratio over the rest, which is what a cache can change."""
    from hybridkv.serving.bench import BenchPlan, report, summarise
    from hybridkv.serving.server import Reply

    def run(ttfts, reused, connector=False):
        made = [
            Reply(t, {1: -0.1, 9: -3.0}, 100, 0 if connector else r, {"matched": r, "reused": r} if connector else None)
            for t, r in zip(ttfts, reused, strict=True)
        ]
        return [made[:2], made[2:]]  # two sessions of two turns

    plan = BenchPlan("m", ["shared-system"], [1], ["0.05"])
    results = {
        ("no-cache", None): run([4.0, 1.0, 4.0, 1.0], [0, 0, 0, 0]),
        # align reuses nothing on the first turns (cold) nor on the second turn of session 1
        ("vllm-prefix-cache", None): run([4.0, 0.8, 4.0, 1.0], [0, 64, 0, 0]),
        ("hybridkv", "0.05"): run([4.0, 0.2, 4.0, 0.2], [0, 90, 0, 90], connector=True),
    }
    measured = {k: {"block_size": 64, "results": {("shared-system", 1): (r, 1.0, None)}} for k, r in results.items()}
    rows = {r["config"]: r for r in summarise(plan, measured)["rows"]}
    assert [rows[c]["cold_requests"] for c in rows] == [2, 2, 2]
    assert rows["hybridkv"]["ttft_cold_sum_s"] == 8.0 and rows["hybridkv"]["ttft_rest_mean_s"] == 0.2
    assert rows["vllm-prefix-cache"]["ttft_rest_mean_s"] == 0.9
    text = report(summarise(plan, measured))
    # TTFT 2.1 / 2.45 overall; 8.0 of 8.4 s on the two cold requests, equal to align's; 0.2 / 0.9 on the rest
    # computed tokens: hybridkv 100 + 10 + 100 + 10, align 100 + 36 + 100 + 100; unmatched: hybridkv's 220 - 180
    assert "| shared-system | 1 | 0.05 | 0.86 | 1.00 | 2/4 | 95% | 1.00 | 0.22 | 0.65 | 0.65 |" in text


def test_clear_lead_top1_counts_flips_on_a_clear_lead_and_leaves_out_near_ties():
    """The split noise is the largest logprob gap between vLLM's own cache and vLLM alone; a
    request counts in `top1_clear` only where the reference's lead exceeds twice it."""
    from hybridkv.serving.bench import BenchPlan, report, split_noise, summarise
    from hybridkv.serving.server import Reply

    # The reference's first-token logprobs (binary fractions: every difference below is exact).
    reference = [
        {1: -1.0, 2: -2.0, 3: -3.0},  # lead 1.0
        {1: -1.0, 2: -1.25, 3: -3.0},  # lead 0.25: exactly twice the noise, so a near-tie
        {1: -1.0, 2: -2.0, 3: -3.0},  # lead 1.0
        {4: -0.5, 5: -1.5, 6: -3.0},  # lead 1.0
    ]
    cache = [dict(r) for r in reference]
    cache[3][5] = -1.625  # off by 0.125 on one token: the noise
    cache[0][3] = -3.0625  # a smaller gap elsewhere does not set it
    hybrid = [dict(r) for r in reference]
    hybrid[0] = {1: -2.0, 2: -1.5, 3: -3.0}  # flips where the reference led by 1.0: counts against
    hybrid[1] = {1: -1.25, 2: -1.0, 3: -3.0}  # flips a near-tie: left out
    hybrid[2][3] = -2.5  # agrees despite a gap
    noise, clear = 0.125, [0, 2, 3]  # by construction: leads 1.0, 0.25, 1.0, 1.0 against 2 * 0.125

    assert split_noise(list(zip(reference, cache, strict=True))) == noise

    def replies(tops, hybridkv=None):  # two conversations of two turns each
        one = [Reply(0.5, lp, 100, 0, hybridkv) for lp in tops]
        return [[one[0], one[1]], [one[2], one[3]]]

    plan = BenchPlan("m", ["shared-system"], [4], ["0.05"])
    measured = {
        ("no-cache", None): {"block_size": 64, "results": {("shared-system", 4): (replies(reference), 4.0, None)}},
        ("vllm-prefix-cache", None): {"block_size": 64, "results": {("shared-system", 4): (replies(cache), 2.0, None)}},
        ("hybridkv", "0.05"): {
            "block_size": 64,
            "results": {
                ("shared-system", 4): (replies(hybrid, {"matched": 90, "reused": 80, "exact_state": False}), 1.0, None)
            },
        },
    }
    summary = summarise(plan, measured)
    assert summary["split_noise"] == {"4": noise}
    rows = {r["config"]: r for r in summary["rows"]}
    agrees = [max(r, key=r.get) == max(h, key=h.get) for r, h in zip(reference, hybrid, strict=True)]
    assert rows["hybridkv"]["top1_agreement"] == sum(agrees) / 4 == 0.5
    assert rows["hybridkv"]["clear_requests"] == len(clear) == 3
    assert rows["hybridkv"]["top1_clear"] == pytest.approx(sum(agrees[i] for i in clear) / len(clear))  # 2 / 3
    assert rows["vllm-prefix-cache"]["top1_clear"] == rows["no-cache"]["top1_clear"] == 1.0
    flips = [(d["session"], d["turn"], d["lead"], d["gap"], d["clear"]) for d in summary["disagreements"]]
    assert flips == [(0, 0, 1.0, 1.0, True), (0, 1, 0.25, 0.25, False)]
    text = report(summary)
    assert "| 0.500 | 0.667 (3) |" in text and "4 clients 0.1250" in text
    assert "| shared-system | 4 | hybridkv@0.05 | 0 / 1 | 0.2500 | 0.2500 | 2.0 |" in text and "near-tie |" in text
    # Without vLLM's cache in the run there is no noise to clear: no clear-lead figure.
    del measured[("vllm-prefix-cache", None)]
    bare = {r["config"]: r for r in summarise(plan, measured)["rows"]}
    assert bare["hybridkv"]["top1_clear"] is None and bare["hybridkv"]["clear_requests"] == 0


def test_the_connectors_writer_waits_for_earlier_saves_only_survives_failures_and_bounds_its_backlog():
    """A lookup waits for the saves queued before it (a conversation's last turn), not for ones
    queued while it waits; a save that raises still counts as done; a full backlog refuses more."""
    import threading

    pytest.importorskip("vllm")
    from hybridkv.integrations.vllm.writes import StoreWriter

    writer = StoreWriter("file:///unused")
    first, later, later_began = threading.Event(), threading.Event(), threading.Event()
    written: list[str] = []
    writer.submit(lambda: (first.wait(10), written.append("first")))
    writer.submit(lambda: 1 / 0)  # a failing save
    assert not writer.drain(timeout=0.2)  # the first save is still held
    mark = writer.mark()  # a drain begun now waits for these two saves
    writer.submit(lambda: (later_began.set(), later.wait(10), written.append("later")))  # after the drain began
    first.set()
    assert writer.wait(mark, timeout=10) and written == ["first"]  # it did not wait for the later save
    assert later_began.wait(10)  # the later save holds the thread; these queue behind it
    for _ in range(StoreWriter.MAX_BACKLOG):
        writer.submit(lambda: written.append("queued"))
    assert writer.full()
    later.set()
    assert writer.drain(timeout=10) and not writer.full()
    assert written == ["first", "later"] + ["queued"] * StoreWriter.MAX_BACKLOG
    writer.close()
    assert writer not in StoreWriter.registry.get("file:///unused", [])


def test_a_lookup_waits_for_the_saves_to_its_own_store_only():
    """`drain_store` waits for the writes queued to its store in this process, not for another
    store's (a stalled store elsewhere never holds a lookup back)."""
    import threading

    pytest.importorskip("vllm")
    from hybridkv.integrations.vllm.writes import StoreWriter

    ours, theirs = StoreWriter("memory://ours"), StoreWriter("memory://theirs")
    stalled, written = threading.Event(), []
    theirs.submit(lambda: stalled.wait(10))
    ours.submit(lambda: written.append("ours"))
    drained = threading.Thread(target=StoreWriter.drain_store, args=("memory://ours",))
    drained.start()
    drained.join(timeout=2)  # waiting for the stalled store would take DRAIN_TIMEOUT_S (5 s)
    assert not drained.is_alive() and written == ["ours"]
    assert not theirs.drain(timeout=0.1)  # which is still stalled
    stalled.set()
    ours.close()
    theirs.close()
    assert not StoreWriter.registry.get("memory://ours") and not StoreWriter.registry.get("memory://theirs")


def test_a_bench_model_directory_holding_another_bench_model_is_refused(tmp_path):
    pytest.importorskip("vllm")
    from hybridkv.errors import HybridKVError
    from hybridkv.serving.models import write_servable

    path = write_servable(tmp_path / "model", "grid-640")
    assert write_servable(path, "grid-640") == path  # the same model: reused as written
    with pytest.raises(HybridKVError, match="holds another model than grid-2048"):
        write_servable(path, "grid-2048")  # its grid would silently be 640, not 2,176


class _WorthLog(MemoryStore):
    """A memory store that records the worth each write carried."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.worths: dict[str, Worth] = {}

    def put(self, key, data, worth=NO_WORTH):
        self.worths[key] = worth
        return super().put(key, data, worth)


@pytest.mark.parametrize("save_states", ["always", "value"])
def test_a_saves_entries_carry_their_chain_and_the_compute_they_save(save_states):
    """Each block depends on the one before it and saves its own tokens' prefill (here a stand-in
    cost: one per token, squared by position so order matters); the state depends on the block
    holding its position and saves the whole prefix ("always") or only the tail replay it spares
    ("value", a 25% budget)."""

    def flops(start: int, end: int) -> float:
        return float(end * end - start * start)

    tail = None if save_states == "always" else (lambda p: round(0.25 * p))
    log = _WorthLog()
    blocks = BlockStore(GuardedStore(log), "ab" * 32, BLOCK, worths=EntryWorths(flops, tail))
    prompt = list(range(5, 75))  # 70 tokens: blocks 0-3 whole, block 4 partial
    assert blocks.save_blocks(prompt, 0, pages_for(prompt), state_at=70) == 5
    assert blocks.save_state(prompt, 70, {"gdn.0": torch.arange(40, dtype=torch.uint8)})
    keys = blocks.block_keys(prompt)
    for index, key in enumerate(keys):
        start, end = index * BLOCK, min((index + 1) * BLOCK, 70)
        assert log.worths[key] == Worth("kv-block", flops(start, end), keys[index - 1] if index else None)
    state = log.worths[blocks.state_key(prompt, 70)]
    assert (state.kind, state.parent) == ("state", keys[4])
    assert state.saved == (flops(0, 70) if save_states == "always" else flops(70 - 18, 70))
    # a later turn saves from block 4 on: its first block depends on the stored block 3
    longer = prompt + list(range(500, 540))
    assert blocks.save_blocks(longer, 4, pages_for(longer, first=4)) == 3
    assert log.worths[blocks.block_keys(longer)[4]].parent == keys[3]


def test_under_a_value_kept_capacity_every_stored_block_is_reachable_and_loads_its_own_pages():
    """Conversations with shared system prompts written into a store too small for them, kept by
    value: the rule evicts leaves first, so every block held has its parent held, a refused block
    stops its prompt's save, and every resume loads exactly the pages stored for its tokens."""
    rng = random.Random(5)
    store = MemoryStore(40_000, rule="value")
    blocks = BlockStore(GuardedStore(store), "ab" * 32, BLOCK, worths=EntryWorths(lambda s, e: float(e * e - s * s)))
    systems = [[rng.randrange(1000, 2000) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    prompts = []
    for turn in range(60):
        base = rng.choice(prompts) if prompts and rng.random() < 0.5 else rng.choice(systems)
        prompt = base + [rng.randrange(2000, 3000) for _ in range(rng.randrange(5, 40))]
        found = blocks.match(prompt + [1], LAYOUT).length
        first = found // BLOCK
        blocks.save_blocks(prompt, first, pages_for(prompt, first=first), state_at=len(prompt))
        blocks.save_state(prompt, len(prompt), {"gdn.0": torch.full((40,), turn % 256, dtype=torch.uint8)})
        prompts.append(prompt)
    assert store.evictions > 10 and store.stats()["bytes"] <= 40_000
    for prompt in prompts:  # what each prompt still has stored is a prefix of its blocks
        held = [store.get(key) is not None for key in blocks.block_keys(prompt)]
        assert held == sorted(held, reverse=True)
    for prompt in prompts:
        resume = blocks.resume(prompt + [7], LAYOUT, STATES, SEEDED, Budget(fraction=0.25))
        want = pages_for(prompt)
        assert all(
            torch.equal(got[name], want[i][name][: got[name].numel()]) for i, got in enumerate(resume.blocks)
            for name in LAYOUT
        )  # fmt: skip


def test_an_approximate_save_never_replaces_the_exact_entries_its_match_read(blocks):
    """A prompt stored exactly, then sent again and resumed from a zero state (one token is always
    left to compute): its save, approximate, leaves the stored block and state as they were."""
    prompt = list(range(5, 5 + 3 * BLOCK))  # three whole blocks
    state = {"gdn.0": torch.arange(40, dtype=torch.uint8)}
    blocks.save_blocks(prompt, 0, pages_for(prompt), state_at=len(prompt))
    assert blocks.save_state(prompt, len(prompt), state)
    again = blocks.resume(prompt, LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert (again.matched, again.states, again.exact) == (len(prompt) - 1, None, False)
    other = {"gdn.0": torch.full((40,), 99, dtype=torch.uint8)}
    first = again.matched // BLOCK  # the block the match ended in, as the connector saves
    changed = [{name: page ^ 0xFF for name, page in block.items()} for block in pages_for(prompt, first=first)]
    assert blocks.save_blocks(prompt, first, changed, state_at=len(prompt), exact=False) == 0
    assert not blocks.save_state(prompt, len(prompt), other, exact=False)
    resume = blocks.resume(prompt + [7], LAYOUT, STATES, SEEDED, Budget(fraction=0.05))
    assert resume.exact and torch.equal(resume.states["gdn.0"], state["gdn.0"])
    assert torch.equal(resume.blocks[-1]["attn.0"], pages_for(prompt)[-1]["attn.0"])
    # an exact save does write again (a use; the same bytes)
    assert blocks.save_state(prompt, len(prompt), state)
