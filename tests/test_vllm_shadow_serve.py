"""Shadow checks of what `vllm serve` actually served, on the trained servable model
(tiny-qwen3-next-vllm), which reads its needle answers from attention and answers decisively, so a
served answer either is exact greedy or is wrong: corrupted pages are flagged and the guard climbs
its ladder until answers equal vLLM alone's; clean resumes show no excess over the control group;
a killed shadow process does what `shadow_on_error` says."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

pytest.importorskip("vllm")

from hybridkv.eval.workloads import get_workload  # noqa: E402
from hybridkv.models.tokenizer import load_tokenizer  # noqa: E402
from hybridkv.serving.server import Server, ServerSpec, settle_shadow_checks  # noqa: E402
from tests.test_vllm_arena import MODEL, _swap_attention  # noqa: E402

ANSWER_TOKENS = 16


def needle_prompts(per_task: int) -> list[tuple[list[int], list[int]]]:
    """(context, question) token ids of single-needle samples at 1K, `per_task` of each task."""
    tokenizer, ruler = load_tokenizer(str(MODEL)), get_workload("ruler")
    samples = [s for t in ("niah_single_1", "niah_single_2") for s in ruler.generate(t, 1024, per_task, tokenizer, 7)]
    return [
        ([t for piece in s.segments() for t in tokenizer.encode(piece)], tokenizer.encode(s.question)) for s in samples
    ]


@pytest.fixture(scope="module")
def prompts() -> list[tuple[list[int], list[int]]]:
    return needle_prompts(2)


def post(server: Server, prompt: list[int], salt: str, max_tokens: int = ANSWER_TOKENS, greedy: bool = True) -> dict:
    """One completion: the tokens served and the connector's account of the request. Sampled (not
    greedy) requests have no one right answer, so the shadow checks none of their answers."""
    body = {"model": str(MODEL), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0 if greedy else 1.0,
            "return_token_ids": True, "cache_salt": salt}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).json()
    assert "choices" in reply, reply
    return {
        "tokens": reply["choices"][0]["token_ids"],
        "hybridkv": (reply.get("kv_transfer_params") or {}).get("hybridkv"),
    }


def shadowed(store, **settings) -> ServerSpec:
    """A connector checking every request, in a namespace of its own."""
    return ServerSpec(
        str(MODEL), "hybridkv", 2048, f"file://{store}", namespace=uuid.uuid4().hex, shadow_rate=1.0,
        connector_settings=settings,
    )  # fmt: skip


def by_kind(series: dict[str, float], name: str) -> dict[str, float]:
    prefix = f"vllm:hybridkv_{name}{{kind="
    return {key[len(prefix) + 1 : -2]: value for key, value in series.items() if key.startswith(prefix)}


def test_corrupted_pages_are_flagged_and_the_ladder_climbs_until_answers_equal_vllm_alones(prompts, tmp_path):
    """Each prompt's stored attention pages are swapped for another prompt's at the same positions
    (the scramble test's corruption: the needle's value is gone from them), and the connector trusts
    and loads them. Every answer served from them diverges from exact greedy before its end, so with
    a window of 4 and a floor of 0.5 the guard steps up after the first round (to exact stored states
    only, which still load the pages) and again after the second (to full prefills); the third
    round's answers are vLLM alone's, token for token, and nothing was read for them."""
    store = tmp_path / "store"
    with Server(ServerSpec(str(MODEL), "no-cache", 2048), tmp_path / "alone.log") as server:
        alone = [post(server, c + q, f"alone-{i}")["tokens"] for i, (c, q) in enumerate(prompts)]
    spec = shadowed(store, shadow_floor=0.5, shadow_window=len(prompts), shadow_ladder=[])
    with Server(spec, tmp_path / "connector.log") as server:
        for i, (context, _) in enumerate(prompts):
            post(server, context, f"kv-{i}", 1, greedy=False)  # stored with its final states; not checked
        swapped = _swap_attention(store)
        assert swapped, "no stored block had another prompt's page to swap in"
        # the control group: each question asked where nothing is stored (full prefills, exact answers);
        # after the swap, which would otherwise give a context's block the longer page of its own
        # question's prompt, needle and all
        control = [post(server, c + q, f"control-{i}") for i, (c, q) in enumerate(prompts)]
        before = settle_shadow_checks([server])
        rounds = []
        for _ in range(3):
            rounds.append([post(server, c + q, f"kv-{i}") for i, (c, q) in enumerate(prompts)])
            rounds[-1] = (rounds[-1], settle_shadow_checks([server]))
    (first, after_first), (second, after_second), (third, after_third) = rounds
    assert [r["tokens"] for r in control] == alone  # full prefills through the connector: vLLM alone's answers
    assert by_kind(before, "shadow_answers_total") == {"full": len(prompts)}
    assert by_kind(before, "shadow_answer_divergences_total").get("full", 0) == 0  # the control: no noise here
    for i, (context, _) in enumerate(prompts):
        # rounds 1 and 2 read the swapped pages, with an exact stored state at their end ...
        assert first[i]["hybridkv"] == {"matched": len(context), "reused": len(context), "exact_state": True}
        assert second[i]["hybridkv"]["reused"] >= len(context) and second[i]["hybridkv"]["exact_state"]
        assert first[i]["tokens"] != alone[i] and second[i]["tokens"] != alone[i]
        # ... the third read nothing, and answered as vLLM alone
        assert third[i]["hybridkv"]["reused"] == 0 and third[i]["tokens"] == alone[i]
    n = len(prompts)
    # every answer served from the swapped pages was flagged, before its end
    assert by_kind(after_first, "shadow_answer_divergences_total")["exact"] == n
    assert by_kind(after_second, "shadow_answer_divergences_total")["exact"] == 2 * n
    positions = after_second['vllm:hybridkv_shadow_divergence_position_sum{kind="exact"}'] / (2 * n)
    assert positions < ANSWER_TOKENS
    assert after_first["vllm:hybridkv_shadow_escalations_total"] == 1
    assert after_second["vllm:hybridkv_shadow_escalations_total"] == 2
    assert after_second["vllm:hybridkv_shadow_rung"] == 2  # no ladder tails: 1 exact states only, 2 full prefills
    excess = by_kind(after_second, "shadow_excess")["exact"]
    assert excess == 1.0 and by_kind(after_second, "shadow_excess_low")["exact"] > 0.0  # 8 of 8 against 0 of 4
    # the third round's full prefills are a clean window at the top: the guard steps back down
    assert by_kind(after_third, "shadow_answers_total")["full"] == 2 * n
    assert after_third["vllm:hybridkv_shadow_steps_down_total"] == 1
    assert after_third.get("vllm:hybridkv_shadow_failed_total", 0) == 0


def test_clean_resumes_show_no_excess_over_the_control_group(tmp_path):
    """Nothing corrupted: zero-state resumes at budget 0.05 (no stored states) and resumes from exact
    stored states diverge no more often than full prefills (the control group): each excess is 0
    within its 95% interval (over 8 answers a side, the interval leaves 0 once half of one side's
    answers diverge and none of the other's)."""
    prompts, answers_by_kind = needle_prompts(4), {}
    for save_states, kind in ((False, "zero@0.05"), (True, "exact")):
        spec = shadowed(tmp_path / f"store-{kind}", save_states=save_states)
        with Server(spec, tmp_path / f"{kind}.log") as server:
            for i, (context, question) in enumerate(prompts):
                post(server, context + question, f"control-{i}")
                post(server, context, f"resume-{i}", 1, greedy=False)
                reply = post(server, context + question, f"resume-{i}")
                assert reply["hybridkv"]["reused"] > 0 and reply["hybridkv"]["exact_state"] is save_states
            series = settle_shadow_checks([server])
        n = len(prompts)
        assert by_kind(series, "shadow_answers_total") == {"full": n, kind: n}
        low, high = by_kind(series, "shadow_excess_low")[kind], by_kind(series, "shadow_excess_high")[kind]
        assert low <= 0.0 <= high, (kind, low, high)
        answers_by_kind[kind] = by_kind(series, "shadow_answer_divergences_total")
    print(f"divergences per kind: {answers_by_kind}")


def _shadow_pid(server: Server) -> int:
    """The shadow process under the server (`python -m hybridkv.integrations.vllm.shadow`)."""
    import psutil

    found = [
        child.pid for child in psutil.Process(server._process.pid).children(recursive=True)
        if "hybridkv.integrations.vllm.shadow" in " ".join(child.cmdline())
    ]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Poll `condition` (which may send requests) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.5)


