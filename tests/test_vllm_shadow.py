"""Shadow checks (`shadow_rate`, `shadow_floor`) without a server: settings, sampling, the floor,
and which finished requests the scheduler queues, on vLLM's own classes (`test_vllm_scheduling`'s
engine). `test_vllm_serve.py` runs the checks themselves through `vllm serve`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hybridkv.errors import HybridKVError  # noqa: E402
from hybridkv.integrations.vllm.config import ConnectorConfig  # noqa: E402
from hybridkv.integrations.vllm.shadow import ShadowResult, sampled  # noqa: E402
from hybridkv.methods import Budget  # noqa: E402
from tests.test_vllm_glm_groups import BLOCK, load, look_up, make_engine, request, tokens  # noqa: E402
from tests.test_vllm_scheduling import plain_config, plain_hybrid_specs, request_blocks, save  # noqa: E402, F401


def test_shadow_settings_parse_and_bad_values_stop_the_engine_in_one_line():
    default = ConnectorConfig.parse({}, "model")
    assert (default.shadow_rate, default.shadow_floor, default.shadow_window) == (0.0, None, 50)
    assert (default.shadow_ladder, default.shadow_on_error) == ((Budget(0.2), Budget(0.5)), "ignore")
    set_ = ConnectorConfig.parse(
        {"shadow_rate": 0.25, "shadow_floor": 0.3, "shadow_window": 8, "shadow_ladder": ["0.3", "512tok"],
         "shadow_on_error": "exact"}, "model",
    )  # fmt: skip
    assert (set_.shadow_rate, set_.shadow_floor, set_.shadow_window) == (0.25, 0.3, 8)
    assert (set_.shadow_ladder, set_.shadow_on_error) == ((Budget(0.3), Budget(tokens=512)), "exact")
    assert ConnectorConfig.parse({"shadow_rate": 1}, "model").shadow_rate == 1.0
    assert ConnectorConfig.parse({"shadow_ladder": []}, "model").shadow_ladder == ()
    for bad in (-0.1, 1.5, "0.5", True, math.nan, None):
        with pytest.raises(HybridKVError, match=r"^shadow_rate .*: a share of requests to check, from 0 to 1$"):
            ConnectorConfig.parse({"shadow_rate": bad}, "model")
    for bad in (0, 1.2, "0.1", False, math.nan):
        with pytest.raises(HybridKVError, match=r"^shadow_floor .*: an excess divergence rate above 0, at most 1$"):
            ConnectorConfig.parse({"shadow_rate": 0.5, "shadow_floor": bad}, "model")
    with pytest.raises(HybridKVError, match=r"^shadow_floor 0\.2 needs shadow_rate > 0"):
        ConnectorConfig.parse({"shadow_floor": 0.2}, "model")
    for bad in (1, 0, 2.5, "8", True):
        with pytest.raises(HybridKVError, match=r"^shadow_window .*: a number of checks, at least 2$"):
            ConnectorConfig.parse({"shadow_window": bad}, "model")
    for bad in ("0.2", [1.5], ["lots"], [None]):
        with pytest.raises(HybridKVError, match=r"^shadow_ladder "):
            ConnectorConfig.parse({"shadow_ladder": bad}, "model")
    with pytest.raises(HybridKVError, match=r"^shadow_on_error 'strict': \"ignore\" or \"exact\"$"):
        ConnectorConfig.parse({"shadow_on_error": "strict"}, "model")
    for bad in ("", 3):
        with pytest.raises(HybridKVError, match=r"^shadow_log .*: a file path$"):
            ConnectorConfig.parse({"shadow_log": bad}, "model")


def test_sampling_is_a_hash_of_the_request_id_at_the_rate():
    ids = [f"cmpl-{i}" for i in range(4000)]
    assert not any(sampled(i, 0.0) for i in ids) and all(sampled(i, 1.0) for i in ids)
    picked = [i for i in ids if sampled(i, 0.25)]
    assert picked == [i for i in ids if sampled(i, 0.25)]  # the same ids every time
    # binomial(4000, 0.25): sd 27; 5 sd either side
    assert abs(len(picked) - 1000) < 140
    assert set(picked) <= {i for i in ids if sampled(i, 0.5)}  # a higher rate keeps every lower one's ids


class RecordingShadow:
    """Stands in for the shadow process: records the checks queued, takes at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.jobs = []
        self.dead = False

    def submit(self, job) -> bool:
        if len(self.jobs) >= self.capacity:
            return False
        self.jobs.append(job)
        return True

    def shutdown(self) -> None:
        pass


