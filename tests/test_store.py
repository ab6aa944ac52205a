"""Stores behind one interface (memory, file, redis, valkey) and the store-backed prefix cache.

Every backend is exercised the same way through a URL; the redis and valkey URLs point at the
real redis-server the session starts (valkey in another database). The store-backed prefix
cache is checked against the in-process PrefixCache as the oracle: the same hit, the same bytes,
the same logits for every method.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import HybridKVError
from hybridkv.cache import CachedMatch, PrefixCache, capture_prompt
from hybridkv.cache.keys import model_fingerprint
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.cli import main
from hybridkv.methods import METHODS, Budget, execute
from hybridkv.models import load_model
from hybridkv.store import GuardedStore, StoreError, open_store
from hybridkv.store.base import Worth
from hybridkv.store.file import FileStore
from hybridkv.store.memory import MemoryStore
from hybridkv.store.policy import PolicyStore
from tests.helpers import lcp

BLOCK = 64  # StoredPrefixCache's default block size
INTERVAL = 64  # state checkpoint interval
CACHED_LEN = 200
PROMPT_LEN = 200
MATCHED = 150  # not a multiple of BLOCK: the match ends inside a block
BUDGETS = [Budget(fraction=0.1), Budget(fraction=1.0)]
BACKENDS = ["memory", "file", "redis", "valkey"]


def hex_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _wipe(url: str) -> None:
    store = open_store(url)
    try:
        store.clear()
    finally:
        store.close()


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    kind = request.param
    if kind == "memory":
        yield "memory://"
        return
    if kind == "file":
        yield f"file://{tmp_path / 'store'}"
        return
    server = request.getfixturevalue("redis_server")
    url = server.url if kind == "redis" else f"valkey://127.0.0.1:{server.port}/1"
    _wipe(url)
    yield url
    _wipe(url)


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


# ---------------------------------------------------------------------------------------------
# Byte round trips on every backend.


def test_contains_says_whether_a_key_is_held(store):
    key = hex_key("held")
    assert not store.contains(key)
    store.put(key, b"x")
    assert store.contains(key) and not store.contains(hex_key("other"))
    store.delete(key)
    assert not store.contains(key)


def test_round_trip_of_byte_payloads(store):
    rng = np.random.default_rng(0)
    payloads = {hex_key("empty"): b"", hex_key("one"): b"\x00", hex_key("mib"): rng.bytes(1 << 20)}
    for key, data in payloads.items():
        assert store.get(key) is None
        store.put(key, data)
    for key, data in payloads.items():
        got = store.get(key)
        assert isinstance(got, bytes) and got == data
    stats = store.stats()
    assert stats["entries"] == len(payloads)
    assert stats["bytes"] == sum(len(d) for d in payloads.values())
    store.delete(hex_key("one"))
    assert store.get(hex_key("one")) is None
    assert store.get(hex_key("mib")) == payloads[hex_key("mib")]
    store.delete(hex_key("never written"))  # deleting an absent key is fine
    assert store.stats()["entries"] == len(payloads) - 1


def test_a_batched_read_equals_one_read_per_key(store):
    from hybridkv.store.base import get_many

    keys = [hex_key(f"batch {i}") for i in range(5)]
    for key in keys[::2]:
        store.put(key, key.encode() * 3)
    assert get_many(store, keys) == [store.get(key) for key in keys]
    assert get_many(store, keys)[1] is None and get_many(store, []) == []


def test_absent_key_is_none(store):
    assert store.get(hex_key("absent")) is None


def test_overwrite_replaces(store):
    key = hex_key("k")
    store.put(key, b"first value")
    store.put(key, b"2nd")
    assert store.get(key) == b"2nd"
    assert store.stats()["entries"] == 1
    assert store.stats()["bytes"] == 3


def test_clear_empties_and_counts(store):
    keys = [hex_key(str(i)) for i in range(7)]
    for key in keys:
        store.put(key, key.encode())
    assert store.clear() == len(keys)
    assert all(store.get(key) is None for key in keys)
    assert store.stats()["entries"] == 0
    assert store.clear() == 0


def test_redis_clear_removes_only_hybridkv_entries_of_its_database(redis_server):
    db0, db1 = redis_server.url, f"valkey://127.0.0.1:{redis_server.port}/1"
    client = redis.Redis(port=redis_server.port)
    try:
        _wipe(db0)
        _wipe(db1)
        client.set("not-hybridkv", b"keep me")
        a, b = open_store(db0), open_store(db1)
        a.put(hex_key("a"), b"in db0")
        b.put(hex_key("b"), b"in db1")
        assert a.get(hex_key("b")) is None and b.get(hex_key("a")) is None  # databases are separate
        assert b.clear() == 1
        assert a.get(hex_key("a")) == b"in db0"
        assert a.stats()["entries"] == 1  # the foreign key is not counted
        assert a.clear() == 1
        assert client.get("not-hybridkv") == b"keep me"
        a.close()
        b.close()
    finally:
        client.delete("not-hybridkv")
        client.close()


# ---------------------------------------------------------------------------------------------
# memory:// — an LRU with a byte budget.


def test_memory_lru_evicts_the_least_recently_used():
    store = open_store("memory://?capacity=300")
    assert isinstance(store, MemoryStore) and store.capacity_bytes == 300
    a, b, c, d = (hex_key(x) for x in "abcd")
    store.put(a, b"a" * 100)
    store.put(b, b"b" * 100)
    store.put(c, b"c" * 100)
    assert store.get(a) == b"a" * 100  # a is now the most recently used
    store.put(d, b"d" * 100)
    assert store.get(b) is None  # b, the least recently used, went first
    assert store.get(a) is not None and store.get(c) is not None and store.get(d) is not None
    assert store.stats()["bytes"] <= 300


def test_memory_entry_larger_than_capacity_is_refused():
    store = open_store("memory://?capacity=100")
    store.put(hex_key("small"), b"x" * 60)
    with pytest.raises(StoreError):
        store.put(hex_key("big"), b"x" * 101)
    assert store.get(hex_key("small")) == b"x" * 60  # nothing was evicted for it
    assert store.get(hex_key("big")) is None


_ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 5), st.integers(0, 120)), max_size=40
)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 300), _ops)
def test_memory_store_is_an_lru_with_a_byte_budget(capacity, ops):
    """Against an oracle: an OrderedDict LRU that evicts least recently used first."""
    store = MemoryStore(capacity)
    oracle: OrderedDict[str, bytes] = OrderedDict()
    for op, k, size in ops:
        key = hex_key(str(k))
        if op == "put":
            data = bytes([k]) * size
            if size > capacity:
                with pytest.raises(StoreError):
                    store.put(key, data)
                continue
            store.put(key, data)
            oracle.pop(key, None)
            while sum(map(len, oracle.values())) + size > capacity:
                oracle.popitem(last=False)
            oracle[key] = data
        elif op == "get":
            expected = oracle.get(key)
            if expected is not None:
                oracle.move_to_end(key)
            assert store.get(key) == expected
        else:
            store.delete(key)
            oracle.pop(key, None)
        stats = store.stats()
        assert stats["entries"] == len(oracle)
        assert stats["bytes"] == sum(map(len, oracle.values())) <= capacity


# ---------------------------------------------------------------------------------------------
# file:// — atomic writes, survives reopening.


def test_file_store_writes_are_atomic_and_survive_reopening(tmp_path):
    root = tmp_path / "files"
    store = open_store(f"file://{root}")
    payloads = {hex_key(str(i)): os.urandom(1000 + i) for i in range(20)}
    for key, data in payloads.items():
        store.put(key, data)
    store.put(hex_key("0"), b"replaced")
    payloads[hex_key("0")] = b"replaced"
    assert not [p for p in root.rglob("*") if p.name.startswith(".tmp-")]
    reopened = FileStore(root)
    assert {key: reopened.get(key) for key in payloads} == payloads
    assert reopened.stats()["entries"] == len(payloads)


def test_file_store_failed_write_leaves_the_old_entry_and_no_temp_file(tmp_path, monkeypatch):
    store = FileStore(tmp_path / "files")
    key = hex_key("k")
    store.put(key, b"old")

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hybridkv.store.file.os.replace", refuse)
    with pytest.raises(StoreError):
        store.put(key, b"new" * 1000)
    monkeypatch.undo()
    assert store.get(key) == b"old"
    assert not [p for p in (tmp_path / "files").rglob("*") if p.name.startswith(".tmp-")]


def test_file_store_readers_never_see_half_an_entry(tmp_path):
    store = FileStore(tmp_path / "files")
    key = hex_key("k")
    versions = [bytes([1]) * 300_000, bytes([2]) * 200_000]
    store.put(key, versions[0])
    seen, stop = [], threading.Event()

    def read():
        reader = FileStore(tmp_path / "files")
        while not stop.is_set():
            seen.append(reader.get(key))

    thread = threading.Thread(target=read)
    thread.start()
    for i in range(60):
        store.put(key, versions[i % 2])
    stop.set()
    thread.join()
    assert seen and all(data in versions for data in seen)


@pytest.fixture(params=["file", "redis"])
def bounded_url(request, tmp_path):
    """A store URL with a capacity of 20,000 bytes, on a file store or the session's redis-server."""
    if request.param == "file":
        yield f"file://{tmp_path / 'files'}?capacity=20000"
        return
    url = f"{request.getfixturevalue('redis_server').url}/2?capacity=20000"
    _wipe(url)
    yield url
    _wipe(url)


