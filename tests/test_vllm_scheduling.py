"""When HybridKVConnector lets vLLM schedule a hit, built with vLLM's own classes on the CPU.

A plain hybrid's caches (Gated DeltaNet state groups and full-attention groups, grouped and placed
by vLLM) let the scheduler verify every page's size, so its loads are synchronous: vLLM schedules
the request in the step its lookup answers and the worker copies the pages before that step's
forward. GLM-5.3-Flash's sparse-MLA pages have sizes only the worker knows; there loads stay
asynchronous (`test_vllm_glm_groups.py`). A request sharing a long prefix with one being computed
waits for that one's pages instead of computing them a second time.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from hybridkv.errors import HybridKVError  # noqa: E402
from hybridkv.integrations.vllm.metadata import HybridKVMetadata, LoadOp, SaveOp  # noqa: E402
from hybridkv.integrations.vllm.writes import StoreWriter  # noqa: E402
from tests.test_vllm_glm_groups import (  # noqa: E402
    BLOCK,
    Engine,
    ModelStandIn,
    connector_config,
    look_up,
    make_engine,
    request,
    scramble,
    stand_in_checkpoint,
    tokens,
)


def plain_hybrid_specs() -> dict[str, KVCacheSpec]:
    """Qwen3-Next's pattern in small: Gated DeltaNet layers and full-attention layers alternating."""
    conv, recurrent = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 2, 32, 32, 4, 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto")
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        if i % 2 == 0:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=BLOCK, shapes=(conv, recurrent), dtypes=dtypes, mamba_type=MambaAttentionBackendEnum.GDN_ATTN
            )
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
            )
    return specs


@pytest.fixture(scope="module")
def plain_config(tmp_path_factory) -> VllmConfig:
    return connector_config(
        ModelStandIn(stand_in_checkpoint(tmp_path_factory.mktemp("qwen3-next-shaped"), "qwen3_next"))
    )


@pytest.fixture
def engine(plain_config, tmp_path):
    groups = get_kv_cache_groups(plain_config, plain_hybrid_specs())
    engine = make_engine(plain_config, get_kv_cache_config_from_groups(plain_config, groups, 16 * 2**20),
                         f"file://{tmp_path / 'store'}")  # fmt: skip
    yield engine
    engine.worker.shutdown()
    engine.scheduler.shutdown()
    StoreWriter.drain_all()


def scheduled(new=(), cached=(), finished=()) -> SchedulerOutput:
    """A scheduler step's output, as vLLM's NewRequestData and CachedRequestData carry it: `new`
    holds (request, prompt, blocks, tokens scheduled), `cached` (request, tokens computed before,
    tokens scheduled) for a request admitted in an earlier step."""
    out = SchedulerOutput.make_empty()
    for req_id, prompt, blocks, count in new:
        ids = tuple(blocks[g] for g in sorted(blocks))
        out.scheduled_new_reqs.append(
            SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=ids, num_computed_tokens=0)
        )
        out.num_scheduled_tokens[req_id] = count
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[c[0] for c in cached], new_block_ids=[None for _ in cached], resumed_req_ids=set(),
        num_computed_tokens=[c[1] for c in cached],
    )  # fmt: skip
    for req_id, _, count in cached:
        out.num_scheduled_tokens[req_id] = count
    out.finished_req_ids = set(finished)
    return out


def step_worker(engine: Engine, meta: HybridKVMetadata) -> None:
    """The worker's part of a step whose prefill completes: its saves, then the step's report back."""
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv(None)
    engine.worker.wait_for_save()
    engine.worker.clear_connector_metadata()


def report_back(engine: Engine) -> None:
    """What vLLM hands the scheduler's connector after a step (`update_connector_output`)."""
    output = KVConnectorOutput(kv_connector_worker_meta=engine.worker.build_connector_worker_meta())
    engine.scheduler.update_connector_output(output)


def attention_groups(engine: Engine) -> list[int]:
    return engine.groups_of(FullAttentionSpec)