@pytest.fixture
def shadowed_engine(plain_config, tmp_path):  # noqa: F811
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    from hybridkv.integrations.vllm.writes import StoreWriter

    groups = get_kv_cache_groups(plain_config, plain_hybrid_specs())
    engine = make_engine(
        plain_config, get_kv_cache_config_from_groups(plain_config, groups, 16 * 2**20),
        f"file://{tmp_path / 'store'}", shadow_rate=1.0, shadow_floor=0.5, shadow_window=2, shadow_ladder=["0.5"],
    )  # fmt: skip
    yield engine
    engine.worker.shutdown()
    engine.scheduler.shutdown()
    StoreWriter.drain_all()


def finished(req, outputs: list[int], greedy: bool = True):
    """The request as vLLM hands it to `request_finished`: answered with `outputs`."""
    req.output_token_ids = outputs
    req.sampling_params = SimpleNamespace(temperature=0.0 if greedy else 0.8)
    return req


def test_every_kind_of_finished_request_is_queued_with_what_it_served_and_the_guard_climbs(shadowed_engine):
    """Finished requests go to the shadow with their kind: a miss as `full` (the control group), a
    resume from the stored exact state as `exact`, one from zero states as `zero@<budget>`; each
    with the tokens it served where they were greedy (a sampled full prefill has nothing to check,
    a sampled zero-state resume still has its first token checked). A full queue drops one
    (counted). Results flagged at the floor over a window step the ladder up, rung by rung: a
    larger tail, then exact stored states only, then full prefills, as each lookup then shows."""
    from hybridkv.integrations.vllm.shadow import EXACT, FULL, ZERO

    engine = shadowed_engine
    side = engine.scheduler._side
    shadow = side.shadow.checker = RecordingShadow(capacity=6)
    stored = tokens(4 * BLOCK, 1)
    save(engine, stored, request_blocks(engine, 0, 4))  # its state at its end: an exact checkpoint there

    def serve(req_id, prompt, outputs, first_block, greedy=True):
        req = request(req_id, prompt)
        start = look_up(engine, req)
        if start:
            load(engine, req, start, request_blocks(engine, first_block, 5))
        engine.scheduler.request_finished_all_groups(finished(req, outputs, greedy), ())
        return start

    miss = tokens(3 * BLOCK, 7)
    assert serve("miss", miss, [5, 6], 20) == 0
    assert serve("miss-sampled", tokens(3 * BLOCK, 8), [5, 6], 20, greedy=False) == 0  # not queued
    diverging = stored[: 3 * BLOCK] + tokens(30, 2)
    zero_start = serve("zero", diverging, [17, 3], 20)
    assert zero_start == 3 * BLOCK - round(0.05 * 3 * BLOCK)  # the budget's tail, from zero states
    assert serve("zero-sampled", stored[: 3 * BLOCK] + tokens(30, 3), [4], 40, greedy=False) == zero_start
    extending = stored + tokens(30, 4)
    assert serve("exact", extending, [9], 60) == len(stored)  # the stored exact state
    assert [(j.request_id, j.kind, j.label, j.start, j.served, j.rung) for j in shadow.jobs] == [
        ("miss", FULL, FULL, 0, [5, 6], 0),
        ("zero", ZERO, "zero@0.05", zero_start, [17, 3], 0),
        ("zero-sampled", ZERO, "zero@0.05", zero_start, None, 0),
        ("exact", EXACT, EXACT, len(stored), [9], 0),
    ]
    assert shadow.jobs[1].tokens == diverging
    shadow.capacity = len(shadow.jobs)
    serve("dropped", stored[: 2 * BLOCK] + tokens(30, 5), [1], 80)  # the queue is full: dropped
    counters = engine.scheduler.get_kv_connector_stats().data["counters"]
    assert (counters["shadow_queued"], counters["shadow_dropped"]) == (4, 1)
    assert side.shadow_guard.unavailable and side.shadow_guard.effective_rung == 0  # "ignore": resumes go on

    full_job, zero_job, _, exact_job = shadow.jobs
    side.shadow.done(full_job, ShadowResult("miss", answer_length=2))  # the control: clean
    assert not side.shadow_guard.unavailable  # a check came back
    side.shadow.done(exact_job, ShadowResult("exact", answer_length=1))
    assert side.shadow_guard.rung == 0  # the window (2) is not full yet
    side.shadow.done(zero_job, ShadowResult("zero", answer_length=2, diverged_at=1, gap=0.3, top1_agrees=True, kl=1e-3))
    assert side.shadow_guard.rung == 1  # the window: clean, flagged; 0.5 over the control's 0 reaches the floor
    stats = engine.scheduler.get_kv_connector_stats().data
    assert stats["shadow_answers"] == {"full": [1, 0, []], "exact": [1, 0, []], "zero@0.05": [1, 1, [1]]}
    assert stats["counters"]["shadow_checks"] == 3 and stats["counters"]["shadow_first_token_checks"] == 1
    assert stats["counters"]["shadow_escalations"] == 1 and stats["gauges"]["shadow_rung"] == 1

    # rung 1: the ladder's larger tail, 0.5 of the match
    assert look_up(engine, request("tail", stored[: 3 * BLOCK] + tokens(30, 6))) == 3 * BLOCK - round(0.5 * 3 * BLOCK)
    for _ in range(2):
        side.shadow.done(at_rung(zero_job, 1), ShadowResult("z", answer_length=1, diverged_at=0, gap=1.0))
    assert side.shadow_guard.rung == 2 == side.shadow_guard.exact_rung
    # rung 2: exact stored states only; no exact state in reach is a full prefill
    assert look_up(engine, request("after", stored[: 3 * BLOCK] + tokens(30, 7))) == 0
    assert look_up(engine, request("exact-after", stored + tokens(30, 8))) == len(stored)  # exact resumes go on
    for _ in range(2):
        side.shadow.done(at_rung(exact_job, 2), ShadowResult("e", answer_length=1, diverged_at=0, gap=1.0))
    assert side.shadow_guard.rung == 3 == side.shadow_guard.top
    assert look_up(engine, request("top", stored + tokens(30, 9))) == 0  # nothing read at the top


