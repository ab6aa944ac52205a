"""Store throughput and latency for entry sizes GLM-5.3-Flash really produces (a benchmark, not a test).

Entry sizes come from GLM-5.3-Flash's config (`hybridkv.models.arch.glm5_next`): a 256-token block of
attention KV across its 11 MLA/DSA layers, one KDA layer's state, and one whole state
checkpoint (all 34 KDA layers). Each backend does `repeats` puts then `repeats` gets of distinct
random payloads, one request at a time; the hybridkv codec (header + SHA-256) is timed apart, and
for redis/valkey URLs `redis-benchmark` runs the same sizes against the same server, so the
client's overhead can be read off side by side.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from hybridkv.models.arch import glm5_next
from hybridkv.store import open_store
from hybridkv.store.codec import Entry, decode, encode


@dataclass(frozen=True)
class EntrySize:
    name: str
    nbytes: int
    repeats: int


def glm5_entry_sizes(repeats: int) -> list[EntrySize]:
    sizes = glm5_next.cache_sizes()
    return [
        EntrySize("kv-chunk-256tok", 256 * sizes.kv_bytes_per_token, repeats),
        EntrySize("kda-state-1-layer", sizes.state_bytes_per_layer, repeats),
        EntrySize("kda-checkpoint-34-layers", sizes.state_bytes_per_checkpoint, max(3, repeats // 5)),
    ]


def _summary(times: list[float], nbytes: int) -> dict:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "median_ms": statistics.median(times) * 1e3,
        "p95_ms": p95 * 1e3,
        "MBps": nbytes * len(times) / sum(times) / 1e6,
    }


def bench_backend(url: str, size: EntrySize) -> dict:
    store = open_store(url)
    keys = [os.urandom(32).hex() for _ in range(size.repeats)]
    payload = os.urandom(size.nbytes)
    put_times, get_times = [], []
    try:
        for key in keys:
            start = time.perf_counter()
            store.put(key, payload)
            put_times.append(time.perf_counter() - start)
        for key in keys:
            start = time.perf_counter()
            data = store.get(key)
            get_times.append(time.perf_counter() - start)
            if data != payload:
                raise RuntimeError(f"{url}: a benchmark entry did not round-trip")
        for key in keys:
            store.delete(key)
    finally:
        store.close()
    put, get = _summary(put_times, size.nbytes), _summary(get_times, size.nbytes)
    return {"backend": url, "client": "hybridkv", "entry": size.name, "bytes": size.nbytes, "ops": size.repeats,
            **{f"put_{k}": v for k, v in put.items()}, **{f"get_{k}": v for k, v in get.items()}}  # fmt: skip


def bench_codec(size: EntrySize) -> dict:
    tensor = torch.randint(0, 255, (size.nbytes,), dtype=torch.uint8)
    entry = Entry("kv", "00" * 32, "ab" * 32, {}, {"payload": tensor})
    encode_times, decode_times = [], []
    for _ in range(size.repeats):
        start = time.perf_counter()
        data = encode(entry)
        encode_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        decode(data, key=entry.key, fingerprint=entry.fingerprint)
        decode_times.append(time.perf_counter() - start)
    put, get = _summary(encode_times, size.nbytes), _summary(decode_times, size.nbytes)
    return {"backend": "codec (encode / decode + sha256)", "client": "hybridkv", "entry": size.name,
            "bytes": size.nbytes, "ops": size.repeats,
            **{f"put_{k}": v for k, v in put.items()}, **{f"get_{k}": v for k, v in get.items()}}  # fmt: skip


def bench_redis_benchmark(url: str, size: EntrySize) -> dict | None:
    """redis-benchmark's own SET/GET on the same server, one client, no pipelining."""
    binary = shutil.which("redis-benchmark")
    parsed = urlparse(url)
    if binary is None or parsed.scheme not in ("redis", "valkey"):
        return None
    command = [binary, "-h", parsed.hostname or "127.0.0.1", "-p", str(parsed.port or 6379), "-t", "set,get",
               "-n", str(size.repeats), "-d", str(size.nbytes), "-c", "1", "-P", "1", "--csv"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return None
    rows = {row["test"]: row for row in csv.DictReader(io.StringIO(done.stdout))}
    if "SET" not in rows or "GET" not in rows:
        return None

    def cols(prefix: str, row: dict) -> dict:
        rps = float(row["rps"])
        return {f"{prefix}_median_ms": float(row["p50_latency_ms"]), f"{prefix}_p95_ms": float(row["p95_latency_ms"]),
                f"{prefix}_MBps": rps * size.nbytes / 1e6}  # fmt: skip

    return {"backend": url, "client": "redis-benchmark", "entry": size.name, "bytes": size.nbytes,
            "ops": size.repeats, **cols("put", rows["SET"]), **cols("get", rows["GET"])}  # fmt: skip


def run_store_bench(urls: list[str], sizes: list[EntrySize], progress=None) -> list[dict]:
    rows = []
    for size in sizes:
        rows.append(bench_codec(size))
        if progress is not None:
            progress.update()
        for url in urls:
            rows.append(bench_backend(url, size))
            reference = bench_redis_benchmark(url, size)
            if reference is not None:
                rows.append(reference)
            if progress is not None:
                progress.update()
    return rows


def format_bench_table(rows: list[dict]) -> str:
    header = ["entry", "MiB", "backend", "client", "put p50 ms", "put p95 ms", "put MB/s", "get p50 ms", "get p95 ms",
              "get MB/s"]  # fmt: skip
    body = [
        [
            row["entry"],
            f"{row['bytes'] / 2**20:.2f}",
            row["backend"],
            row["client"],
            f"{row['put_median_ms']:.2f}",
            f"{row['put_p95_ms']:.2f}",
            f"{row['put_MBps']:.0f}",
            f"{row['get_median_ms']:.2f}",
            f"{row['get_p95_ms']:.2f}",
            f"{row['get_MBps']:.0f}",
        ]  # fmt: skip
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in [header, *body]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