def request_blocks(engine: Engine, first: int, count: int) -> dict[int, list[int]]:
    """Block ids for one request: `count` attention blocks, one state slot per state group, all
    distinct (a block id belongs to one group at a time), from `first` on."""
    out, next_id = {}, first
    for g in range(len(engine.config.kv_cache_groups)):
        n = count if g in attention_groups(engine) else 1
        out[g], next_id = list(range(next_id, next_id + n)), next_id + n
    return out


def save(engine: Engine, prompt: list[int], blocks: dict[int, list[int]]) -> None:
    """The worker's save of a finished prefill, with its blocks in each group."""
    states = {g: blocks[g][:1] for g in engine.groups_of(MambaSpec)}
    op = SaveOp("saved", prompt, 0, {g: blocks[g] for g in attention_groups(engine)} | states)
    step_worker(engine, HybridKVMetadata(saves=[op]))
    assert engine.worker._side._writer.drain(timeout=30)


def test_a_hit_the_scheduler_verified_is_loaded_before_the_forward_that_computes_from_it(engine):
    """vLLM schedules a synchronous load in the step its lookup answers and computes from its start
    in that step's forward; vLLM takes no `finished_recving` for it (a running request)."""
    scramble(engine.raw, 0)
    prompt = tokens(3 * BLOCK, 1)
    stored = request_blocks(engine, 0, 3)
    save(engine, prompt, stored)
    saved = {g: [engine.block_bytes(g, b) for b in stored[g]] for g in attention_groups(engine)}

    scramble(engine.raw, 1)
    longer = request("b", prompt + tokens(40, 2))
    start, asynchronous = engine.scheduler.get_num_new_matched_tokens(longer, 0)
    while start is None:  # the lookup took longer than the scheduler waits for it
        start, asynchronous = engine.scheduler.get_num_new_matched_tokens(longer, 0)
    assert (start, asynchronous) == (len(prompt), False)
    blocks = request_blocks(engine, 100, 4)
    engine.scheduler.update_state_after_alloc(
        longer, SimpleNamespace(get_block_ids=lambda: tuple(blocks.values())), start
    )
    meta = engine.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert [op.sync for op in meta.loads] == [True]

    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv(None)  # vLLM calls it before the forward when a load is synchronous
    engine.worker.clear_connector_metadata()
    results = engine.worker.get_transfer_results(set())
    assert not results.finished_recving and not results.failed_recving
    for g in attention_groups(engine):
        for index, block in enumerate(blocks[g][:3]):
            assert torch.equal(engine.block_bytes(g, block), saved[g][index])


def test_a_synchronous_load_the_worker_cannot_make_stops_the_step_and_an_asynchronous_one_recomputes(engine):
    """The forward after a synchronous load computes from its start over whatever the blocks
    hold, and vLLM cannot recompute a running hybrid request: the worker refuses to go on. An
    asynchronous load that fails is reported failed, and vLLM recomputes the request."""
    blocks = request_blocks(engine, 0, 2)
    attention = {g: blocks[g] for g in attention_groups(engine)}
    for sync in (True, False):
        op = LoadOp(f"r-{sync}", [], None, attention, failed=True, start=BLOCK, sync=sync)
        engine.worker.bind_connector_metadata(HybridKVMetadata(loads=[op]))
        if sync:
            with pytest.raises(HybridKVError, match="synchronous load of request r-True failed"):
                engine.worker.start_load_kv(None)
        else:
            engine.worker.start_load_kv(None)
        engine.worker.clear_connector_metadata()
    results = engine.worker.get_transfer_results(set())
    assert set(results.failed_recving) == {"r-False"} and set(results.finished_recving) == {"r-False"}


