"""How vLLM's KV-cache groups map to what the connector stores and restores (`classify_groups`).

The scheduler's connector and the worker's each classify their own copy of vLLM's KV-cache
config: the scheduler's shows one spec per group, the worker's every layer's (see `CacheGroups`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)

from hybridkv.errors import HybridKVError

# KV-cache specs whose blocks hold plain per-token attention KV, restorable as whole blocks.
_WHOLE_BLOCK_SPECS = (FullAttentionSpec, MLAAttentionSpec)


@dataclass
class CacheGroups:
    """How the connector restores each of vLLM's KV-cache groups (`classify_groups`).

    vLLM 0.32 lays a model's caches out in KV-cache groups that share one raw buffer. For
    GLM-5.3-Flash (`glm5next`) the per-layer specs are
    - each KDA layer: a `MambaSpec` (the short-conv state in the model dtype and the fp32
      recurrent state, one block per request);
    - each MLA layer: an `MLAAttentionSpec` for the latent (`tokens_per_state` 1, marked
      `is_index_group_leader`), one for the DSA indexer's fp8 k-pool entries
      (`Glm5NextIndexerCache`: `cache_role` INDEXER, `tokens_per_state` = `index_kpool` = 16, so
      a block of B tokens holds B/16 pool entries, one per complete pool), and a
      `CircularBufferSpec` (`Glm5NextTailCache`: the raw K and gate score of the pool still in
      progress, a ring of 16·2^k slots, one block per request).
    Their page sizes differ, so vLLM packs them (`_get_packed_kv_cache_groups`, a block-outermost
    layout such as BLHNC): the latent and indexer specs share the `FullAttentionSpec` grouping
    base and become one `UniformTypeKVCacheSpecs` group (one block table), the KDA layers are
    split into several `MambaSpec` groups (as many states as fit in one block), and the rings form
    one `CircularBufferSpec` group. Every group aliases the same raw buffer, block b of each group
    being bytes [b·S, (b+1)·S) for one block stride S; a block id belongs to one group at a time.
    Inside the MLA group's block (its "slab", `get_kv_cache_config_from_groups`) the layers sit at
    fixed offsets: one `KVCacheTensor` per distinct spec, in the order vLLM meets the specs (the
    latent's first): the latent layers at offset 0, `page(latent)` apart, then the indexer layers
    at `n_mla · page(latent)`, `page(indexer)` apart. Packed groups are not split into kernel
    blocks (`prepare_kernel_block_sizes`), so a view's first dimension is vLLM's block.
    Each layer's tensor view (`create_kv_cache_views`) is `as_strided` over the raw buffer with
    shape [blocks, heads, states, content] (states = B / tokens_per_state), block stride S,
    storage offset = the tensor's offset + layer index · layer stride, viewed in the spec's dtype
    (raw int8 bytes for a `MambaSpec`). So `view[b]` is one layer's page of block b, contiguous,
    and copying it byte for byte through each layer's view restores the slab exactly.

    The restore: the MLA group's blocks covering [0, s) are stored and loaded whole, latent and
    indexer pages alike; the KDA groups are state groups (the checkpoint at s, or zeros); the ring
    is cleared. That is exact only if no pool is in progress at s, so s lies on the pool grid
    (`pool_alignment`: a multiple of every pooled spec's `tokens_per_state` and of every ring's
    capacity, itself a multiple of the pool) and vLLM's own prefill of [s, end) refills the ring.

    The scheduler's copy of the config carries one representative spec per group
    (`generate_scheduler_kv_cache_config`), the group's first layer's (the latent's); the worker's
    carries every layer's. The fingerprint is built from the representatives on both sides, so
    their keys agree. The scheduler takes the pool grid from the ring's capacity (it cannot see
    the indexer's pool); the worker, which sees both, fails a load off its own grid (vLLM then
    recomputes the request). A layer whose page size only the worker knows has size None here:
    the lookup checks its name, the worker its size.
    """

    attention: dict[int, list[str]]  # group -> layers whose blocks are stored and loaded whole
    mamba: dict[int, list[str]]  # group -> layers with one state slot per request
    rings: dict[int, list[str]]  # group -> layers with one ring block per request, cleared on load
    page_bytes: dict[str, int | None]  # layer -> bytes of its page (None: this side cannot know)
    pool_alignment: int  # s is a multiple of it: 1 without pooled caches
    layout: list[tuple[str, int, int, list[str]]]  # per group, for the engine fingerprint
    block_size: int  # tokens per block, one size for every attention group


def _pool(spec: KVCacheSpec) -> int | None:
    """Tokens per stored state of an attention layer restorable as whole blocks: 1 for per-token
    KV, the pool size for a pooled MLA cache (GLM-5.3-Flash's indexer), None if not restorable."""
    if type(spec) not in _WHOLE_BLOCK_SPECS:
        return None
    per_state = getattr(spec, "tokens_per_state", 1)
    if per_state in (1, -1):
        return 1
    pooled = isinstance(spec, MLAAttentionSpec) and isinstance(per_state, int) and per_state > 1
    return per_state if pooled and spec.block_size % per_state == 0 else None


def _page_bytes(spec: KVCacheSpec) -> int:
    """Bytes of one layer's page as its tensor view holds them: without the padding to the block stride."""
    return getattr(spec, "real_page_size_bytes", spec.page_size_bytes)


def _sparse_mla_representative(spec: KVCacheSpec) -> bool:
    """A spec the scheduler sees for a group that also holds a sparse-MLA indexer's caches, whose
    page sizes differ from the representative's: vLLM marks the latent of an MLA layer with an
    indexer as the index group's leader."""
    return isinstance(spec, MLAAttentionSpec) and (
        spec.is_index_group_leader or spec.cache_role == SparseCacheRole.INDEXER or spec.tokens_per_state != 1
    )


def classify_groups(kv_cache_config: KVCacheConfig) -> CacheGroups:
    """Sort vLLM's KV-cache groups into what the connector restores; refuse any other group."""
    attention: dict[int, list[str]] = {}
    mamba: dict[int, list[str]] = {}
    rings: dict[int, list[str]] = {}
    page_bytes: dict[str, int | None] = {}
    alignment = 1
    layout = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        names = list(group.layer_names)
        spec = group.kv_cache_spec
        # The worker's config has one spec per layer; the scheduler's, the first of them for all.
        per_layer = (
            {name: spec.kv_cache_specs[name] for name in names} if isinstance(spec, UniformTypeKVCacheSpecs) else None
        )
        specs = list(iter_layer_specs(spec))
        if not specs:
            raise HybridKVError(f"HybridKVConnector: KV-cache group {g} has no layer spec")
        representative = specs[0]  # what generate_scheduler_kv_cache_config keeps
        layout.append((type(representative).__name__, representative.block_size, representative.page_size_bytes, names))
        if all(isinstance(spec, MambaSpec) for spec in specs):
            mamba[g] = names
        elif all(isinstance(spec, CircularBufferSpec) for spec in specs):
            rings[g] = names
            alignment = math.lcm(alignment, *(spec.block_size for spec in specs))
        elif all(_pool(spec) is not None for spec in specs):
            attention[g] = names
            alignment = math.lcm(alignment, *(_pool(spec) for spec in specs))
            if per_layer is None and _sparse_mla_representative(representative):
                page_bytes.update(dict.fromkeys(names))
                continue
        else:  # sliding windows, compressed caches of other models: not restorable block by block yet
            kinds = "+".join(dict.fromkeys(type(spec).__name__ for spec in specs))
            raise HybridKVError(
                f"HybridKVConnector cannot restore KV-cache group {g} ({kinds}, layers "
                f"{', '.join(names[:3])}...): it handles full-attention and Mamba-style state groups"
            )
        for name in names:
            page_bytes[name] = _page_bytes(per_layer[name] if per_layer is not None else representative)
    if not attention:
        raise HybridKVError("HybridKVConnector: the model has no full-attention KV-cache group to reuse")
    sizes = {kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size for g in attention}
    if len(sizes) != 1:
        raise HybridKVError(f"HybridKVConnector: attention groups with different block sizes {sorted(sizes)}")
    return CacheGroups(attention, mamba, rings, page_bytes, alignment, layout, sizes.pop())
