"""The shadow guard's arithmetic without an engine: the 95% interval of an excess divergence rate,
the sliding window the floor judges, the ladder it steps up and back down, and what stopped checks
do under each `shadow_on_error` policy (`hybridkv/integrations/vllm/shadow.py`)."""

from __future__ import annotations

import pytest

from hybridkv.eval.stats import Excess, wilson
from hybridkv.integrations.vllm.shadow import CONTROL, EXACT, STORED, ShadowGuard, ShadowResult
from hybridkv.methods import Budget

ZERO_KIND = "zero"
ONE_TAIL = (Budget(fraction=0.2),)


@pytest.mark.parametrize(
    ("counts", "interval"),
    [
        # Newcombe (1998), "Interval estimation for the difference between independent proportions",
        # Table II, method 10 (the hybrid score interval)
        ((56, 70, 48, 80), (0.0524, 0.3339)),
        ((9, 10, 3, 10), (0.1705, 0.8090)),
        ((6, 7, 2, 7), (0.0582, 0.8062)),
        ((5, 56, 0, 29), (-0.0381, 0.1926)),
    ],
)
def test_the_excess_interval_is_newcombes_hybrid_score_interval(counts, interval):
    excess = Excess.of(*counts)
    assert excess.excess == pytest.approx(counts[0] / counts[1] - counts[2] / counts[3])
    assert (excess.low, excess.high) == pytest.approx(interval, abs=1.5e-4)


def test_the_interval_at_its_boundaries():
    # Wilson's interval at 0 and at n successes stays inside [0, 1] and excludes nothing it should not
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    low, high = wilson(10, 10)
    assert high == 1.0 and low == pytest.approx(1 - 0.2775, abs=1e-4)
    assert wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)  # Newcombe's single-proportion example
    # nothing diverged on either side: an excess of 0 whose interval holds 0 on both sides of it
    none = Excess.of(0, 10, 0, 20)
    assert none.excess == 0.0 and none.low < 0.0 < none.high
    # everything diverged against nothing: the interval excludes 0 and ends at 1
    every = Excess.of(10, 10, 0, 10)
    assert every.excess == 1.0 and every.high == pytest.approx(1.0) and every.low > 0.5
    # the interval narrows as checks accumulate at the same rates
    assert (
        Excess.of(20, 100, 10, 100).high - Excess.of(20, 100, 10, 100).low
        < Excess.of(2, 10, 1, 10).high - Excess.of(2, 10, 1, 10).low
    )
    # no checks on a side: no excess at all rather than a made-up one
    assert Excess.of(0, 0, 1, 5) is None and Excess.of(1, 5, 0, 0) is None


def guard(window: int = 4, floor: float | None = 0.5, tails=ONE_TAIL, on_error="ignore"):
    return ShadowGuard(floor, window, tuple(tails), on_error)


def feed(g: ShadowGuard, kind: str, flags: list[bool]) -> list[int]:
    """Record one check per flag, each made at the guard's current rung; the steps it took."""
    return [g.record(kind, flagged, g.rung) for flagged in flags]


def test_the_floor_judges_a_full_window_against_the_control_and_trips_at_the_floor():
    g = guard(window=4, floor=0.5)
    assert feed(g, ZERO_KIND, [True, True, True]) == [0, 0, 0]  # every one flagged, but the window is not full
    assert feed(g, ZERO_KIND, [True]) == [1] and g.rung == 1  # full: 1.0 - 0 (no control yet) >= 0.5

    at = guard(window=4, floor=0.5)
    feed(at, CONTROL, [False] * 4)
    assert feed(at, EXACT, [True, False, True, False]) == [0, 0, 0, 1]  # exactly at the floor: trips

    below = guard(window=4, floor=0.5)
    feed(below, CONTROL, [True, False, False, False])  # the engine's own noise: 0.25
    # 0.75 - 0.25 = 0.5 trips; 0.5 - 0.25 does not, however long it runs
    assert feed(below, STORED, [True, False, True, False] * 5) == [0] * 20 and below.rung == 0
    assert below.excess() == pytest.approx(0.25)
    assert feed(below, STORED, [True, True]) == [0, 1]  # the window then F, T, F, T; then T, F, T, T: 0.75 - 0.25