def test_a_capacity_bound_store_is_an_lru_over_its_bytes(bounded_url):
    """Entries go least recently used first (a read counts as a use, a replacement as a write), the
    bytes held never exceed the capacity once a write is done, and what is kept reads back whole."""
    rng = random.Random(3)
    store = open_store(bounded_url)
    assert store.capacity_bytes == 20000
    oracle: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
    for step in range(300):
        key = hex_key(str(rng.randrange(40)))
        if rng.random() < 0.4:
            assert store.get(key) == oracle.get(key)
            if key in oracle:
                oracle.move_to_end(key)
            continue
        data = os.urandom(rng.randrange(500, 6000))
        oracle.pop(key, None)
        while sum(map(len, oracle.values())) + len(data) > 20000:
            oracle.popitem(last=False)
        store.put(key, data)
        oracle[key] = data
        assert store.stats()["bytes"] == sum(map(len, oracle.values())) <= 20000, step
    assert {key: store.get(key) for key in oracle} == oracle
    if "counted_bytes" in (stats := store.stats()):
        assert stats["counted_bytes"] == stats["bytes"]
    store.close()


def test_a_file_store_capacity_is_refused_when_malformed_and_an_entry_larger_than_it_is_refused(tmp_path):
    for bad in ("abc", "0", "-1"):
        with pytest.raises(HybridKVError, match="capacity must be a positive byte count"):
            open_store(f"file://{tmp_path / 'files'}?capacity={bad}")
    store = open_store(f"file://{tmp_path / 'files'}?capacity=100")
    with pytest.raises(StoreError, match="exceeds the file store's capacity") as refused:
        store.put(hex_key("big"), b"x" * 101)
    assert not refused.value.unavailable and store.stats()["entries"] == 0