def at_rung(job, rung: int):
    """`job` as if looked up at `rung`."""
    import dataclasses

    return dataclasses.replace(job, rung=rung)


def test_a_shadow_model_that_does_not_load_fails_each_check_with_why_and_nothing_waits(tmp_path):
    """The shadow process answers every job with the reason its model did not load; the checker
    hands that to the scheduler as a failed check (counted in `shadow_failed`)."""
    import threading

    from hybridkv.integrations.vllm.shadow import ShadowChecker, ShadowJob

    results, done = [], threading.Event()

    def on_result(job, result):
        results.append(result)
        done.set()

    checker = ShadowChecker(str(tmp_path / "no-such-checkpoint"), "bfloat16", on_result, capacity=1)
    try:
        assert checker.submit(ShadowJob("a", [5, 6, 7], "zero", "zero@0.05", 2, None))
        assert not checker.submit(ShadowJob("b", [5, 6, 7], "zero", "zero@0.05", 2, None))  # capacity 1: dropped
        assert done.wait(timeout=120), "the shadow process never answered"
    finally:
        checker.shutdown()
    assert [(r.request_id, r.error is not None) for r in results] == [("a", True)]
    assert "did not load" in results[0].error and "no-such-checkpoint" in results[0].error
    assert checker.pending == 0