def test_a_regression_after_a_long_good_run_trips_within_one_window():
    """A lifetime rate would need as many bad checks as the good ones before them; the window
    needs at most one window of them."""
    g = guard(window=10, floor=0.5)
    feed(g, CONTROL, [False] * 10)
    assert not any(feed(g, ZERO_KIND, [False] * 1000))
    steps = feed(g, ZERO_KIND, [True] * 10)
    assert steps.index(1) < 10 and g.rung == 1


def test_the_ladder_climbs_each_rung_and_stops_at_full_prefill():
    g = guard(window=2, floor=0.5, tails=(Budget(fraction=0.2), Budget(fraction=0.5)))
    assert (g.exact_rung, g.top) == (3, 4)
    described = [g.describe()]
    for rung in range(1, 5):
        assert feed(g, ZERO_KIND, [True, True]) == [0, 1] and g.rung == rung
        described.append(g.describe())
    assert described == [
        "the configured budget", "tails of 0.2", "tails of 0.5", "exact stored states only", "full prefills"
    ]  # fmt: skip
    assert feed(g, EXACT, [True, True]) == [0, 0] and g.rung == g.top  # no rung above the top
    # a check looked up before the last step says nothing about the rung now
    held = list(g.loaded)
    assert g.record(ZERO_KIND, False, rung=0) == 0 and list(g.loaded) == held


def test_a_clean_window_steps_down_and_a_rung_tripped_into_again_needs_twice_as_long():
    g = guard(window=2, floor=0.5)
    feed(g, ZERO_KIND, [True, True])
    assert g.rung == 1
    assert feed(g, ZERO_KIND, [False]) == [0]  # one clean check is not a window
    assert feed(g, ZERO_KIND, [False]) == [-1] and g.rung == 0
    feed(g, ZERO_KIND, [True, True])
    assert g.rung == 1  # tripped into rung 1 a second time: 4 clean checks to leave it now
    assert feed(g, ZERO_KIND, [False, False, False, False]) == [0, 0, 0, -1]
    # checks of full prefills count toward a clean window where nothing is loaded (the top rung)
    top = guard(window=2, floor=0.5, tails=())
    feed(top, EXACT, [True, True])
    feed(top, EXACT, [True, True])
    assert top.rung == top.top
    assert feed(top, CONTROL, [False, False]) == [0, -1] and top.rung == top.exact_rung
    # a window still over the floor is not clean, however many checks it has
    busy = guard(window=2, floor=0.5)
    feed(busy, ZERO_KIND, [True, True])
    assert feed(busy, CONTROL, [False]) == [0] and feed(busy, ZERO_KIND, [True]) == [0]  # excess 1.0 with 1 of 2
    assert busy.rung == 1


def test_without_a_floor_the_guard_counts_and_never_moves():
    g = guard(floor=None)
    assert not any(feed(g, ZERO_KIND, [True] * 50)) and g.rung == 0
    assert g.excess() == 1.0


def test_stopped_checks_hold_the_exact_rung_under_exact_and_nothing_under_ignore():
    strict, lax = guard(on_error="exact"), guard(on_error="ignore")
    for g in (strict, lax):
        g.unavailable = True
    assert strict.effective_rung == strict.exact_rung and lax.effective_rung == 0
    strict.unavailable = False
    assert strict.effective_rung == 0
    # already above the exact rung: stays there
    strict.rung, strict.unavailable = strict.top, True
    assert strict.effective_rung == strict.top


def test_what_the_guard_weighs_from_each_result():
    assert ShadowResult("a", answer_length=5, diverged_at=3, gap=0.1).flagged is True
    assert ShadowResult("a", answer_length=5).flagged is False
    # no answer checked (a sampled, not greedy, request): the first-token check speaks
    assert ShadowResult("a", top1_agrees=False, kl=0.2).flagged is True
    assert ShadowResult("a", top1_agrees=True, kl=0.0).flagged is False
    assert ShadowResult("a").flagged is None
    g = guard()
    assert g.record(ZERO_KIND, None, 0) == 0 and not g.loaded and g.checks_at_rung == 0