def _write_entries(url: str, writer: int, count: int) -> None:
    store = open_store(url)
    for i in range(count):
        store.put(hex_key(f"{writer}-{i}"), bytes([writer]) * (1000 + 25 * i))
        store.get(hex_key(f"{3 - writer}-{i // 2}"))  # the other writer's entries are read too
    store.close()


def test_two_processes_writing_to_one_capacity_never_exceed_it_and_agree_on_what_it_holds(bounded_url):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_entries, args=(bounded_url, w, 60)) for w in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    store = open_store(bounded_url)
    stats = store.stats()
    assert 0 < stats["bytes"] <= 20000
    if bounded_url.startswith("file"):
        counted = int((Path(urlparse(bounded_url).path) / ".usage").read_text())
    else:
        counted = stats["counted_bytes"]
    assert counted == stats["bytes"]  # neither counted the other's bytes twice, nor missed any
    for writer in (1, 2):  # what is kept is whole
        kept = {i: store.get(hex_key(f"{writer}-{i}")) for i in range(60)}
        assert all(data in (None, bytes([writer]) * (1000 + 25 * i)) for i, data in kept.items())
    store.close()


KILLED_MID_EVICTION = """
import os, signal, sys
from pathlib import Path
from hybridkv.store import open_store

store = open_store(f"file://{sys.argv[1]}?capacity=10000")
for i in range(4):
    store.put(f"{i:02x}" * 4, bytes([i]) * 2400)
unlink = Path.unlink
def unlink_then_die(self, missing_ok=False):
    unlink(self, missing_ok=missing_ok)
    os.kill(os.getpid(), signal.SIGKILL)  # the first victim is gone, the others and the count are not
Path.unlink = unlink_then_die
store.put("ff" * 4, bytes([255]) * 6000)  # needs three entries removed
"""