def test_a_misspelt_connector_setting_is_refused_and_every_known_one_is_read():
    """A setting the connector does not read would silently run at its default; every key `SETTINGS`
    lists parses with a valid value."""
    from hybridkv.integrations.vllm.config import SETTINGS

    with pytest.raises(HybridKVError, match=r"^unknown kv_connector_extra_config setting\(s\) 'replay_bugdet'; known"):
        ConnectorConfig.parse({"replay_bugdet": 0.2}, "model")
    valid = {"store": "file:///tmp/x", "replay_budget": 0.2, "method": "adaptive-replay", "replay_horizon": 64,
             "cache_salt": "a", "save_states": False, "max_held_mib": 8, "shadow_rate": 0.5, "shadow_floor": 0.3,
             "shadow_window": 5, "shadow_ladder": ["0.4"], "shadow_on_error": "exact",
             "shadow_log": "/tmp/checks.jsonl"}  # fmt: skip
    assert set(valid) == SETTINGS
    config = ConnectorConfig.parse(valid, "model")
    assert (config.replay_budget.fraction, config.replay_horizon, config.save_states, config.max_held_bytes) == (
        0.2, 64, "never", 8 * 2**20,
    )  # fmt: skip
    assert config.method.name == "adaptive-replay" and ConnectorConfig.parse({}, "model").method.name == "seeded-replay"


def test_save_states_is_a_policy_and_value_needs_a_store_kept_by_value():
    parse = ConnectorConfig.parse
    assert [parse({"save_states": v}, "m").save_states for v in (True, False, "always", "never")] == [
        "always", "never", "always", "never",
    ]  # fmt: skip
    assert parse({}, "m").save_states == "always"
    kept = "redis://127.0.0.1:6379?capacity=1000000&policy=value"
    assert parse({"save_states": "value", "store": kept}, "m").save_states == "value"
    for store in ("file:///tmp/x?capacity=1000", "redis://127.0.0.1:6379?capacity=1000"):
        with pytest.raises(HybridKVError, match=r"^save_states 'value' needs a store kept by value"):
            parse({"save_states": "value", "store": store}, "m")
    with pytest.raises(HybridKVError, match=r"^save_states 'sometimes': one of always, never, value"):
        parse({"save_states": "sometimes"}, "m")


def test_a_method_vllm_cannot_run_is_refused_at_start_and_a_requests_own_falls_back(monkeypatch):
    from hybridkv.integrations.vllm.lookup import request_budget, request_method
    from hybridkv.methods import METHODS
    from hybridkv.methods.tail_replay import TailReplay

    with pytest.raises(HybridKVError, match=r"^unknown method 'last-64'; known: full, "):
        ConnectorConfig.parse({"method": "last-64"}, "model")
    monkeypatch.setitem(METHODS, "tail-replay", TailReplay(engine_resumable=False))
    with pytest.raises(HybridKVError, match=r"^method 'tail-replay' cannot run in vLLM: its recipe needs more"):
        ConnectorConfig.parse({"method": "tail-replay"}, "model")
    # A request naming one gets the engine's method (the request is served, not failed).
    config = ConnectorConfig.parse({"method": "zero-state"}, "model")
    ask = [SimpleNamespace(request_id="r", kv_transfer_params=params)
           for params in ({"method": "tail-replay"}, {"method": "checkpoint"}, {"method": 3}, None)]  # fmt: skip
    assert [request_method(config, r).name for r in ask] == ["zero-state", "checkpoint", "zero-state", "zero-state"]
    budgets = [SimpleNamespace(request_id="r", kv_transfer_params={"replay_budget": b}) for b in ("0.2", "lots", 2)]
    assert [str(request_budget(config, r)) for r in budgets] == ["0.2", "0.05", "0.05"]  # a bad one: the engine's


