"""Fault injection: a store that is down, slow, killed mid-run, full, or hands back damaged or
misplaced entries must cost recomputation, never a wrong answer, and never raise.

Every test counts the faults it injects and the outputs it checks; an output is wrong when a hit
claims tokens or KV or states that are not the prompt's, or when a method that is exact given its
hit (full, checkpoint, replay of the whole match) disagrees with full prefill. Totals are printed
at the end of the module (run with -s to see them); each test requires wrong == 0.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import redis
import torch

from hybridkv.cache import CachedMatch, capture_prompt
from hybridkv.cache.keys import state_key
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.eval.validate import ValidateConfig, run_validate, validate_prefix
from hybridkv.methods import METHODS, Budget, execute
from hybridkv.models import load_model
from hybridkv.store import GuardedStore, open_store
from hybridkv.store.redis_store import NAMESPACE, RedisStore

MODEL = "random-qwen3-next"
BLOCK = 64
INTERVAL = 64
CACHED_LEN = 200
PROMPT_LEN = 200
MATCHED = 150
EXACT_KL = 1e-6
FULL_BUDGET = Budget(fraction=1.0)
# Methods that are exact whatever the hit: their logits must equal full prefill.
EXACT_PLANS = [
    ("full", None),
    ("checkpoint", None),
    ("tail-replay", FULL_BUDGET),
    ("tail-replay-recompute", FULL_BUDGET),
    ("seeded-replay", FULL_BUDGET),
]
FIDELITY = ["kl_mean", "top1_agreement", "greedy_agreement", "reused_tokens", "replayed_tokens",
            "recomputed_tokens", "matched_length"]  # fmt: skip

TOTALS = {"faults": 0, "checks": 0, "wrong": 0}


@pytest.fixture(scope="module", autouse=True)
def fault_totals():
    yield
    print(
        f"\n[test_store_faults] faults injected: {TOTALS['faults']}, outputs checked: {TOTALS['checks']}, "
        f"wrong outputs: {TOTALS['wrong']}"
    )


class Ledger:
    def __init__(self) -> None:
        self.faults = 0
        self.checks = 0
        self.wrong: list[str] = []

    def fault(self, n: int = 1) -> None:
        self.faults += n
        TOTALS["faults"] += n

    def check(self, ok: bool, what: str) -> None:
        self.checks += 1
        TOTALS["checks"] += 1
        if not ok:
            self.wrong.append(what)
            TOTALS["wrong"] += 1

    def close(self) -> None:
        assert self.faults > 0, "no fault was injected"
        assert self.checks > 0, "no output was checked"
        assert self.wrong == [], f"wrong outputs: {self.wrong}"


@pytest.fixture
def ledger():
    return Ledger()


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def is_exact(reference: torch.Tensor, logits: torch.Tensor) -> bool:
    return (
        logits.shape == reference.shape
        and mean_kl(reference, logits) < EXACT_KL
        and bool((reference.argmax(-1) == logits.argmax(-1)).all())
    )


def hit_is_correct(model, hit, prompt: torch.Tensor, truth) -> bool:
    """A hit (or None) that claims nothing untrue: its tokens are the prompt's, its KV and states
    are bitwise those of the cached prompt `truth` that was written."""
    if hit is None:
        return True
    n = hit.length
    if not 0 < n < prompt.numel() or not torch.equal(hit.cached.tokens[:n], prompt[:n]):
        return False
    got, want = hit.cached.kv_prefix(n), truth.kv_prefix(n)
    if got.keys() != want.keys():
        return False
    for layer in want:
        for name in want[layer]:
            if got[layer][name].shape != want[layer][name].shape or not torch.equal(
                got[layer][name], want[layer][name]
            ):
                return False
    for position, states in hit.cached.checkpoints.items():
        if position > n or position not in truth.checkpoints:
            return False
        for layer, state in states.items():
            expected = truth.checkpoints[position][layer]
            if not state.equal(expected):
                return False
    return True


@dataclass
class Scene:
    model: object
    cached_tokens: torch.Tensor
    prompt: torch.Tensor
    cached: object  # CachedPrompt of cached_tokens by `model`
    full: torch.Tensor  # one-pass logits of the prompt's positions after MATCHED

    @property
    def suffix(self) -> int:
        return PROMPT_LEN - MATCHED

    def check_outputs(self, ledger: Ledger, hit, label: str) -> None:
        ledger.check(hit_is_correct(self.model, hit, self.prompt, self.cached), f"{label}: hit")
        hit = hit if hit is not None else CachedMatch.miss()  # as validate does: a miss recomputes
        for name, budget in EXACT_PLANS:
            recipe = METHODS[name].recipe(hit, budget)
            logits = execute(self.model, self.prompt, hit, recipe, logits_to_keep=self.suffix).logits
            ledger.check(is_exact(self.full, logits), f"{label}: {name} {budget}")


def make_scene(model, make_workload) -> Scene:
    cached_tokens, prompt = make_workload(MATCHED, PROMPT_LEN, CACHED_LEN, seed=11, vocab=model.config.vocab_size)
    cached = capture_prompt(model, cached_tokens, INTERVAL)
    full = model.forward(prompt, model.new_cache(), start=0, logits_to_keep=PROMPT_LEN - MATCHED)
    return Scene(model, cached_tokens, prompt, cached, full)


@pytest.fixture(scope="module")
def scene(models, make_workload) -> Scene:
    return make_scene(models[MODEL], make_workload)


@pytest.fixture(scope="module")
def other_scene(make_workload) -> Scene:
    """The same architecture with other weights: its KV has exactly our layout."""
    return make_scene(load_model(MODEL, seed=1), make_workload)


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}"


def small_config(**overrides) -> ValidateConfig:
    values = dict(
        model=MODEL,
        prefix_lengths=[120],
        suffix_length=8,
        budgets=[Budget(fraction=0.1), FULL_BUDGET],
        checkpoint_interval=INTERVAL,
        repeats=1,
        greedy_tokens=2,
    )
    values.update(overrides)
    return ValidateConfig(**values)


# ---------------------------------------------------------------------------------------------
# Down from the start.


def test_guarded_store_on_a_dead_server_never_raises(ledger):
    url = dead_url()
    ledger.fault()
    every_time = GuardedStore(open_store(url), retry_after_s=0)
    ledger.check(every_time.get("ab" * 32) is None, "get")
    ledger.check(every_time.put("ab" * 32, b"x") is False, "put")
    every_time.delete("ab" * 32)
    ledger.check(every_time.get_many(["ab" * 32, "cd" * 32]) == [None, None], "get_many")
    assert every_time.counts["get_errors"] == 2
    assert every_time.counts["put_errors"] == 1
    assert every_time.counts["delete_errors"] == 1
    # With the default back-off, one failure and the server is left alone for a while.
    backing_off = GuardedStore(open_store(url))
    ledger.check(backing_off.get("cd" * 32) is None, "get")
    ledger.check(backing_off.put("cd" * 32, b"x") is False, "put while down")
    ledger.check(backing_off.get("cd" * 32) is None, "get while down")
    assert backing_off.counts["get_errors"] == 1
    assert backing_off.counts["skipped_while_down"] == 2
    ledger.close()


def test_prefix_cache_on_a_dead_server_is_a_miss(scene, ledger):
    ledger.fault()
    stored = StoredPrefixCache(scene.model, GuardedStore(open_store(dead_url())), checkpoint_interval=INTERVAL)
    ledger.check(stored.add(scene.cached) == 0, "writes reported")
    hit = stored.lookup(scene.prompt)
    ledger.check(hit is None, "lookup")
    scene.check_outputs(ledger, hit, "dead store")
    counts = stored.store.counts
    assert counts["put_errors"] + counts["get_errors"] >= 1
    assert counts["hits"] == 0 and counts["corrupt"] == 0
    ledger.close()


def test_validate_with_a_dead_store_recomputes_everything(models, ledger):
    ledger.fault()
    model = models[MODEL]
    results = run_validate(model, small_config(store=dead_url()), show_progress=False)
    rows = results["rows"]
    assert len(rows) == 3 + 4 * 2
    for row in rows:
        label = f"{row['method']} {row['budget']}"
        ledger.check(row["matched_length"] == 0 and row["reused_tokens"] == 0, f"{label}: reuse")
        ledger.check(row["kl_mean"] < EXACT_KL and row["top1_agreement"] == 1.0, f"{label}: fidelity")
        ledger.check(row["greedy_agreement"] == 1.0, f"{label}: greedy")
    events = results["store"]["events"]
    assert events.get("put_errors", 0) + events.get("get_errors", 0) >= 1
    assert events.get("hits", 0) == 0
    ledger.close()


# ---------------------------------------------------------------------------------------------
# Slow: a server that accepts connections and never answers.


class SilentServer:
    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)  # held open, never read, never answered

    def close(self) -> None:
        self.listener.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def silent_server():
    server = SilentServer()
    yield server
    server.close()


def test_slow_store_costs_one_bounded_timeout(silent_server, scene, ledger):
    """RedisStore promises a bounded wait per call (its socket timeout): a server that never
    answers costs about one timeout, then the guard leaves it alone."""
    ledger.fault()
    guarded = GuardedStore(RedisStore(f"redis://127.0.0.1:{silent_server.port}", timeout_s=0.2))
    started = time.monotonic()
    data = guarded.get("ab" * 32)
    elapsed = time.monotonic() - started
    ledger.check(data is None, "get")
    assert guarded.counts["get_errors"] == 1
    # one call, one connection attempt (a reconnect at most): not one per retry
    assert len(silent_server.connections) <= 2, f"{len(silent_server.connections)} connections for one get"
    assert elapsed < 5.0, f"a get with a 0.2 s timeout took {elapsed:.1f} s"
    # while backing off, the request path does not wait at all
    stored = StoredPrefixCache(scene.model, guarded, checkpoint_interval=INTERVAL)
    started = time.monotonic()
    hit = stored.lookup(scene.prompt)
    assert time.monotonic() - started < 1.0
    scene.check_outputs(ledger, hit, "slow store")
    ledger.close()


# ---------------------------------------------------------------------------------------------
# Killed in the middle of a validate run.


def test_server_killed_mid_validate(models, redis_factory, ledger):
    model = models[MODEL]
    config = small_config(prefix_lengths=[120, 160])
    first, second = config.prefix_lengths
    server = redis_factory()
    store = GuardedStore(open_store(server.url))
    stored = StoredPrefixCache(model, store, checkpoint_interval=INTERVAL)

    with_store_1 = validate_prefix(model, config, first, stored=stored)
    assert store.counts["hits"] > 0 and store.counts["puts"] > 0  # the store really served L1
    server.kill()
    ledger.fault()
    with_store_2 = validate_prefix(model, config, second, stored=stored)
    without_1 = validate_prefix(model, config, first)
    without_2 = validate_prefix(model, config, second)

    for got, want in zip(with_store_1, without_1, strict=True):
        label = f"L1 {got['method']} {got['budget']}"
        assert (got["method"], got["budget"]) == (want["method"], want["budget"])
        ledger.check(got["matched_length"] == first, f"{label}: matched")
        ledger.check({k: got[k] for k in FIDELITY} == {k: want[k] for k in FIDELITY}, f"{label}: same as no store")
    assert len(with_store_2) == len(without_2)
    for got in with_store_2:
        label = f"L2 {got['method']} {got['budget']}"
        ledger.check(got["matched_length"] == 0 and got["reused_tokens"] == 0, f"{label}: reuse")
        ledger.check(got["kl_mean"] < EXACT_KL and got["top1_agreement"] == 1.0, f"{label}: fidelity")
        ledger.check(got["greedy_agreement"] == 1.0, f"{label}: greedy")
    assert store.counts["put_errors"] + store.counts["get_errors"] >= 1
    ledger.close()


# ---------------------------------------------------------------------------------------------
# Damaged and misplaced entries.


class Raw:
    """Direct access to the bytes a backend holds, around hybridkv."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.store = open_store(url)
        self.client = redis.Redis.from_url(url.replace("valkey://", "redis://")) if url.startswith("redis") else None

    def get(self, key: str) -> bytes | None:
        return self.store.get(key)

    def set(self, key: str, data: bytes) -> None:
        self.store.put(key, data)

    def flip(self, key: str, index: int, mask: int) -> None:
        if self.client is not None:  # in place on the server
            name = NAMESPACE + key
            byte = self.client.getrange(name, index, index)
            self.client.setrange(name, index, bytes([byte[0] ^ mask]))
        else:  # edit the file
            path = self.store._path(key)
            data = bytearray(path.read_bytes())
            data[index] ^= mask
            path.write_bytes(bytes(data))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.store.close()


