"""Fault campaign: inject store faults at random and count wrong answers (a benchmark, not a test).

For each trial a cached prompt is written through a real store under a fresh tenant salt, one
fault is injected into what the store holds (a flipped byte, a truncation, random garbage, a
deleted entry, an entry copied in from another tenant, or the server killed), and the new
prompt is looked up and answered by every exact method. A *wrong hit* is a hit whose tokens or
attention KV differ from the true cached prompt's; a *wrong output* is an exact method whose
logits differ from full prefill. Both must be zero: a fault may only cost reuse.

    .venv/bin/python benchmarks/fault_campaign.py --trials 300 --out out/faults
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from hybridkv.cache import capture_prompt
from hybridkv.cache.keys import model_fingerprint, state_key, variant_slot_key
from hybridkv.cache.stored import StoredPrefixCache
from hybridkv.methods import METHODS, Budget, execute
from hybridkv.models import load_model
from hybridkv.store import GuardedStore, open_store

FAULTS = ["none", "flip", "truncate", "garbage", "delete", "foreign", "kill"]
EXACT = [("full", None), ("checkpoint", None), ("tail-replay", Budget(1.0)), ("seeded-replay", Budget(1.0))]


def start_redis() -> tuple[subprocess.Popen, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def entry_keys(stored: StoredPrefixCache, tokens: torch.Tensor, checkpoints) -> list[str]:
    """Every entry the cached prompt wrote: its KV blocks, the slots listing them, its checkpoints."""
    chain = stored.keys.chain(tokens)
    starts = range(0, len(tokens), stored.keys.block_tokens)
    kv = [stored.block_key(tokens, i) for i in range(len(starts))]
    slots = [variant_slot_key(chain[i], int(tokens[start])) for i, start in enumerate(starts)]
    return kv + slots + [state_key(stored.keys.prefix(tokens, p, chain)) for p in checkpoints]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen3-next")
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--matched", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/faults"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    model = load_model(args.model)
    fingerprint = model_fingerprint(model)
    generator = torch.Generator().manual_seed(args.seed)
    shared = torch.randint(3, 512, (args.matched,), generator=generator)
    cached_tokens = torch.cat([shared, torch.randint(3, 512, (40,), generator=generator)])
    prompt = torch.cat([shared, torch.randint(3, 512, (24,), generator=generator)])
    prompt[args.matched] = (int(cached_tokens[args.matched]) - 3 + 1) % 509 + 3
    cached = capture_prompt(model, cached_tokens, checkpoint_interval=64)
    reference = model.forward(prompt, model.new_cache(), 0, logits_to_keep=24)

    redis_process, port = start_redis()
    file_dir = Path(tempfile.mkdtemp(prefix="hkv-faults-"))
    backends = {"redis": f"redis://127.0.0.1:{port}", "file": f"file://{file_dir}"}
    tally: Counter[str] = Counter()
    per_fault: dict[str, Counter] = {fault: Counter() for fault in FAULTS}
    try:
        for trial in tqdm(range(args.trials), desc="fault campaign"):
            backend = rng.choice(list(backends))
            fault = rng.choice(FAULTS if backend == "redis" else [f for f in FAULTS if f != "kill"])
            store = GuardedStore(open_store(backends[backend]), retry_after_s=0.0)
            stored = StoredPrefixCache(model, store, f"trial-{trial}", checkpoint_interval=64, fingerprint=fingerprint)
            stored.add(cached)
            keys = entry_keys(stored, cached.tokens, cached.checkpoints)
            target = rng.choice(keys)
            raw = store.inner.get(target)
            if fault == "flip":
                position = rng.randrange(len(raw))
                store.inner.put(
                    target, raw[:position] + bytes([raw[position] ^ rng.randrange(1, 256)]) + raw[position + 1 :]
                )
            elif fault == "truncate":
                store.inner.put(target, raw[: rng.randrange(len(raw))])
            elif fault == "garbage":
                store.inner.put(target, os.urandom(rng.randrange(1, 2 * len(raw))))
            elif fault == "delete":
                store.inner.delete(target)
            elif fault == "foreign":  # the same entry as written for another tenant, copied under this key
                other = StoredPrefixCache(
                    model, store, f"other-{trial}", checkpoint_interval=64, fingerprint=fingerprint
                )
                other.add(cached)
                index = keys.index(target)
                store.inner.put(target, store.inner.get(entry_keys(other, cached.tokens, cached.checkpoints)[index]))
            elif fault == "kill":
                redis_process.kill()
                redis_process.wait()
            hit = stored.lookup(prompt)
            if fault == "kill":
                redis_process, port = start_redis()
                backends["redis"] = f"redis://127.0.0.1:{port}"
            length = hit.length if hit is not None else 0
            wrong_hit = hit is not None and (
                not torch.equal(hit.cached.tokens[:length], cached.tokens[:length])
                or any(
                    not torch.equal(hit.cached.kv_prefix(length)[layer][name], tensor)
                    for layer, tensors in cached.kv_prefix(length).items()
                    for name, tensor in tensors.items()
                )
            )
            wrong_outputs = 0
            for name, budget in EXACT:
                method = METHODS[name]
                recipe = method.recipe(hit, budget) if hit is not None else METHODS["full"].recipe(None, None)
                logits = execute(model, prompt, hit, recipe, logits_to_keep=24).logits
                wrong_outputs += not torch.allclose(logits, reference, atol=1e-4)
            counts = per_fault[fault]
            counts["trials"] += 1
            counts["full_hits"] += length == args.matched
            counts["shortened_or_missed"] += length < args.matched
            counts["detected_corrupt"] += store.counts["corrupt"]
            counts["store_errors"] += store.counts["get_errors"] + store.counts["put_errors"]
            counts["wrong_hits"] += wrong_hit
            counts["wrong_outputs"] += wrong_outputs
            tally["faults_injected"] += fault != "none"
            tally["wrong_hits"] += wrong_hit
            tally["wrong_outputs"] += wrong_outputs
            tally["exact_answers_checked"] += len(EXACT)
            store.inner.close()
    finally:
        redis_process.kill()
        shutil.rmtree(file_dir, ignore_errors=True)
    header = ["fault", "trials", "full_hits", "shortened_or_missed", "detected_corrupt", "store_errors", "wrong_hits",
              "wrong_outputs"]  # fmt: skip
    print("  ".join(f"{h:>19}" for h in header))
    for fault, counts in per_fault.items():
        print("  ".join([f"{fault:>19}", *(f"{counts[h]:>19}" for h in header[1:])]))
    print(dict(tally))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fault_campaign.json").write_text(
        json.dumps(
            {
                "model": args.model,
                "trials": args.trials,
                "totals": dict(tally),
                "per_fault": {f: dict(c) for f, c in per_fault.items()},
            },
            indent=2,
        )
        + "\n"  # fmt: skip
    )


if __name__ == "__main__":
    main()