def test_a_shadow_process_killed_mid_check_fails_its_jobs_says_so_and_the_next_job_starts_another(monkeypatch):
    """Killed while a check is pending (the process is still loading its model, so the check cannot
    have finished): the pending check fails with why, `on_down` hears of it, a job within the
    restart delay is refused, and one after it starts a new process that answers."""
    import os
    import signal
    import threading
    import time

    from hybridkv.integrations.vllm import shadow as shadow_module
    from hybridkv.integrations.vllm.shadow import ShadowChecker, ShadowJob
    from tests.test_vllm_arena import MODEL

    results, downs, answered = [], [], threading.Event()

    def on_result(job, result):
        results.append((job.request_id, result))
        answered.set()

    checker = ShadowChecker(str(MODEL), "float32", on_result, on_down=downs.append)
    job = ShadowJob("a", [5, 6, 7, 8], "full", "full", 0, [9])
    try:
        assert checker.submit(job)
        deadline = time.monotonic() + 30
        while checker.pid is None:
            assert time.monotonic() < deadline, "the shadow process never started"
            time.sleep(0.01)
        os.kill(checker.pid, signal.SIGKILL)
        assert answered.wait(timeout=60), "the pending check never failed"
        assert [(rid, r.error is not None and "exited" in r.error) for rid, r in results] == [("a", True)]
        assert len(downs) == 1 and "exited" in downs[0]
        assert checker.dead and not checker.submit(ShadowJob("b", [5, 6, 7, 8], "full", "full", 0, [9]))
        monkeypatch.setattr(shadow_module, "RESTART_AFTER_S", 0.0)  # the delay has passed
        answered.clear()
        assert not checker.dead and checker.submit(ShadowJob("c", [5, 6, 7, 8], "full", "full", 0, [9]))
        assert answered.wait(timeout=120), "the restarted shadow process never answered"
    finally:
        checker.shutdown()
    rid, result = results[-1]
    assert rid == "c" and result.error is None and result.answer_length == 1


def test_a_runs_shadow_figures_per_kind_come_from_the_difference_of_two_readings():
    """`shadow_figures` reads the per-kind series between two readings of `Server.metrics`: answers,
    divergences, the mean first diverging position, and the excess over the control (full) with
    Newcombe's interval on this run's counts alone."""
    from hybridkv.eval.stats import Excess
    from hybridkv.serving.bench import shadow_figures

    def reading(full: tuple[int, int], zero: tuple[int, int, float], first_token: tuple[int, int]) -> dict:
        series = {
            "vllm:hybridkv_shadow_checks_total": full[0] + zero[0],
            "vllm:hybridkv_shadow_first_token_checks_total": first_token[0],
            "vllm:hybridkv_shadow_top1_disagreements_total": first_token[1],
        }
        for kind, (n, d, *rest) in (("full", full), ("zero@0.05", zero)):
            series[f'vllm:hybridkv_shadow_answers_total{{kind="{kind}"}}'] = n
            series[f'vllm:hybridkv_shadow_answer_divergences_total{{kind="{kind}"}}'] = d
            series[f'vllm:hybridkv_shadow_divergence_position_sum{{kind="{kind}"}}'] = rest[0] if rest else 0.0
        return series

    before = reading((10, 1), (5, 5, 40.0), (5, 2))  # an earlier run's counts on the same server
    after = reading((30, 2), (25, 9, 52.0), (25, 3))
    figures = shadow_figures(before, after)
    assert figures["shadow_checks"] == 40 and figures["shadow_first_token_checks"] == 20
    assert figures["shadow_disagreement_rate"] == 1 / 20
    answers = figures["shadow_answers"]
    assert set(answers) == {"full", "zero@0.05"}
    assert answers["full"] == {"answers": 20, "divergences": 1, "divergence_rate": 0.05,
                               "mean_divergence_position": 0.0, "excess": None, "excess_ci95": None}  # fmt: skip
    zero, expected = answers["zero@0.05"], Excess.of(4, 20, 1, 20)
    assert (zero["answers"], zero["divergences"], zero["mean_divergence_position"]) == (20, 4, 3.0)
    assert zero["excess"] == pytest.approx(0.15) and zero["excess_ci95"] == [expected.low, expected.high]