@pytest.fixture(params=["file", "redis"])
def damaged_url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}"
        return
    server = request.getfixturevalue("redis_server")
    url = f"redis://127.0.0.1:{server.port}/6"
    open_store(url).clear()
    yield url
    open_store(url).clear()


def _kv_key(stored: StoredPrefixCache, tokens: torch.Tensor, block: int) -> str:
    return stored.block_key(tokens, block)


def _state_key(stored: StoredPrefixCache, tokens: torch.Tensor, position: int) -> str:
    return state_key(stored.keys.prefix(tokens, position))


def _stored(model, url: str, salt: str = "") -> StoredPrefixCache:
    return StoredPrefixCache(model, GuardedStore(open_store(url)), salt, checkpoint_interval=INTERVAL)


DAMAGE = [
    # (how, entry, expected hit length; None: no hit; "same": MATCHED without a checkpoint)
    ("flip", ("kv", 0), None),
    ("flip", ("kv", 1), 64),
    ("flip", ("kv", 2), 128),
    ("flip-header", ("kv", 1), 64),
    ("flip-checksum", ("kv", 1), 64),
    ("truncate", ("kv", 0), None),
    ("truncate", ("kv", 1), 64),
    ("truncate-to-nothing", ("kv", 2), 128),
    ("flip", ("state", 128), "same"),
    ("truncate", ("state", 128), "same"),
    ("kind-swap", ("state", 128), "same"),
]