def test_a_writer_killed_mid_eviction_leaves_misses_never_wrong_bytes_and_the_next_write_recounts(tmp_path):
    root = tmp_path / "files"
    done = subprocess.run([sys.executable, "-c", KILLED_MID_EVICTION, str(root)], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    store = open_store(f"file://{root}?capacity=10000")
    kept = {i: store.get(f"{i:02x}" * 4) for i in range(4)}
    assert kept[0] is None and all(data == bytes([i]) * 2400 for i, data in kept.items() if i)  # first victim only
    assert store.get("ff" * 4) is None  # the write that died never landed
    assert int((root / ".usage").read_text()) > store.stats()["bytes"]  # an estimate from above
    store.put("ee" * 4, bytes([238]) * 6000)
    assert int((root / ".usage").read_text()) == store.stats()["bytes"] <= 10000
    assert store.get("ee" * 4) == bytes([238]) * 6000


def test_an_eviction_removes_temporary_files_killed_writers_left_and_keeps_fresh_ones(tmp_path):
    root = tmp_path / "files"
    store = open_store(f"file://{root}?capacity=5000")
    store.put("aa" * 4, b"a" * 3000)
    (root / "aa" / ".tmp-old").write_bytes(b"x" * 100)
    os.utime(root / "aa" / ".tmp-old", (1, 1))  # left by a writer killed long ago
    (root / "aa" / ".tmp-new").write_bytes(b"y" * 100)  # a write in progress
    store.put("bb" * 4, b"b" * 3000)  # does not fit: evicts
    assert not (root / "aa" / ".tmp-old").exists() and (root / "aa" / ".tmp-new").exists()
    assert store.get("aa" * 4) is None and store.get("bb" * 4) == b"b" * 3000


def test_file_store_refuses_keys_that_are_not_hex_digests(tmp_path):
    store = FileStore(tmp_path / "files")
    for key in ["../escape", "ABCDEF", "", "k/../../x"]:
        with pytest.raises(ValueError):
            store.put(key, b"x")
    assert not list((tmp_path).rglob("x"))


# ---------------------------------------------------------------------------------------------
# open_store: every malformed URL is a one-line HybridKVError.


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "nosuchscheme://x",
        "file://",
        "memory://?capacity=abc",
        "memory://?capacity=0",
        "memory://?capacity=-5",
        "file:///tmp/x?capacity=0",
        "redis://",
        "redis://127.0.0.1:6379/notadb",
        "valkey://127.0.0.1:notaport",
    ],
)
def test_open_store_rejects_malformed_urls(url):
    with pytest.raises(HybridKVError):
        open_store(url)


def test_open_store_picks_the_backend(tmp_path, redis_server):
    assert isinstance(open_store("memory://"), MemoryStore)
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    for url in (redis_server.url, f"valkey://127.0.0.1:{redis_server.port}/2"):
        opened = open_store(url)
        key = hex_key(url)
        opened.put(key, b"v")
        assert opened.get(key) == b"v"
        opened.delete(key)
        opened.close()


# ---------------------------------------------------------------------------------------------
# The store-backed prefix cache against the in-process one.


class Reference:
    """A cached prompt C and a new prompt P sharing exactly MATCHED tokens, with the in-process
    PrefixCache hit and every method's outcome from it."""

    def __init__(self, model, make_workload, seed: int = 3):
        self.model = model
        vocab = model.config.vocab_size
        self.cached_tokens, self.prompt = make_workload(MATCHED, PROMPT_LEN, CACHED_LEN, seed=seed, vocab=vocab)
        self.cached = capture_prompt(model, self.cached_tokens, INTERVAL)
        cache = PrefixCache()
        cache.add(self.cached)
        self.hit = cache.lookup(self.prompt)
        assert self.hit is not None and self.hit.length == MATCHED
        self.outcomes = {plan: self.run(self.hit, plan) for plan in self.plans()}
        full_cache = model.new_cache()
        self.full = model.forward(self.prompt, full_cache, start=0, logits_to_keep=PROMPT_LEN - MATCHED)

    @staticmethod
    def plans():
        for name, method in METHODS.items():
            for budget in BUDGETS if method.uses_budget else [None]:
                yield name, budget

    def run(self, hit, plan):
        name, budget = plan
        recipe = METHODS[name].recipe(hit, budget)
        return recipe, execute(self.model, self.prompt, hit, recipe, logits_to_keep=PROMPT_LEN - MATCHED)


@pytest.fixture(scope="module")
def reference(models, make_workload):
    built = {}

    def get(name: str) -> Reference:
        if name not in built:
            built[name] = Reference(models[name], make_workload)
        return built[name]

    return get


def stored_cache(model, url_or_store, salt: str = "", **kwargs) -> StoredPrefixCache:
    store = url_or_store if not isinstance(url_or_store, str) else open_store(url_or_store)
    return StoredPrefixCache(model, GuardedStore(store), salt, checkpoint_interval=INTERVAL, **kwargs)


def assert_same_hit(model, stored: CachedMatch, expected: CachedMatch, prompt: torch.Tensor) -> None:
    assert stored is not None
    assert stored.length == expected.length
    n = stored.length
    assert torch.equal(stored.cached.tokens[:n], prompt[:n])
    assert torch.equal(stored.cached.tokens[:n], expected.cached.tokens[:n])
    got, want = stored.cached.kv_prefix(n), expected.cached.kv_prefix(n)
    assert got.keys() == want.keys()
    for layer in want:
        assert got[layer].keys() == want[layer].keys()
        for name in want[layer]:
            a, b = got[layer][name], want[layer][name]
            assert a.dtype == b.dtype and a.shape == b.shape, (layer, name)
            assert torch.equal(a, b), (layer, name)
    # The checkpoint a method would use is there, with the very same states.
    position = expected.cached.last_checkpoint_at_or_before(n)
    assert stored.cached.last_checkpoint_at_or_before(n) == position
    for pos, states in stored.cached.checkpoints.items():
        assert pos <= n and pos in expected.cached.checkpoints
        truth = expected.cached.checkpoints[pos]
        assert states.keys() == truth.keys()
        for layer, state in states.items():
            assert state.equal(truth[layer])
            assert all(t.dtype == truth[layer][name].dtype for name, t in state.tensors.items())