def test_the_arena_sets_each_served_answers_verdict_against_whether_it_changed(tmp_path):
    """`shadow_prediction_table` joins the shadow log's lines to the served arena's rows by the id
    the arena sent (inside the engine's): per setting and kind, the answers that diverged and their
    excess over the run's full-prefill answers; and flagged against differs-from-full per setting."""
    import json

    from hybridkv.eval.stats import Excess
    from hybridkv.report.arena_report import shadow_prediction_table

    def row(sample, method, budget, prediction, request_id):
        return {"id": sample, "method": method, "budget": budget, "prediction": prediction, "request_id": request_id}

    def check(i, kind, label, diverged_at, length=2):
        return {"request_id": f"cmpl-{sent[i]}-0-1a2b3c4d", "kind": kind, "label": label, "answer_length": length,
                "diverged_at": diverged_at}  # fmt: skip

    sent = [f"arena-{i:032x}" for i in range(8)]
    rows = [
        row("a", "full", None, "42", "arena-full-a"), row("b", "full", None, "7", "arena-full-b"),
        row("a", "tail-replay", 0.05, "42 and on", sent[0]),  # differs, flagged
        row("b", "tail-replay", 0.05, "7", sent[1]),  # same, flagged (a false alarm)
        row("a", "checkpoint", None, "42", sent[2]),  # same, not flagged
        row("b", "checkpoint", None, "8", sent[3]),  # differs, missed
        row("a", "tail-replay", 0.2, "42", sent[4]),  # no check logged for it: left out
        row("a", "tail-replay", 1.0, "42", sent[6]),  # recomputed in full: the control, clean
        row("b", "tail-replay", 1.0, "7", sent[7]),  # the control, diverged (the engine's own noise)
    ]  # fmt: skip
    checks = [
        check(0, "zero", "zero@0.05", 4), check(1, "zero", "zero@0.05", 0),
        check(2, "exact", "exact", None), check(3, "exact", "exact", None),
        check(6, "full", "full", None), check(7, "full", "full", 1),
        {"request_id": "cmpl-arena-context-0-0", "kind": "full", "label": "full", "answer_length": 1,
         "diverged_at": 3},  # a context's first request: no row, not in the control
        check(5, "full", "full", None, length=0),  # not an answer check
    ]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "shadow-checks.jsonl").write_text("".join(json.dumps(c) + "\n" for c in checks))
    table = "\n".join(shadow_prediction_table(tmp_path))
    assert "(1/2 diverged" in table  # the control: the rows computed by full prefill
    excess = Excess.of(2, 2, 1, 2)
    assert f"| tail-replay@0.05 | zero@0.05 | 2 | 2 | 2 | 0.5 [{excess.low:.3g}, {excess.high:.3g}] |" in table
    assert "| checkpoint | exact | 2 | 0 | — | -0.5 [" in table
    assert "| tail-replay@1 | full | 2 | 1 | 1 | — |" in table
    assert "| tail-replay@0.05 | 1 | 1 | 0 | 0 | 0.5 | 1 |" in table
    assert "| checkpoint | 0 | 0 | 1 | 1 | — | 0 |" in table
    assert "| all | 1 | 2 | 1 | 2 | 0.333 | 0.5 |" in table
    assert "tail-replay@0.2" not in table
    assert shadow_prediction_table(tmp_path / "elsewhere") == []
