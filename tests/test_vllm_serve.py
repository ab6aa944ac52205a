"""`hybridkv vllm-bench` through real `vllm serve` processes (vLLM's OpenAI server, CPU build) on
the production-shaped bench model, whose state pages make vLLM choose a block of over 2,048 tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from hybridkv.serving.bench import SUMMARY_FIELDS, BenchPlan, run_bench  # noqa: E402
from hybridkv.serving.models import BENCH_MODELS, gdn_grid_block, write_servable  # noqa: E402
from hybridkv.serving.server import Server, ServerSpec, complete  # noqa: E402
from hybridkv.serving.traffic import Shape  # noqa: E402


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    return write_servable(tmp_path_factory.mktemp("serve") / "grid-2048", "grid-2048")


def test_vllm_derives_the_production_grid_from_state_and_kv_bytes(production, tmp_path):
    with Server(ServerSpec(str(production), "no-cache", 4096), tmp_path / "server.log") as server:
        block = server.block_size()
    assert block == gdn_grid_block(BENCH_MODELS["grid-2048"].config())
    assert block >= 2048


def test_the_bench_through_vllm_serve_reuses_prefixes_shorter_than_vllms_block(production, tmp_path):
    """Every shared prefix here is shorter than one 2,176-token block, so vLLM's own cache reuses
    nothing (vLLM issue #40696) and hybridkv reuses each conversation's earlier turns."""
    shape = Shape(min_prefix=600, max_prefix=1800, requests=4)
    plan = BenchPlan(str(production), ["shared-system", "multi-turn"], [1, 2], ["0.05", "adaptive"], shape)
    summary = run_bench(plan, tmp_path / "bench", show_progress=False)
    rows = summary["rows"]
    assert len(rows) == 2 * 2 * 4 and all(set(SUMMARY_FIELDS) <= set(r) for r in rows)
    # adaptive replays the calibrated horizon (measured on the model at first use, written beside it)
    assert summary["calibration"]["horizon"] is not None and (production / "hybridkv-calibration.json").exists()
    for row in rows:
        if row["budget"] == "adaptive" and row["workload"] == "shared-system":
            assert row["replayed_tokens_per_request"] <= summary["calibration"]["horizon"]
    assert {r["block_size"] for r in rows} == {gdn_grid_block(BENCH_MODELS["grid-2048"].config())}
    assert all(r["requests"] == 4 for r in rows)
    by = {(r["workload"], r["config"], r["clients"]): r for r in rows if r["budget"] in (None, "0.05")}
    for clients in (1, 2):
        assert by[("multi-turn", "vllm-prefix-cache", clients)]["reused_tokens_per_request"] == 0
        # Turns 2-4 of each conversation extend a stored prompt: at least 3 of 4 requests reuse.
        assert by[("multi-turn", "hybridkv", clients)]["reused_tokens_per_request"] > 100
    written = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert written["rows"] == json.loads(json.dumps(rows))
    # the noise clear-lead agreement is measured against, per client count, and every reply behind the rows
    assert set(written["split_noise"]) == {"1", "2"} and all(v >= 0 for v in written["split_noise"].values())
    assert len(json.loads((tmp_path / "bench" / "replies.json").read_text())) == 4 * 2 * 2 * 4
    assert (tmp_path / "bench" / "ttft-multi-turn.png").read_bytes()[:4] == b"\x89PNG"
    assert "## shared-system" in (tmp_path / "bench" / "report.md").read_text()


def test_two_tenants_never_share_a_page_through_the_server(production, tmp_path):
    """vLLM's per-request cache_salt is part of every key: tenant b misses tenant a's prompt, tenant a
    (and only tenant a) hits it."""
    import asyncio
    import random

    import httpx

    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(900)]
    spec = ServerSpec(str(production), "hybridkv", 4096, f"file://{tmp_path / 'store'}")

    async def send(server, tokens, salt):
        async with httpx.AsyncClient(timeout=600) as client:
            return await complete(client, server.url, spec.model, tokens, 5, salt)

    with Server(spec, tmp_path / "server.log") as server:
        asyncio.run(send(server, prompt, "tenant-a"))
        other = asyncio.run(send(server, prompt + [7, 8, 9], "tenant-b"))
        unsalted = asyncio.run(send(server, prompt + [7, 8, 9], None))
        same = asyncio.run(send(server, prompt + [7, 8, 9], "tenant-a"))
    assert other.hybridkv["matched"] == 0 and unsalted.hybridkv["matched"] == 0
    assert same.hybridkv == {"matched": 900, "reused": 900, "exact_state": True}