@pytest.mark.parametrize(("how", "entry", "expected"), DAMAGE, ids=lambda v: str(v))
def test_damaged_entry_shortens_the_hit_and_is_removed(scene, damaged_url, ledger, how, entry, expected):
    stored = _stored(scene.model, damaged_url)
    stored.add(scene.cached)
    kind, where = entry
    key = (
        _kv_key(stored, scene.cached_tokens, where) if kind == "kv" else _state_key(stored, scene.cached_tokens, where)
    )
    raw = Raw(damaged_url)
    data = raw.get(key)
    assert data is not None
    if how == "flip":
        raw.flip(key, len(data) // 2, 0x01)  # one bit in the tensor bytes
    elif how == "flip-header":
        raw.flip(key, 20, 0x20)
    elif how == "flip-checksum":
        raw.flip(key, len(data) - 1, 0x80)
    elif how == "truncate":
        raw.set(key, data[: len(data) * 2 // 3])
    elif how == "truncate-to-nothing":
        raw.set(key, b"")
    elif how == "kind-swap":  # a KV block's bytes where the state checkpoint should be
        raw.set(key, raw.get(_kv_key(stored, scene.cached_tokens, 1)))
    ledger.fault()

    hit = stored.lookup(scene.prompt)
    if expected is None:
        ledger.check(hit is None, "no hit")
    elif expected == "same":
        ledger.check(hit is not None and hit.length == MATCHED, "hit length kept")
        ledger.check(hit is not None and where not in hit.cached.checkpoints, "no checkpoint from the damaged entry")
    else:
        ledger.check(hit is not None and hit.length == expected, f"hit ends at block start {expected}")
        ledger.check(
            hit is not None and hit.cached.last_checkpoint_at_or_before(hit.length) == expected,
            "the undamaged checkpoint is still used",
        )
    scene.check_outputs(ledger, hit, f"{how} {entry}")
    assert stored.store.counts["corrupt"] == 1
    assert raw.get(key) is None, "the damaged entry was not removed"
    # Later lookups: a plain miss where the entry was, nothing more to reject.
    again = stored.lookup(scene.prompt)
    assert (again.length if again else None) == (hit.length if hit else None)
    assert stored.store.counts["corrupt"] == 1
    # Writing the prompt again heals the store.
    stored.add(scene.cached)
    healed = stored.lookup(scene.prompt)
    ledger.check(healed is not None and healed.length == MATCHED, "healed")
    ledger.check(hit_is_correct(scene.model, healed, scene.prompt, scene.cached), "healed hit")
    raw.close()
    stored.store.inner.close()
    ledger.close()


MISPLACED = [
    # (source, block or state position, expected length for the reader)
    ("other-model", ("kv", 0), None),
    ("other-model", ("kv", 1), 64),
    ("other-model", ("state", 128), "same"),
    ("other-salt", ("kv", 0), None),
    ("other-salt", ("kv", 2), 128),
    ("other-salt", ("state", 128), "same"),
    ("other-position", ("kv", 1), 64),
]


@pytest.mark.parametrize(("source", "entry", "expected"), MISPLACED, ids=lambda v: str(v))
def test_entry_copied_under_another_key_is_rejected(scene, other_scene, damaged_url, ledger, source, entry, expected):
    """The reader has its own entries for the prompt; one of them is overwritten with the bytes of
    an entry written for another model, another tenant, or another place in the prompt — bytes
    with a valid checksum and, for the other model, the very same tensor layout."""
    kind, where = entry
    if source == "other-model":
        writer, reader, truth = _stored(scene.model, damaged_url), _stored(other_scene.model, damaged_url), other_scene
    elif source == "other-salt":
        writer, reader, truth = _stored(scene.model, damaged_url, "a"), _stored(scene.model, damaged_url, "b"), scene
    else:
        writer = reader = _stored(scene.model, damaged_url)
        truth = scene
    writer.add(scene.cached)
    reader.add(truth.cached)
    if kind == "kv":
        target = _kv_key(reader, scene.cached_tokens, where)
        source_key = _kv_key(writer, scene.cached_tokens, where if source != "other-position" else where + 1)
    else:
        target = _state_key(reader, scene.cached_tokens, where)
        source_key = _state_key(writer, scene.cached_tokens, where)
    assert target != source_key
    raw = Raw(damaged_url)
    foreign = raw.get(source_key)
    assert foreign is not None
    raw.set(target, foreign)
    ledger.fault()

    hit = reader.lookup(truth.prompt)
    if expected is None:
        ledger.check(hit is None, "no hit")
    elif expected == "same":
        ledger.check(hit is not None and hit.length == MATCHED, "hit length kept")
        ledger.check(hit is not None and where not in hit.cached.checkpoints, "no checkpoint from the foreign entry")
    else:
        ledger.check(hit is not None and hit.length == expected, f"hit ends at {expected}")
    truth.check_outputs(ledger, hit, f"{source} {entry}")
    assert reader.store.counts["corrupt"] == 1
    assert raw.get(target) is None, "the misplaced entry was not removed"
    assert raw.get(source_key) == foreign, "the writer's own entry must stay"
    raw.close()
    ledger.close()


def test_several_damaged_entries_in_one_lookup(scene, damaged_url, ledger):
    """KV blocks 1 and 2 and the checkpoint at 64 damaged: the hit stops at block 1, without the
    checkpoint; both entries the lookup met are counted and removed."""
    stored = _stored(scene.model, damaged_url)
    stored.add(scene.cached)
    raw = Raw(damaged_url)
    keys = [_kv_key(stored, scene.cached_tokens, 1), _kv_key(stored, scene.cached_tokens, 2)]
    keys.append(_state_key(stored, scene.cached_tokens, 64))
    for key in keys:
        raw.flip(key, len(raw.get(key)) // 3, 0x04)
        ledger.fault()
    hit = stored.lookup(scene.prompt)
    ledger.check(hit is not None and hit.length == BLOCK and not hit.cached.checkpoints, "hit of block 0 only")
    scene.check_outputs(ledger, hit, "several damaged")
    assert stored.store.counts["corrupt"] == 2  # block 1 and the checkpoint; the walk never reads block 2
    assert raw.get(keys[0]) is None and raw.get(keys[2]) is None
    assert raw.get(keys[1]) is not None
    raw.close()
    ledger.close()


# ---------------------------------------------------------------------------------------------
# Full.


def _expected_from_contents(raw: Raw, stored: StoredPrefixCache, scene: Scene) -> int:
    """The hit a correct lookup gives for what the store really holds: consecutive KV blocks
    from the start, capped at the match."""
    covered = 0
    for i in range(-(-CACHED_LEN // BLOCK)):
        if raw.get(_kv_key(stored, scene.cached_tokens, i)) is None:
            break
        covered = min(CACHED_LEN, (i + 1) * BLOCK)
    return min(covered, MATCHED)


@pytest.mark.parametrize("variant", ["maxmemory-300kb", "room-for-a-few-blocks", "memory-lru", "memory-too-small"])
def test_full_store_drops_writes_and_serves_a_correct_hit(scene, redis_factory, ledger, variant):
    retry_after = 5.0
    if variant.startswith("memory"):
        capacity = 700_000 if variant == "memory-lru" else 100_000
        url = f"memory://?capacity={capacity}"
        retry_after = 0.0
        inner = open_store(url)
        raw = None
    else:
        server = redis_factory("--maxmemory", "300kb", "--maxmemory-policy", "noeviction")
        url = server.url
        if variant == "room-for-a-few-blocks":
            client = redis.Redis(port=server.port)
            used = client.info("memory")["used_memory"]
            client.config_set("maxmemory", used + 700_000)  # a couple of ~260 kB KV blocks
            client.close()
            retry_after = 0.0
        inner = open_store(url)
        raw = Raw(url)
    store = GuardedStore(inner, retry_after_s=retry_after)
    stored = StoredPrefixCache(scene.model, store, checkpoint_interval=INTERVAL)
    entries = -(-CACHED_LEN // BLOCK) + len(scene.cached.checkpoints)
    written = stored.add(scene.cached)
    ledger.fault()
    if variant == "memory-lru":  # every write lands, older entries make room
        assert written == entries and inner.evictions > 0
    else:
        assert written < entries
        assert store.counts["put_errors"] >= 1
    hit = stored.lookup(scene.prompt)
    scene.check_outputs(ledger, hit, variant)
    if raw is not None and retry_after == 0.0:
        expected = _expected_from_contents(raw, stored, scene)
        ledger.check((hit.length if hit else 0) == expected, f"hit serves what the store holds ({expected})")
        assert written >= 1  # some writes made it, not all
    if variant == "memory-lru":  # the oldest entries (the first blocks) were evicted
        ledger.check(hit is None, "no hit without block 0")
    assert store.counts["corrupt"] == 0
    if raw is not None:
        raw.close()
    ledger.close()