@pytest.mark.parametrize("policy", ["ignore", "exact"])
def test_a_killed_shadow_process_does_what_shadow_on_error_says(prompts, tmp_path, policy):
    """The shadow process is killed between requests. Under "ignore" the connector goes on resuming
    from zero states (the check of the next request fails, counted); under "exact" it resumes only
    from exact stored states (none here: full prefills) until a check succeeds again, which the
    next job after the restart delay brings; then zero-state resumes come back."""
    import os
    import signal

    spec = shadowed(tmp_path / "store", save_states=False, shadow_on_error=policy)
    context, question = prompts[0]
    with Server(spec, tmp_path / "server.log") as server:

        def resume(namespace: str) -> dict:  # the context stored (not checked), then its question
            post(server, context, namespace, 1, greedy=False)
            return post(server, context + question, namespace)

        first = resume("first")
        assert first["hybridkv"]["reused"] > 0 and not first["hybridkv"]["exact_state"]  # a zero-state resume
        settled = settle_shadow_checks([server])
        assert settled["vllm:hybridkv_shadow_checks_total"] == 1  # the shadow process is up
        os.kill(_shadow_pid(server), signal.SIGKILL)
        _until(
            lambda: settle_shadow_checks([server]).get("vllm:hybridkv_shadow_unavailable") == 1,
            "the connector saw the shadow process die",
        )
        during = resume("during")
        if policy == "ignore":
            assert during["hybridkv"]["reused"] == first["hybridkv"]["reused"]  # resumed as before
        else:
            assert during["hybridkv"]["reused"] == 0  # no exact state in reach: a full prefill
        assert during["tokens"] == first["tokens"]  # the trained model's answer either way

        def checked_again() -> bool:  # a later job starts the shadow process again, after its restart delay
            post(server, question, f"miss-{uuid.uuid4().hex}", 2)  # a full prefill, checked
            return settle_shadow_checks([server])["vllm:hybridkv_shadow_checks_total"] > 1

        _until(checked_again, "a check made by a restarted shadow process")
        assert settle_shadow_checks([server]).get("vllm:hybridkv_shadow_unavailable") == 0
        after = resume("after")
        assert after["hybridkv"]["reused"] == first["hybridkv"]["reused"]  # zero-state resumes again
        log = (tmp_path / "server.log").read_text()
    assert "shadow checks stop until the process starts again" in log
    assert ("until checks resume" in log) is (policy == "exact")