def _metric(server: Server, name: str, at_least: float = 0.0) -> float:
    """`server.metrics()[name]`, read again for up to 10 s until it reaches `at_least` (the API
    server records an engine step's figures as it receives them, which may be just after the
    step's answers went out)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        value = server.metrics("vllm:").get(name, 0.0)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


# One prompt alone on two servers goes through the same kernels; the connector changes no forward,
# so a full prefill matches vLLM alone to bf16 noise at most (test_vllm_connector's tolerance, which
# covers prefill splits and thread counts too). Under 16 clients the two servers batch differently
# and a bf16 logprob of this random-weight model moves by up to ~0.05 with the batch's shapes: those
# replies are checked for being answered, not against each other.
BF16_LOGPROB_TOL = 0.02


def test_a_store_killed_under_16_clients_leaves_every_request_answered_and_counted(production, redis_factory, tmp_path):
    import asyncio
    import random

    from hybridkv.serving.server import run_sessions

    rng = random.Random(11)
    systems = [[rng.randrange(3, 500) for _ in range(700)] for _ in range(4)]

    def batch(n):
        return [[systems[i % 4] + [rng.randrange(3, 500) for _ in range(rng.randint(20, 80))]] for i in range(n)]

    warm, before, after = batch(4), batch(16), batch(16)
    store = redis_factory()
    spec = ServerSpec(str(production), "hybridkv", 4096, store.url)
    with Server(spec, tmp_path / "hybridkv.log") as server:
        asyncio.run(run_sessions(server.url, spec.model, warm, 1, 5))  # one request per system prompt stored
        # vllm serve runs its worker in its own process, which writes a prompt's pages just after
        # answering it (milliseconds): give the last write that long before the burst that reads it.
        asyncio.run(asyncio.sleep(2.0))
        asyncio.run(run_sessions(server.url, spec.model, before, 16, 5))
        assert _metric(server, "vllm:hybridkv_lookups_total", 20) == 20
        hits = _metric(server, "vllm:hybridkv_hits_total", 16)
        assert hits >= 16  # every system prompt was stored before
        assert _metric(server, "vllm:hybridkv_replay_tokens_count", hits) == hits  # one histogram sample per hit
        errors = _metric(server, "vllm:hybridkv_store_errors_total")
        store.kill()
        got, _ = asyncio.run(run_sessions(server.url, spec.model, after, 16, 5))
        assert _metric(server, "vllm:hybridkv_store_errors_total", errors + 1) > errors
        assert _metric(server, "vllm:hybridkv_lookups_total", 36) == 36
        alone, _ = asyncio.run(run_sessions(server.url, spec.model, after[:4], 1, 5))
    assert all(g.hybridkv["reused"] == 0 and len(g.logprobs) >= 3 for (g,) in got + alone)
    reference = ServerSpec(str(production), "no-cache", 4096)
    with Server(reference, tmp_path / "alone.log") as server:
        want, _ = asyncio.run(run_sessions(server.url, spec.model, after[:4], 1, 5))
    for (g,), (w,) in zip(alone, want, strict=True):  # nothing could be read: a full prefill, as vLLM alone
        common = set(g.logprobs) & set(w.logprobs)
        assert len(common) >= 3
        assert max(abs(g.logprobs[t] - w.logprobs[t]) for t in common) < BF16_LOGPROB_TOL


@pytest.mark.parametrize("backend", ["redis", "lmcache"])
def test_a_conversation_moving_between_two_servers_resumes_from_the_first_ones_pages(
    production, redis_server, tmp_path, backend
):
    """Two vllm serve processes on one store (a redis server, or LMCache's own server through
    `lmcache://lm://`): each turn of a conversation goes to the other server,
    which resumes exactly from the state the first one stored after the last turn. A server writes
    a prompt's pages just after answering it (off the request path), so the next turn is sent two
    seconds later, as a user would (a write takes milliseconds); sent at once it may find the
    pages still being written."""
    import asyncio
    import random

    import httpx

    rng = random.Random(21)
    turn = [rng.randrange(3, 500) for _ in range(800)]
    conversation = [turn, turn + [rng.randrange(3, 500) for _ in range(120)]]
    conversation.append(conversation[1] + [rng.randrange(3, 500) for _ in range(90)])
    lmcache = None
    if backend == "lmcache":
        from tests.test_lmcache_store import LMCacheServer

        lmcache = LMCacheServer()
    spec = ServerSpec(str(production), "hybridkv", 4096, redis_server.url if lmcache is None else lmcache.url)

    async def talk(urls):
        replies = []
        async with httpx.AsyncClient(timeout=600) as client:
            for index, prompt in enumerate(conversation):
                replies.append(await complete(client, urls[index % 2], spec.model, prompt, 5))
                await asyncio.sleep(2.0)
        return replies

    try:
        with Server(spec, tmp_path / "a.log") as first, Server(spec, tmp_path / "b.log") as second:
            replies = asyncio.run(talk([first.url, second.url]))
    finally:
        if lmcache is not None:
            lmcache.kill()
    assert replies[0].hybridkv["matched"] == 0
    assert replies[1].hybridkv == {"matched": 800, "reused": 800, "exact_state": True}  # on the other server
    assert replies[2].hybridkv == {"matched": 920, "reused": 920, "exact_state": True}  # and back


def test_shadow_checks_every_kind_and_the_first_token_of_zero_state_resumes_only(production, tmp_path):
    """`shadow_rate: 1` checks every finished greedy request in a shadow process, by kind. Each
    prompt here shares the first L tokens of a stored one and then diverges, so no stored state lies
    at L: at budget 1.0 the whole match is recomputed (a full prefill: the control group, no
    first-token check); at a budget of 0 tokens vLLM resumes at L from zero states and computes only
    the prompt's last 2 tokens from them, which moves this random-weight model's first token far
    beyond float32 noise (in the shadow, on one code path: KL 1.8e-3 to 4.1e-2, and 5 of these 6
    top-1 tokens flip). The answers of this random-weight model are near-uniform picks, so only
    their counts are asserted here (`test_vllm_shadow_serve.py` asserts verdicts, on a trained
    model). Each phase has its own namespace (`cache_salt`): a slot lists the last 8 blocks stored
    in it, and more prompts would push the stored one out."""
    import asyncio
    import random

    import httpx

    from hybridkv.serving.server import settle_shadow_checks

    rng = random.Random(33)
    stored = [rng.randrange(3, 500) for _ in range(800)]

    def diverging(length: int, index: int) -> list[int]:  # token 500+ never occurs in `stored`
        return stored[:length] + [500 + index, rng.randrange(3, 500)]

    replayed_prompts = [diverging(610 + 20 * i, i) for i in range(6)]
    exact_prompts = [diverging(600 + 20 * i, i) for i in range(4)]
    spec = ServerSpec(str(production), "hybridkv", 4096, f"file://{tmp_path / 'store'}", "0tok", shadow_rate=1.0)

    async def send(server, prompts, salt=None, budget=None):
        params = {"replay_budget": budget} if budget is not None else None
        async with httpx.AsyncClient(timeout=600) as client:
            return [await complete(client, server.url, spec.model, p, 5, salt, params) for p in prompts]

    with Server(spec, tmp_path / "server.log") as server:
        at_full = asyncio.run(send(server, [stored, *exact_prompts], "budget-1", 1.0))[1:]
        full = settle_shadow_checks([server])
        replayed = asyncio.run(send(server, [stored, *replayed_prompts]))[1:]
        shadowed = settle_shadow_checks([server])
    # budget 1.0: every prompt matched L tokens and recomputed them all: full prefills, answers only
    assert [r.hybridkv for r in at_full] == [{"matched": len(p) - 2, "reused": 0, "exact_state": False}
                                             for p in exact_prompts]  # fmt: skip
    requests = 1 + len(exact_prompts)
    assert full["vllm:hybridkv_shadow_queued_total"] == full["vllm:hybridkv_shadow_checks_total"] == requests
    assert full['vllm:hybridkv_shadow_answers_total{kind="full"}'] == requests
    assert full["vllm:hybridkv_shadow_answers_total"] == requests  # no other kind
    assert full.get("vllm:hybridkv_shadow_first_token_checks_total", 0) == 0
    # budget 0: zero-state resumes at L, every one checked twice, flips seen, KL far above float32 noise
    assert [r.hybridkv for r in replayed] == [{"matched": len(p) - 2, "reused": len(p) - 2, "exact_state": False}
                                              for p in replayed_prompts]  # fmt: skip
    checks = len(replayed_prompts)
    assert shadowed["vllm:hybridkv_shadow_queued_total"] == requests + 1 + checks
    assert shadowed["vllm:hybridkv_shadow_checks_total"] == requests + 1 + checks
    assert shadowed['vllm:hybridkv_shadow_answers_total{kind="zero@0tok"}'] == checks
    assert shadowed['vllm:hybridkv_shadow_answers_total{kind="full"}'] == requests + 1
    assert shadowed.get("vllm:hybridkv_shadow_failed_total", 0) == 0
    assert shadowed.get("vllm:hybridkv_shadow_dropped_total", 0) == 0
    assert shadowed["vllm:hybridkv_shadow_first_token_checks_total"] == checks
    assert shadowed["vllm:hybridkv_shadow_top1_disagreements_total"] >= 2
    assert shadowed["vllm:hybridkv_shadow_kl_count"] == checks
    assert shadowed["vllm:hybridkv_shadow_kl_sum"] / checks > 1e-3
    # greedy requests: the token vLLM served was compared with the shadow's served-recipe argmax
    assert shadowed["vllm:hybridkv_shadow_reproduced_checked_total"] == checks
    # every excess series is there, with its interval around it
    excess = shadowed['vllm:hybridkv_shadow_excess{kind="zero@0tok"}']
    assert shadowed['vllm:hybridkv_shadow_excess_low{kind="zero@0tok"}'] <= excess
    assert excess <= shadowed['vllm:hybridkv_shadow_excess_high{kind="zero@0tok"}']


def _ledger(url: str) -> tuple[int, int, dict[str, dict]]:
    """A capacity-bound redis store's bytes counted, bytes its entries hold, and each entry's ledger."""
    import redis

    from hybridkv.store.redis_store import META, NAMESPACE, USED

    client = redis.Redis.from_url(url.partition("?")[0])
    held = sum(client.strlen(key) for key in client.scan_iter(match=NAMESPACE + "*"))
    metas = {
        key.decode()[len(META) :]: {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        for key in client.scan_iter(match=META + "*")
    }
    return int(client.get(USED) or 0), held, metas


def test_a_store_kept_by_value_under_vllm_serve_stays_in_its_capacity_and_counts_what_it_did(
    production, redis_server, tmp_path
):
    """`save_states` "value" on a redis store of about three prompts' bytes, kept by value. One
    prompt's entries are measured on an unbounded database first; then eight prompts go through a
    bounded one: the store evicts or refuses, never exceeds its capacity, its ledger counts exactly
    the bytes its entries hold, every KV block or state held has its parent held, and the server's
    Prometheus counters and gauge say the same."""
    import asyncio
    import random

    from hybridkv.serving.server import run_sessions

    rng = random.Random(23)
    prompts = [[[rng.randrange(3, 500) for _ in range(rng.randint(600, 900))]] for _ in range(9)]
    settings = {"save_states": "value"}
    probe = f"{redis_server.url}/6?capacity={10**12}&policy=value"
    spec = ServerSpec(str(production), "hybridkv", 4096, probe, connector_settings=settings)
    with Server(spec, tmp_path / "probe.log") as server:
        asyncio.run(run_sessions(server.url, spec.model, prompts[:1], 1, 2))
        asyncio.run(asyncio.sleep(2.0))  # the worker writes just after answering
    one_prompt, _, _ = _ledger(probe)
    assert one_prompt > 0
    capacity = int(3.5 * one_prompt)
    bounded = f"{redis_server.url}/7?capacity={capacity}&policy=value"
    spec = ServerSpec(str(production), "hybridkv", 4096, bounded, connector_settings=settings)
    with Server(spec, tmp_path / "bounded.log") as server:
        for prompt in prompts[1:]:
            asyncio.run(run_sessions(server.url, spec.model, [prompt], 1, 2))
            asyncio.run(asyncio.sleep(0.5))
        asyncio.run(asyncio.sleep(2.0))
        counted, held, metas = _ledger(bounded)
        assert counted == held <= capacity
        assert all(m["parent"] == "" or m["parent"] in metas for m in metas.values())
        assert {m["kind"] for m in metas.values()} >= {"kv-block"}
        admitted = _metric(server, "vllm:hybridkv_kv_blocks_admitted_total", 8)
        assert admitted >= 8 and _metric(server, "vllm:hybridkv_states_admitted_total", 1) >= 1
        turned_away = sum(
            _metric(server, f"vllm:hybridkv_{name}_total")
            for name in ("kv_blocks_evicted", "states_evicted", "kv_blocks_refused", "states_refused")
        )
        assert turned_away > 0  # eight prompts' entries do not fit in three and a half
        assert 0 < _metric(server, "vllm:hybridkv_store_bytes_held", 1) <= capacity
    for db in (probe, bounded):
        _wipe_redis(db)


def _wipe_redis(url: str) -> None:
    from hybridkv.store import open_store

    store = open_store(url)
    store.clear()
    store.close()