# random-qwen3-next on every backend; the other architectures (glm5's DSA indexer keys and empty
# MLA values, olmo's layout) on one backend each.
EQUIVALENCE_CASES = [("random-qwen3-next", backend) for backend in BACKENDS] + [
    ("random-glm5-next", "redis"),
    ("random-glm5-next", "file"),
    ("random-olmo-hybrid", "valkey"),
    ("random-olmo-hybrid", "memory"),
]


@pytest.fixture
def backend_url(request, tmp_path):
    """Like store_url, for an explicitly chosen backend."""
    kind = request.param
    if kind == "memory":
        yield "memory://"
    elif kind == "file":
        yield f"file://{tmp_path / 'store'}"
    else:
        server = request.getfixturevalue("redis_server")
        url = server.url if kind == "redis" else f"valkey://127.0.0.1:{server.port}/1"
        _wipe(url)
        yield url
        _wipe(url)


@pytest.mark.parametrize(("name", "backend_url"), EQUIVALENCE_CASES, indirect=["backend_url"])
def test_stored_hit_equals_in_memory_hit_and_gives_the_same_logits(reference, name, backend_url):
    ref = reference(name)
    stored = stored_cache(ref.model, backend_url)
    written = stored.add(ref.cached)
    blocks = -(-CACHED_LEN // BLOCK)
    assert written == blocks + len(ref.cached.checkpoints)
    hit = stored.lookup(ref.prompt)
    assert_same_hit(ref.model, hit, ref.hit, ref.prompt)
    assert stored.store.counts["corrupt"] == 0
    for plan, (recipe, outcome) in ref.outcomes.items():
        got_recipe, got = ref.run(hit, plan)
        assert got_recipe == recipe, plan
        assert torch.equal(got.logits, outcome.logits), plan
        assert (got.reused_tokens, got.replayed_tokens, got.recomputed_tokens) == (
            outcome.reused_tokens,
            outcome.replayed_tokens,
            outcome.recomputed_tokens,
        ), plan
    # and the exact methods are exact against one full prefill pass
    for plan in [("full", None), ("checkpoint", None), ("tail-replay", BUDGETS[-1])]:
        logits = ref.run(hit, plan)[1].logits
        assert torch.allclose(logits, ref.full, atol=1e-4, rtol=1e-4), plan
        assert torch.equal(logits.argmax(-1), ref.full.argmax(-1)), plan
    stored.store.inner.close()


def _diverging(cached: torch.Tensor, length: int, total: int, seed: int) -> torch.Tensor:
    """A prompt of `total` tokens sharing exactly `length` tokens with `cached`."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 512, (total,), generator=generator)
    prompt[:length] = cached[:length]
    if length < min(total, len(cached)) and prompt[length] == cached[length]:
        prompt[length] = 3 + (int(cached[length]) - 3 + 1) % 509
    return prompt


DIVERGENCE = [1, 2, 10, 63, 64, 65, 100, 127, 128, 129, 150, 191, 192, 199]


def test_token_level_match_on_every_backend(reference, store_url):
    ref = reference("random-qwen3-next")
    stored = stored_cache(ref.model, store_url)
    stored.add(ref.cached)
    oracle = PrefixCache()
    oracle.add(ref.cached)
    for length in DIVERGENCE:
        prompt = _diverging(ref.cached_tokens, length, 230, seed=length)
        expected = oracle.lookup(prompt)
        assert expected.length == length
        assert_same_hit(ref.model, stored.lookup(prompt), expected, prompt)
    # a prompt that diverges at its very first token gets nothing
    assert stored.lookup(_diverging(ref.cached_tokens, 0, 230, seed=0)) is None
    # the cached prompt itself: everything but its last token
    assert stored.lookup(ref.cached_tokens).length == CACHED_LEN - 1
    # an extension of it: all of it
    extended = torch.cat([ref.cached_tokens, torch.tensor([5, 6, 7])])
    assert stored.lookup(extended).length == CACHED_LEN
    assert stored.store.counts["corrupt"] == 0
    stored.store.inner.close()


@pytest.fixture(scope="module")
def memory_stored(reference):
    ref = reference("random-qwen3-next")
    stored = stored_cache(ref.model, "memory://")
    stored.add(ref.cached)
    oracle = PrefixCache()
    oracle.add(ref.cached)
    return ref, stored, oracle


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, CACHED_LEN + 20), st.integers(1, 40), st.integers(0, 2**16), st.booleans())
def test_token_level_match_is_the_longest_common_prefix(memory_stored, length, extra, seed, diverge):
    """Any prompt: the stored hit is the brute-force longest common prefix (never the last token)."""
    ref, stored, oracle = memory_stored
    total = max(length + extra, 2)
    if diverge:
        prompt = _diverging(ref.cached_tokens, min(length, CACHED_LEN), total, seed)
    else:  # a prefix or an extension of the cached prompt, tail random
        prompt = torch.randint(3, 512, (total,), generator=torch.Generator().manual_seed(seed))
        shared = min(length, CACHED_LEN, total)
        prompt[:shared] = ref.cached_tokens[:shared]
    expected_length = lcp(ref.cached_tokens.tolist(), prompt[:-1].tolist())
    hit = stored.lookup(prompt)
    if expected_length == 0:
        assert hit is None
        return
    assert hit is not None and hit.length == expected_length < prompt.numel()
    assert_same_hit(ref.model, hit, oracle.lookup(prompt), prompt)


@pytest.mark.parametrize("block_tokens", [16, 48, 100])
def test_other_block_sizes_give_the_same_hit(reference, block_tokens):
    ref = reference("random-qwen3-next")
    stored = stored_cache(ref.model, "memory://", block_tokens=block_tokens)
    assert stored.add(ref.cached) == -(-CACHED_LEN // block_tokens) + len(ref.cached.checkpoints)
    assert_same_hit(ref.model, stored.lookup(ref.prompt), ref.hit, ref.prompt)


def test_prompts_diverging_inside_a_block_each_keep_theirs(reference):
    """C1 and C2 agree up to 10 tokens into block 1 (a shared header, then other passages), so both
    list their block 1 in one slot. Each prompt still finds its own block, with its exact KV and
    checkpoint; a prompt leaving both inside those 10 tokens gets them from either."""
    ref = reference("random-qwen3-next")
    model = ref.model
    c1 = ref.cached_tokens
    c2 = _diverging(c1, BLOCK + 10, CACHED_LEN, seed=99)
    cached2 = capture_prompt(model, c2, INTERVAL)
    stored = stored_cache(model, "memory://")
    stored.add(ref.cached)
    stored.add(cached2)  # written last: keyed by blocks named by the slot alone, it took block 1's
    assert_same_hit(model, stored.lookup(ref.prompt), ref.hit, ref.prompt)  # follows C1 for MATCHED tokens
    for plan in [("full", None), ("checkpoint", None), ("tail-replay", BUDGETS[-1])]:
        logits = ref.run(stored.lookup(ref.prompt), plan)[1].logits
        assert torch.allclose(logits, ref.full, atol=1e-4, rtol=1e-4), plan
    prompt2 = torch.cat([c2[:MATCHED], ref.prompt[MATCHED:]])
    prompt2[MATCHED] = 3 + (int(c2[MATCHED]) - 3 + 1) % 509
    oracle = PrefixCache()
    oracle.add(cached2)
    assert_same_hit(model, stored.lookup(prompt2), oracle.lookup(prompt2), prompt2)  # follows C2
    early = _diverging(c1, BLOCK + 5, 230, seed=7)
    assert stored.lookup(early).length == BLOCK + 5
    inside = _diverging(c1, BLOCK + 30, 230, seed=8)  # leaves C1 inside block 1, past where C2 left it
    oracle = PrefixCache()
    oracle.add(ref.cached)
    assert_same_hit(model, stored.lookup(inside), oracle.lookup(inside), inside)
    assert stored.store.counts["corrupt"] == 0


def test_salts_isolate_tenants(reference, store_url):
    ref = reference("random-qwen3-next")
    store = open_store(store_url)
    tenant_a = stored_cache(ref.model, store, salt="a")
    tenant_b = stored_cache(ref.model, store, salt="b")
    no_salt = stored_cache(ref.model, store)
    tenant_a.add(ref.cached)
    assert tenant_b.lookup(ref.prompt) is None
    assert no_salt.lookup(ref.prompt) is None
    assert tenant_a.lookup(ref.prompt).length == MATCHED  # positive control, same store
    for cache in (tenant_a, tenant_b, no_salt):
        assert cache.store.counts["corrupt"] == 0
    store.close()


def test_another_model_never_hits(reference, store_url):
    ref = reference("random-qwen3-next")
    other = load_model("random-qwen3-next", seed=1)
    store = open_store(store_url)
    ours = stored_cache(ref.model, store)
    theirs = stored_cache(other, store)
    assert theirs.fingerprint != ours.fingerprint
    ours.add(ref.cached)
    assert theirs.lookup(ref.prompt) is None
    assert ours.lookup(ref.prompt).length == MATCHED
    store.close()


# ---------------------------------------------------------------------------------------------
# Two processes sharing one cache.

_WRITER = """
import json, os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
torch.set_num_threads(2)
from hybridkv.cache import capture_prompt
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.models import load_model
from hybridkv.store import GuardedStore, open_store

name, tokens, urls, interval = json.loads(sys.argv[1])
model = load_model(name)
cached = capture_prompt(model, torch.tensor(tokens, dtype=torch.long), interval)
out = {}
for url in urls:
    store = GuardedStore(open_store(url))
    stored = StoredPrefixCache(model, store, checkpoint_interval=interval)
    out[url] = {"written": stored.add(cached), "fingerprint": stored.fingerprint, "counts": dict(store.counts)}
    store.inner.close()
print(json.dumps(out))
"""


def test_two_processes_share_one_cache(reference, redis_server, tmp_path):
    ref = reference("random-qwen3-next")
    urls = [f"redis://127.0.0.1:{redis_server.port}/3", f"file://{tmp_path / 'shared'}"]
    _wipe(urls[0])
    try:
        env = {**os.environ, "PYTHONHASHSEED": "7"}
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _WRITER,
                json.dumps(["random-qwen3-next", ref.cached_tokens.tolist(), urls, INTERVAL]),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        written = json.loads(result.stdout.strip().splitlines()[-1])
        expected_writes = -(-CACHED_LEN // BLOCK) + len(ref.cached.checkpoints)
        for url in urls:
            assert written[url]["written"] == expected_writes, written[url]
            assert written[url]["fingerprint"] == model_fingerprint(ref.model)
            stored = stored_cache(ref.model, url)  # this process, a fresh connection
            hit = stored.lookup(ref.prompt)
            assert_same_hit(ref.model, hit, ref.hit, ref.prompt)
            for plan in [("tail-replay", BUDGETS[0]), ("tail-replay", BUDGETS[1]), ("checkpoint", None)]:
                recipe, outcome = ref.outcomes[plan]
                got_recipe, got = ref.run(hit, plan)
                assert got_recipe == recipe
                assert torch.equal(got.logits, outcome.logits), (url, plan)
            assert stored.store.counts["corrupt"] == 0
            stored.store.inner.close()
    finally:
        _wipe(urls[0])


# ---------------------------------------------------------------------------------------------
# CLI: hybridkv store stats|clear.


@pytest.mark.parametrize("backend", ["file", "redis", "valkey"])
def test_cli_store_stats_and_clear(reference, redis_server, tmp_path, capsys, backend):
    ref = reference("random-qwen3-next")
    url = {
        "file": f"file://{tmp_path / 'cli'}",
        "redis": f"redis://127.0.0.1:{redis_server.port}/4",
        "valkey": f"valkey://127.0.0.1:{redis_server.port}/5",
    }[backend]
    _wipe(url)
    stored = stored_cache(ref.model, url)
    count = stored.add(ref.cached)
    stored.store.inner.close()
    capsys.readouterr()
    assert main(["store", "stats", "--store", url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["url"] == url
    assert stats["entries"] == count + -(-CACHED_LEN // BLOCK)  # and each block's slot list
    assert stats["bytes"] > ref.cached.kv_bytes()  # every tensor byte is in there, plus headers
    assert main(["store", "clear", "--store", url]) == 0
    out = capsys.readouterr().out
    assert str(stats["entries"]) in out
    assert main(["store", "stats", "--store", url]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0
    _wipe(url)


def test_cli_store_stats_of_a_fresh_memory_store(capsys):
    assert main(["store", "stats", "--store", "memory://"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0


def _dead_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("action", "url"),
    [
        ("stats", "redis://127.0.0.1:{dead}"),  # nothing listening
        ("clear", "redis://127.0.0.1:{dead}"),
        ("stats", "redis://127.0.0.1:{dead}/notadb"),  # malformed database number
        ("stats", "gopher://x"),  # unknown scheme
    ],
)
def test_cli_store_errors_are_one_line(capsys, action, url):
    url = url.format(dead=_dead_port())
    assert main(["store", action, "--store", url]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridkv: error:"), captured.err
    assert "Traceback" not in captured.err


# ---------------------------------------------------------------------------------------------
# A capacity's rule in the store is the simulator's (hybridkv.store.policy.PolicyStore).


class _RuleOracle:
    """What a store of `capacity` under `rule` must keep, in PolicyStore's own bookkeeping: one step
    of LRU's clock per operation, a write of a held key counted as a use of it, and an entry whose
    parent is not held refused."""

    def __init__(self, capacity: int, rule: str) -> None:
        self.policy = PolicyStore(capacity, rule)

    def get_many(self, keys: list[str]) -> None:
        self.policy.now += 1
        self.policy.use_all([key for key in keys if key in self.policy])

    def put(self, key: str, nbytes: int, worth: Worth) -> bool:
        self.policy.now += 1
        if key in self.policy:  # the test writes a held key again with the same bytes
            self.policy.use(key)
            return True
        if worth.parent is not None and worth.parent not in self.policy:
            return False
        return self.policy.put(key, worth.kind, nbytes, worth.saved, worth.parent, rank=key)


@pytest.fixture(params=["memory", "redis"])
def ruled_store(request):
    """open(rule) -> a store of 30,000 bytes kept by `rule`, in process or on the session's redis."""
    opened = []

    def open_ruled(rule: str):
        if request.param == "memory":
            url = f"memory://?capacity=30000&policy={rule}"
        else:
            url = f"{request.getfixturevalue('redis_server').url}/3?capacity=30000&policy={rule}"
            _wipe(url)
        opened.append(open_store(url))
        return opened[-1]

    yield open_ruled
    for store in opened:
        store.clear()
        store.close()


@pytest.mark.parametrize("rule", ["lru", "value"])
def test_a_capacity_keeps_exactly_what_the_simulators_rule_keeps(ruled_store, rule):
    """Prefix trees of KV blocks and states, written and read at random: after every operation the
    store holds exactly the keys the simulator's PolicyStore holds, refuses what it refuses, and
    every kept entry reads back whole; no kept entry's parent is missing."""
    rng = random.Random(11 if rule == "lru" else 12)
    store, oracle = ruled_store(rule), _RuleOracle(30000, rule)
    written: dict[str, tuple[bytes, Worth]] = {}
    for step in range(400):
        if written and rng.random() < 0.35:
            keys = rng.sample(sorted(written), min(len(written), rng.randrange(1, 5)))
            found = store.get_many(keys)
            assert [data is not None for data in found] == [key in oracle.policy for key in keys], step
            oracle.get_many(keys)
            continue
        if written and rng.random() < 0.1:  # a prompt written again
            key = rng.choice(sorted(written))
            data, worth = written[key]
        else:
            key = hex_key(f"entry-{step}")
            parents = [k for k, (_, w) in written.items() if w.kind == "kv-block"]
            parent = rng.choice(parents) if parents and rng.random() < 0.7 else None
            kind = "state" if parent is not None and rng.random() < 0.25 else "kv-block"
            data = os.urandom(rng.randrange(400, 3000) if kind == "kv-block" else rng.randrange(4000, 9000))
            worth = Worth(kind, float(rng.randrange(1, 10**6)) * (1 + rng.random()), parent)
            written[key] = (data, worth)
        assert store.put(key, data, worth) == oracle.put(key, len(data), worth), step
        assert store.stats()["entries"] == len(oracle.policy.entries), step
    held = oracle.policy.entries
    assert 0 < len(held) < len(written)  # the capacity was reached and the rule chose
    assert oracle.policy.evicted > 20 and (rule == "lru" or oracle.policy.refused > 0)
    for key, (data, worth) in written.items():
        assert (store.get_many([key])[0] == data) if key in held else store.get_many([key])[0] is None
        assert key not in held or worth.parent is None or worth.parent in held
    assert sum(store.stats()["evicted"].values()) == oracle.policy.evicted


def test_writers_that_disagree_on_a_databases_rule_are_refused_in_one_line(redis_server):
    base = f"{redis_server.url}/4"
    _wipe(base)
    first = open_store(f"{base}?capacity=30000&policy=value")
    assert first.put(hex_key("a"), b"x" * 100, Worth("kv-block", 5.0))
    for other in (f"{base}?capacity=30000", f"{base}?capacity=20000&policy=value"):
        with pytest.raises(StoreError, match="another writer keeps this database as value capacity=30000") as err:
            open_store(other).put(hex_key("b"), b"y" * 100)
        assert not err.value.unavailable and "\n" not in str(err.value)
    assert first.get(hex_key("a")) == b"x" * 100 and first.get(hex_key("b")) is None
    _wipe(base)


@pytest.mark.parametrize(
    "url, message",
    [
        ("file:///tmp/x?capacity=100&policy=value", "keeps its capacity by LRU only"),
        ("memory://?policy=fifo", "unknown policy 'fifo'"),
        ("redis://127.0.0.1:1?policy=value", "policy=value needs a capacity"),
        ("redis://127.0.0.1:1?capacity=100&ttl=0", "ttl must be a positive whole number"),
        ("lmcache://cpu?capacity=100", "kept by LMCache's own eviction"),
    ],
)
def test_a_capacity_rule_the_store_cannot_keep_is_refused_in_one_line(url, message):
    with pytest.raises(HybridKVError, match=message):
        open_store(url)