def test_a_request_sharing_a_prefix_being_computed_waits_for_its_pages_then_reuses_them(engine):
    """Two clients send one new long prefix at once: the second waits while the first computes and
    saves it, then loads it, instead of computing it alongside (which the store could not save it
    from: its pages land only once the first prompt is complete). vLLM asks about every waiting
    request before it builds the step's metadata, so the second waits from the moment the first's
    lookup answers, even in the same step."""
    scheduler = engine.scheduler
    shared = tokens(5 * BLOCK, 3)
    first = shared + tokens(20, 4)
    assert look_up(engine, request("a", first)) == 0  # a miss: a will compute the prefix
    second = request("b", shared + tokens(30, 5))
    assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # same step as a's answer
    assert scheduler._side.lookups_in_flight == 0  # no lookup while a computes the prefix it wants
    first_blocks = request_blocks(engine, 0, 6)
    scheduler.build_connector_meta(scheduled(new=[("a", first, first_blocks, BLOCK)]))  # a's first chunk
    assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)
    other_tenant = request("c", shared + tokens(30, 6))
    other_tenant.cache_salt = "tenant-2"  # a's pages are not its own: nothing to wait for
    assert look_up(engine, other_tenant) == 0
    short = request("d", shared[: scheduler._side.in_flight.WAIT_FOR_PREFIX_TOKENS - 1] + tokens(600, 7))
    assert look_up(engine, short) == 0  # too little in common to wait for

    # a's last prefill step: the scheduler sends its save; b waits until the worker says it is done
    meta = scheduler.build_connector_meta(scheduled(cached=[("a", BLOCK, len(first) - BLOCK)]))
    assert [save.req_id for save in meta.saves] == ["a"]
    assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)
    step_worker(engine, meta)
    assert engine.worker._side._writer.drain(timeout=30)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (None, False)  # the notice comes with a step
    report_back(engine)
    assert look_up(engine, second) > 4 * BLOCK  # a's pages, but for its budget's tail
    assert scheduler.get_kv_connector_stats().data["counters"]["lookups_deferred"] == 1


def test_a_next_turn_sent_while_the_last_ones_pages_are_written_waits_for_them(engine):
    """A conversation's next turn, sent the moment the last one is answered, adds far fewer than
    `WAIT_FOR_PREFIX_TOKENS` to it; the last turn's save is already on its way, so the next turn
    waits the milliseconds it takes instead of missing those pages."""
    scheduler = engine.scheduler
    turn = tokens(3 * BLOCK, 20)
    assert 3 * BLOCK < scheduler._side.in_flight.WAIT_FOR_PREFIX_TOKENS
    last = request("a", turn)
    assert look_up(engine, last) == 0
    meta = scheduler.build_connector_meta(scheduled(new=[("a", turn, request_blocks(engine, 0, 4), len(turn))]))
    assert [save.req_id for save in meta.saves] == ["a"]  # a's prompt is complete in this step
    scheduler.request_finished_all_groups(last, ())  # answered (one token): vLLM frees it
    scheduler.build_connector_meta(scheduled(finished=["a"]))  # and names it in the next step's output
    following = request("b", turn + tokens(40, 21))  # the reply and the next message
    assert scheduler.get_num_new_matched_tokens(following, 0) == (None, False)
    step_worker(engine, meta)
    assert engine.worker._side._writer.drain(timeout=30)
    report_back(engine)
    assert look_up(engine, following) > 2 * BLOCK  # a's pages, but for its budget's tail


def test_a_request_stops_waiting_for_a_prefix_whose_request_ended_before_its_prompt_was_complete(engine):
    scheduler = engine.scheduler
    shared = tokens(5 * BLOCK, 8)
    assert look_up(engine, request("a", shared + [1, 2])) == 0
    scheduler.build_connector_meta(scheduled(new=[("a", shared + [1, 2], request_blocks(engine, 0, 6), BLOCK)]))
    waiting = request("b", shared + [3, 4])
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (None, False)
    scheduler.build_connector_meta(scheduled(finished=["a"]))  # aborted mid-prefill: no save will come
    assert look_up(engine, waiting) == 0
    # b, a miss, will compute the prefix now; aborted before vLLM schedules it, it is finished all
    # the same, and nobody waits for it any more
    late = request("c", shared + [5, 6])
    assert scheduler.get_num_new_matched_tokens(late, 0) == (None, False)
    scheduler.build_connector_meta(scheduled(finished=["b"]))
    assert look_up(engine, late) == 0
