"""lmcache:// — hybridkv entries through LMCache 0.5.6's real storage backends and servers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridkv.cache import PrefixCache, capture_prompt
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.methods import METHODS, Budget, execute
from hybridkv.store import GuardedStore, StoreError, open_store
from tests.helpers import free_port


class LMCacheServer:
    """LMCache's own server (`lmcache_server HOST PORT cpu`) on a free loopback port."""

    def __init__(self) -> None:
        binary = Path(sys.executable).with_name("lmcache_server")
        if not binary.exists():
            raise RuntimeError("lmcache_server is missing: install hybridkv[lmcache] (scripts/setup.sh --test does)")
        self.port = free_port()
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "ERROR"}
        self.process = subprocess.Popen(
            [str(binary), "127.0.0.1", str(self.port), "cpu"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("lmcache_server did not start") from None
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"lmcache://lm://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def lm_server():
    server = LMCacheServer()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def lmcache_urls(lm_server, redis_server, tmp_path_factory):
    fs_dir = tmp_path_factory.mktemp("lmcache-fs")
    return {
        "cpu": "lmcache://cpu?pool_gib=0.1",
        "fs": f"lmcache://fs://localhost:0{fs_dir}",
        "lm": lm_server.url,
        "valkey": f"lmcache://valkey://127.0.0.1:{redis_server.port}",
    }


@pytest.mark.parametrize("inner", ["cpu", "fs", "lm", "valkey"])
def test_round_trip_through_every_lmcache_backend(lmcache_urls, inner):
    store = open_store(lmcache_urls[inner])
    try:
        payloads = {os.urandom(32).hex(): os.urandom(size) for size in (1, 1000, 1 << 20, 5 << 20)}
        for key, data in payloads.items():
            store.put(key, data)
        for key, data in payloads.items():
            assert store.get(key) == data
        assert store.get(os.urandom(32).hex()) is None
        assert all(store.contains(key) for key in payloads) and not store.contains(os.urandom(32).hex())
        key = next(iter(payloads))
        store.put(key, b"replaced")
        assert store.get(key) == b"replaced"
        if inner != "lm":  # LMCache's lm:// protocol has no delete
            store.delete(key)
            assert store.get(key) is None
    finally:
        store.close()


SHARE_SCRIPT = """
import sys, os
from hybridkv.store import open_store
store = open_store(sys.argv[1])
if sys.argv[2] == "put":
    store.put(sys.argv[3], bytes.fromhex(sys.argv[4]))
else:
    data = store.get(sys.argv[3])
    print("MISS" if data is None else data.hex())
store.close()
"""


@pytest.mark.parametrize("inner", ["fs", "lm", "valkey"])
def test_two_processes_share_entries(lmcache_urls, inner):
    url, key, data = lmcache_urls[inner], os.urandom(32).hex(), os.urandom(4096)
    run = [sys.executable, "-c", SHARE_SCRIPT, url]
    subprocess.run([*run, "put", key, data.hex()], check=True, timeout=120)
    got = subprocess.run([*run, "get", key], check=True, timeout=120, capture_output=True, text=True).stdout.strip()
    assert got == data.hex()


@pytest.mark.parametrize("inner", ["cpu", "fs", "valkey"])
def test_stored_prefix_hit_through_lmcache_equals_the_in_memory_hit(models, make_workload, lmcache_urls, inner):
    model = models["random-olmo-hybrid"]
    cached_tokens, prompt = make_workload(matched=150, prompt_len=170, cached_len=190, seed=7)
    cached = capture_prompt(model, cached_tokens, checkpoint_interval=64)
    memory = PrefixCache()
    memory.add(cached)
    expected = memory.lookup(prompt)
    store = GuardedStore(open_store(lmcache_urls[inner]))
    try:
        stored = StoredPrefixCache(model, store, salt=f"test-{inner}", checkpoint_interval=64)
        assert stored.add(cached) == 3 + 2  # three 64-token KV chunks, checkpoints at 64 and 128
        hit = stored.lookup(prompt)
        assert hit is not None and hit.length == expected.length == 150
        for method in METHODS.values():
            budget = Budget(0.1) if method.uses_budget else None
            ours = execute(model, prompt, hit, method.recipe(hit, budget), logits_to_keep=20).logits
            reference = execute(model, prompt, expected, method.recipe(expected, budget), logits_to_keep=20).logits
            assert torch.equal(ours, reference), method.name
        assert store.counts["corrupt"] == 0
    finally:
        store.inner.close()


def test_killed_lmcache_server_degrades_to_recomputation(models, make_workload):
    """LMCache's lm:// server dies after the prompt was cached: no exception, a miss, correct outputs."""
    server = LMCacheServer()
    model = models["random-qwen3-next"]
    cached_tokens, prompt = make_workload(matched=100, prompt_len=120, cached_len=130, seed=3)
    cached = capture_prompt(model, cached_tokens)
    store = GuardedStore(open_store(server.url), retry_after_s=0.0)
    try:
        stored = StoredPrefixCache(model, store)
        assert stored.add(cached) == 3
        server.kill()
        hit = stored.lookup(prompt)
        assert hit is None  # nothing readable: every method recomputes
        assert store.put("ab" * 32, b"x") is False
        assert store.counts["get_errors"] + store.counts["misses"] >= 1
        assert store.counts["put_errors"] >= 1
        full = execute(model, prompt, None, METHODS["full"].recipe(None, None), logits_to_keep=5).logits
        reference = model.forward(prompt, model.new_cache(), 0, 5)
        assert torch.allclose(full, reference, atol=1e-5)
    finally:
        server.kill()
        store.inner.close()


def test_lmcache_url_errors_are_one_line():
    from hybridkv.errors import HybridKVError

    with pytest.raises(HybridKVError, match="inner URL"):
        open_store("lmcache://ftp://x")
    with pytest.raises(HybridKVError, match="must be numbers"):
        open_store("lmcache://cpu?pool_gib=lots")
    with pytest.raises(StoreError, match="cannot connect"):
        open_store(f"lmcache://lm://127.0.0.1:{free_port()}")


def test_lmcache_server_binary_is_installed():
    """CI must exercise the real LMCache path, not skip it."""
    assert Path(sys.executable).with_name("lmcache_server").exists() or shutil.which("lmcache_server")
