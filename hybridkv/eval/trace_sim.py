"""`hybridkv trace-sim`: replay a request trace against a model's cache sizes and cost model and a
store of a given capacity, under several caching policies, for a sweep of capacities.

A trace (Mooncake's format) gives each request's input length and the ids of its 512-token blocks
(the last one may be partial); equal ids mean equal blocks, so two requests share the prefix of
ids they have in common. The blocks form a prefix tree; an entry of the store is keyed by its node.

Policies (`POLICIES`):

- `vllm-align`: vLLM's `--mamba-cache-mode align`. KV in blocks of `align_block` tokens (3,584 for
  GLM-5.3-Flash), every full block of every prompt; one linear-state checkpoint per prompt, at its
  last block boundary (what vLLM keeps before vLLM #37898). A hit is the longest block boundary
  whose KV blocks and state are all held (all or nothing), and leaves at least one token to compute.
  Chunked prefill, which may leave a state at each chunk's last boundary too, is not modelled.
- `vllm-align-marconi`: the same plus vLLM #37898's Marconi-style admission: when a prompt's held KV
  blocks reach at least one block past its state hit (a shared prefix no state covers), a state
  is also kept at the end of those KV blocks (the branch point, on the grid).
- `vllm-align-every-block`: a state at every block boundary of every prompt (the upper bound of
  align mode; the issue's quick count).
- `hybridkv`: token-level KV (the trace's 512-token blocks, the partial last one too), a state
  checkpoint at each prompt's last full-block boundary (where its next turn's match ends). A hit is
  the longest prefix of held blocks, L tokens; it resumes from a checkpoint held in [L − tail, L]
  (seeded replay), else replays the last `tail × L` tokens from a zero state (tail-replay:
  approximate). What a prompt computed after an approximate start (its later blocks, its state) is
  approximate too, as the connector marks it: a hit is exact only from an exact state on exact
  blocks. A prompt's exact state written again replaces the held one (a use); an approximate one
  never replaces anything. LRU eviction.
- `hybridkv-value`: the same hits; admission and eviction by compute saved per byte held
  (`hybridkv.store.policy`, rule `value`): a KV block saves its tokens' prefill FLOPs, a state the
  FLOPs of the tail replay it makes unnecessary (and it makes the hit exact).

Compute is the cost model's prefill FLOPs (`CostModel.prefill_flops`): a hit that starts
recomputing at `start` saves the FLOPs of [0, start) of that prompt.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.plan import GLM_5_3_FLASH, load_config
from hybridkv.models.meta import cache_sizes, cost_model
from hybridkv.store.policy import KV_BLOCK, STATE, PolicyStore

TRACE_BLOCK = 512  # tokens per hash block in Mooncake's traces (a scaled copy may have others)
POLICIES = ("vllm-align", "vllm-align-marconi", "vllm-align-every-block", "hybridkv", "hybridkv-value")
GB = 1e9


@dataclass(frozen=True)
class TraceSimConfig:
    """What `hybridkv trace-sim` replays. A field's `help` is its flag's text."""

    trace: Path = field(
        metadata={"help": "request trace (Mooncake's jsonl: input_length, hash_ids of 512-token blocks)"}
    )
    capacities: tuple[float, ...] = field(
        default=(10, 30, 100, 300, 1000, 3000, 10000, math.inf),
        metadata={"help": "store capacities in GB (1e9 bytes); inf: unbounded"},
    )
    policies: tuple[str, ...] = field(default=POLICIES, metadata={"help": f"policies ({', '.join(POLICIES)})"})
    align_block: int = field(
        default=3584, metadata={"help": "vLLM align mode's block in tokens (GLM-5.3-Flash: 3,584)"}
    )
    tail: float = field(default=0.05, metadata={"help": "hybridkv's replay tail, a fraction of the matched prefix"})
    block_tokens: int = field(
        default=TRACE_BLOCK,
        metadata={"help": "tokens per hash block (Mooncake's 512; a scaled copy, e.g. trace-replay's, fewer)"},
    )
    replicate: int = field(
        default=1,
        metadata={
            "help": "replay K copies of the trace as K tenants sharing no block (each copy's ids apart), "
            "interleaved request by request at the same timestamps"
        },
    )
    workers: int = field(default=2, metadata={"help": "processes running sweep points side by side"})

    def check(self) -> None:
        if self.block_tokens < 1:
            raise HybridKVError(f"--block-tokens {self.block_tokens} is not a positive token count")
        if self.align_block < 1:
            raise HybridKVError(f"--align-block {self.align_block} is not a positive token count")
        if not 0 <= self.tail < 1:
            raise HybridKVError(f"--tail {self.tail} is not a fraction in [0, 1)")
        if self.replicate < 1 or self.workers < 1:
            raise HybridKVError("--replicate and --workers must be at least 1")
        if unknown := [p for p in self.policies if p not in POLICIES]:
            raise HybridKVError(f"unknown policies {', '.join(unknown)} (known: {', '.join(POLICIES)})")
        if not self.capacities or min(self.capacities) < 0:
            raise HybridKVError("--capacities must be non-negative GB")


@dataclass
class Trace:
    """A trace as a prefix tree: node `i` is one block after the prefix of its parent."""

    path: str
    block: int  # tokens per hash block
    lengths: list[int]  # input tokens per request
    paths: list[list[int]]  # node ids per request, root first
    node_end: list[int]  # token position where node i's block ends
    node_parent: list[int]  # -1 for a first block

    @property
    def nodes(self) -> int:
        return len(self.node_end)


def read_trace(path: Path, block: int = TRACE_BLOCK) -> Trace:
    """Every request of a Mooncake trace of `block`-token hash blocks; a line that is not a request
    is refused, naming it."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise HybridKVError(f"{path}: cannot read the trace ({err})") from err
    index: dict[tuple[int, int], int] = {}
    trace = Trace(str(path), block, [], [], [], [])
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            n, ids = row["input_length"], row["hash_ids"]
            ok = isinstance(n, int) and isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise HybridKVError(f"{path}:{number}: not a trace request ({type(err).__name__}: {err})") from None
        if not ok or n < 1 or len(ids) != -(-n // block):
            raise HybridKVError(
                f"{path}:{number}: not a trace request (input_length {n!r} needs {-(-n // block) if ok else '?'} "
                f"hash ids of {block} tokens, got {len(ids) if isinstance(ids, list) else ids!r})"
            )
        parent, nodes = -1, []
        for i, block_id in enumerate(ids):
            node = index.get((parent, block_id))
            end = min(n, (i + 1) * block)
            if node is None:
                node = index[(parent, block_id)] = len(trace.node_end)
                trace.node_end.append(end)
                trace.node_parent.append(parent)
            elif trace.node_end[node] != end:
                raise HybridKVError(
                    f"{path}:{number}: block {block_id} ends at token {end}, elsewhere at {trace.node_end[node]}"
                )
            nodes.append(node)
            parent = node
        trace.lengths.append(n)
        trace.paths.append(nodes)
    if not trace.lengths:
        raise HybridKVError(f"{path}: no requests")
    return trace


@dataclass(frozen=True)
class Sizes:
    """A model's bytes and compute, as the simulator needs them."""

    model: str
    kv_bytes_per_token: int
    state_bytes: int
    flops: dict[int, float]  # F(p): prefill FLOPs of positions [0, p) without the LM head
    head_flops: float

    def F(self, p: int) -> float:
        return self.flops[p]


def model_sizes(model: str, trace: Trace, tail: float, align_block: int = 3584) -> Sizes:
    """Cache sizes and the cost model's prefill FLOPs at every position the replay can ask for."""
    config = load_config(model)
    sizes, costs = cache_sizes(config), cost_model(config)
    ends = set(trace.node_end) | {n - 1 for n in trace.lengths} | {0}
    positions = ends | {p - tail_tokens(p, tail) for p in ends} | set(range(0, max(trace.lengths) + 1, align_block))
    flops = {p: costs.prefill_flops(0, p) - costs.head_flops if p else 0.0 for p in sorted(positions)}
    return Sizes(model, sizes.kv_bytes_per_token, sizes.state_bytes_per_checkpoint, flops, costs.head_flops)


def tail_tokens(matched: int, tail: float) -> int:
    return round(tail * matched)


@dataclass
class Point:
    """One policy at one capacity, over the whole trace."""

    policy: str
    capacity_gb: float
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0  # prefix tokens whose KV came from the store
    exact_hit_tokens: int = 0  # of those, in hits resumed exactly (state checkpoint held)
    hits: int = 0
    exact_hits: int = 0
    prefill_flops: float = 0.0  # full prefill of every request
    saved_flops: float = 0.0
    bytes_written: int = 0
    bytes_read: int = 0
    state_bytes_written: int = 0
    evicted: int = 0
    refused: int = 0
    seconds: float = 0.0

    def shares(self) -> dict:
        return {
            "token_hit_share": self.hit_tokens / self.input_tokens,
            "exact_hit_share": self.exact_hit_tokens / self.input_tokens,
            "compute_saved_share": self.saved_flops / self.prefill_flops,
        }


def simulate(
    trace: Trace,
    sizes: Sizes,
    policy: str,
    capacity_gb: float,
    align_block: int = 3584,
    tail: float = 0.05,
    replicate: int = 1,
    progress=None,
    on_evict=None,
    hit_log: list | None = None,
) -> Point:
    """Replay `trace` (`replicate` disjoint copies, interleaved) under one policy and capacity.
    `hit_log`, when given, receives (request, tokens matched, start of recompute, exact) per hit."""
    start_time = time.perf_counter()
    capacity = capacity_gb * GB
    run = _align if policy.startswith("vllm-align") else _hybridkv
    rule = "value" if policy == "hybridkv-value" else "lru"
    store = PolicyStore(capacity, rule, on_evict)
    point = Point(policy, capacity_gb)
    # the store holds millions of small objects and frees none of them through cycles: the cyclic
    # collector would only walk them again and again (more than half the time at 10 copies)
    collecting = gc.isenabled()
    gc.disable()
    try:
        run(trace, sizes, policy, store, point, align_block, tail, replicate, progress, hit_log)
    finally:
        if collecting:
            gc.enable()
    point.bytes_written, point.evicted, point.refused = store.bytes_written, store.evicted, store.refused
    point.seconds = time.perf_counter() - start_time
    return point


def _requests(trace: Trace, replicate: int, progress):
    """(request index, node offset of its copy) in replay order, reporting progress every 1,000."""
    n_nodes = trace.nodes
    count = 0
    for i in range(len(trace.lengths)):
        for copy in range(replicate):
            yield i, copy * n_nodes
            count += 1
            if progress is not None and count % 1000 == 0:
                progress(1000)
    if progress is not None:
        progress(count % 1000)


def _hybridkv(trace, sizes, policy, store, point, align_block, tail, replicate, progress, hit_log) -> None:
    kv, state_bytes, F = sizes.kv_bytes_per_token, sizes.state_bytes, sizes.flops.__getitem__
    head, node_end, lengths, paths = sizes.head_flops, trace.node_end, trace.lengths, trace.paths
    entries, use_all, put_chain = store.entries, store.use_all, store.put_chain
    # per node, what its KV block entry holds and saves, and what its state checkpoint saves
    depth = [0] * trace.nodes
    for path in paths:
        for j, node in enumerate(path):
            depth[node] = j
    block_bytes = [(end - j * trace.block) * kv for end, j in zip(node_end, depth, strict=True)]
    block_saved = [F(end) - F(j * trace.block) for end, j in zip(node_end, depth, strict=True)]
    inexact: set[int] = set()  # held entries computed approximately (after a zero-state or inexact start)
    for tick, (i, offset) in enumerate(_requests(trace, replicate, progress)):
        store.now = tick
        n, path = lengths[i], paths[i]
        point.requests += 1
        point.input_tokens += n
        point.prefill_flops += head + F(n)
        # the longest prefix of held KV blocks
        matched, length = 0, len(path)
        while matched < length and path[matched] + offset in entries:
            matched += 1
        start, seeded, used_state, exact = 0, False, None, True  # exact: this prompt's result equals full prefill
        if matched:
            hit = min(node_end[path[matched - 1]], n - 1)  # at least one token is computed
            floor = hit - tail_tokens(hit, tail)
            j = matched - 1
            while j >= 0 and node_end[path[j]] >= floor:
                if node_end[path[j]] <= hit and -(path[j] + offset) - 1 in entries:
                    used_state, start, seeded = -(path[j] + offset) - 1, node_end[path[j]], True
                    break
                j -= 1
            if not seeded:
                start = floor
            exact = seeded and not _any_inexact(inexact, used_state, path[: j + 1], offset)
            point.hits += 1
            point.hit_tokens += hit
            point.bytes_read += hit * kv
            point.saved_flops += F(start)
            if hit_log is not None:
                hit_log.append((tick, hit, start, exact))
            if exact:
                point.exact_hits += 1
                point.exact_hit_tokens += hit
            if seeded:
                point.bytes_read += state_bytes
            # deepest first: ancestors end up no lower
            use_all([path[j] + offset for j in range(matched - 1, -1, -1)])
            if used_state is not None:
                use_all((used_state,))
        # write what the prompt computed: its blocks, then a checkpoint at its last full block
        if matched < length:
            admitted = put_chain(
                [
                    (path[j] + offset, KV_BLOCK, block_bytes[path[j]], block_saved[path[j]], -j)
                    for j in range(matched, length)
                ],
                path[matched - 1] + offset if matched else None,
            )
            written = [path[j] + offset for j in range(matched, matched + admitted)]
            if exact:
                inexact.difference_update(written)
            else:
                inexact.update(written)
        last_full = n // trace.block - 1
        if last_full >= 0 and path[last_full] + offset in entries:
            node = path[last_full]
            key = -(node + offset) - 1
            end = node_end[node]
            if key in entries:  # written again, as the connector does: an exact one replaces it (a
                if exact:  # use), an approximate one never does
                    use_all((key,))
                    inexact.discard(key)
            elif store.put(
                key, STATE, state_bytes, F(end) - F(end - tail_tokens(end, tail)), node + offset, -last_full - 0.5
            ):
                point.state_bytes_written += state_bytes
                if not exact:
                    inexact.add(key)


def _any_inexact(inexact: set[int], state: int, blocks: list[int], offset: int) -> bool:
    """Whether a resume from `state` on `blocks` loads anything computed approximately: then it is
    not exact (what the connector reports as `exact_state`), even from a stored state."""
    return bool(inexact) and (state in inexact or any(node + offset in inexact for node in blocks))


def _align(trace, sizes, policy, store, point, align_block, tail, replicate, progress, hit_log) -> None:
    kv, state_bytes, F = sizes.kv_bytes_per_token, sizes.state_bytes, sizes.flops.__getitem__
    head, lengths, paths = sizes.head_flops, trace.lengths, trace.paths
    block_bytes = align_block * kv
    entries, use_all = store.entries, store.use_all
    marconi, every = policy == "vllm-align-marconi", policy == "vllm-align-every-block"
    # grid nodes per request: the trace block holding each full align block's end (a KV entry, maybe a
    # state); an align block that ends inside a trace block needs that whole trace block matched
    grids = [
        [path[-(-k * align_block // trace.block) - 1] for k in range(1, n // align_block + 1)]
        for n, path in zip(lengths, paths, strict=True)
    ]
    for tick, (i, offset) in enumerate(_requests(trace, replicate, progress)):
        store.now = tick
        n = lengths[i]
        point.requests += 1
        point.input_tokens += n
        point.prefill_flops += head + F(n)
        grid = [node + offset for node in grids[i]] if offset else grids[i]
        held = 0
        while held < len(grid) and grid[held] in entries:
            held += 1
        hit = 0  # blocks resumed: the deepest held KV block with its state, leaving a token to compute
        for k in range(min(held, (n - 1) // align_block), 0, -1):
            if -grid[k - 1] - 1 in entries:
                hit = k
                break
        if hit:
            tokens = hit * align_block
            point.hits += 1
            point.exact_hits += 1
            point.hit_tokens += tokens
            point.exact_hit_tokens += tokens
            point.bytes_read += tokens * kv + state_bytes
            point.saved_flops += F(tokens)
            if hit_log is not None:
                hit_log.append((tick, tokens, tokens, True))
            use_all((-grid[hit - 1] - 1,))
        use_all([grid[k] for k in range(held - 1, -1, -1)])
        store.put_chain(
            [
                (grid[k], KV_BLOCK, block_bytes, F((k + 1) * align_block) - F(k * align_block), -k)
                for k in range(held, len(grid))
            ],
            grid[held - 1] if held else None,
        )
        wanted = range(len(grid)) if every else [len(grid) - 1] if grid else []
        if marconi and held - hit >= 1 and held:
            wanted = sorted({*wanted, held - 1})
        for k in wanted:
            key = -grid[k] - 1
            if grid[k] in entries and key not in entries:
                end = (k + 1) * align_block
                if store.put(key, STATE, state_bytes, F(end), grid[k], -k - 0.5):
                    point.state_bytes_written += state_bytes


def direct_prefix_hits(trace: Trace) -> tuple[int, int]:
    """(tokens of each request's longest prefix seen in an earlier request, input tokens): the count an
    unbounded store must reproduce, made without the store."""
    seen: set[int] = set()
    hit = total = 0
    for n, path in zip(trace.lengths, trace.paths, strict=True):
        total += n
        matched = 0
        while matched < len(path) and path[matched] in seen:
            matched += 1
        if matched:
            hit += trace.node_end[path[matched - 1]]
        seen.update(path)
    return hit, total


# ---- the sweep ---------------------------------------------------------------------------------

_SHARED: dict = {}  # the trace and sizes, inherited by forked workers


def _run_point(args: tuple) -> dict:
    policy, capacity, config = args
    trace, sizes, counter = _SHARED["trace"], _SHARED["sizes"], _SHARED["counter"]

    def progress(k: int) -> None:
        with counter.get_lock():
            counter.value += k

    point = simulate(trace, sizes, policy, capacity, config.align_block, config.tail, config.replicate, progress)
    return asdict(point)


def run_sweep(config: TraceSimConfig, model: str = GLM_5_3_FLASH, show_progress: bool = True) -> dict:
    """Every policy at every capacity; the summary `hybridkv.report.trace_report` writes out."""
    from tqdm import tqdm

    config.check()
    started = time.perf_counter()
    trace = read_trace(config.trace, config.block_tokens)
    sizes = model_sizes(model, trace, config.tail, config.align_block)
    read_seconds = time.perf_counter() - started
    points = [(p, c, config) for p in config.policies for c in config.capacities]
    context = multiprocessing.get_context("fork")
    counter = context.Value("q", 0)
    _SHARED.update(trace=trace, sizes=sizes, counter=counter)  # forked workers inherit them
    total = len(trace.lengths) * config.replicate * len(points)
    with tqdm(total=total, desc="trace-sim", unit="req", disable=not show_progress) as bar:
        if config.workers == 1:
            rows = []
            for point in points:
                rows.append(_run_point(point))
                bar.update(counter.value - bar.n)
        else:
            with context.Pool(min(config.workers, len(points))) as pool:
                pending = pool.map_async(_run_point, points, chunksize=1)
                while not pending.ready():
                    pending.wait(0.5)
                    bar.update(counter.value - bar.n)
                rows = pending.get()
        bar.update(counter.value - bar.n)
    hit, total = direct_prefix_hits(trace)
    return {
        "trace": str(config.trace),
        "model": model,
        "requests": len(trace.lengths),
        "replicate": config.replicate,
        "kv_bytes_per_token": sizes.kv_bytes_per_token,
        "state_bytes_per_checkpoint": sizes.state_bytes,
        "align_block": config.align_block,
        "tail": config.tail,
        "direct_prefix_hit_share": hit / total,
        "read_seconds": read_seconds,
        "wall_seconds": time.perf_counter() - started,
        "workers": config.workers,
        "points": [{**row, **Point(**row).shares()} for row in rows],
    }


def capacity_for(points: list[dict], share: float) -> float | None:
    """The smallest capacity (GB, log-interpolated between sweep points) at which a policy's
    compute-saved share reaches `share`; None if no capacity in the sweep reaches it."""
    rows = sorted(points, key=lambda r: r["capacity_gb"])
    previous = None
    for row in rows:
        if row["compute_saved_share"] >= share:
            if previous is None or row["capacity_gb"] == math.inf or previous["capacity_gb"] <= 0:
                return row["capacity_gb"]
            lo, hi = previous["compute_saved_share"], row["compute_saved_share"]
            a, b = math.log(previous["capacity_gb"]), math.log(row["capacity_gb"])
            return math.exp(a + (b - a) * (share - lo) / (hi - lo)) if hi > lo else row["capacity_gb"]
        previous = row
    return None
