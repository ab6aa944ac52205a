"""One fingerprint recipe (hybridkv.cache.keys.fingerprint) for every cached thing, and the vLLM
connector's names for models: a local directory by its files, a model vLLM fetched by name by the
files and commit of the Hugging Face snapshot it resolved, in a real hub cache layout on disk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv.cache.keys import (
    _canonical_config,
    _sha,
    _tensor_digest,
    checkpoint_digest,
    checkpoint_fingerprint,
    family_fingerprint,
    model_fingerprint,
)
from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.block_store import BlockStore, engine_fingerprint
from hybridkv.store.guarded import GuardedStore
from hybridkv.store.memory import MemoryStore

REPO = "tiny-org/tiny-hybrid"
LAYOUT = [("FullAttentionSpec", 16, 64, ["model.layers.3.self_attn.attn"])]
DTYPE = "torch.bfloat16"
MAIN, V2 = "1" * 40, "2" * 40  # commits
WEIGHTS = bytes(range(256)) * 64
CONFIG = json.dumps({"model_type": "qwen3_next", "hidden_size": 64}).encode()


def hub_snapshot_on_disk(cache: Path, commit: str, weights: bytes = WEIGHTS, ref: str | None = "main") -> Path:
    """One snapshot of REPO in a hub cache as huggingface_hub writes it: the files in blobs/ named by
    their hash, linked from snapshots/<commit>/, and refs/<ref> holding the commit."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in (("config.json", CONFIG), ("model.safetensors", weights)):
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def fetched(cache: Path, revision: str | None = None) -> str:
    return engine_fingerprint(REPO, LAYOUT, DTYPE, revision, str(cache))


def test_a_fetched_name_is_the_fingerprint_of_its_snapshots_files_and_commit(tmp_path):
    snapshot = hub_snapshot_on_disk(tmp_path / "hub", MAIN)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in snapshot.iterdir():
        shutil.copyfile(path, copy / path.name)
    context = (b"vllm-pages", json.dumps(LAYOUT).encode())
    by_name = fetched(tmp_path / "hub")
    assert by_name == fetched(tmp_path / "hub", "main") == fetched(tmp_path / "hub", MAIN)
    assert by_name == checkpoint_fingerprint(copy, *context, b"commit:" + MAIN.encode(), dtype=DTYPE)
    # The same files as a local directory: named by the files alone, the same whichever directory.
    local = engine_fingerprint(str(copy), LAYOUT, DTYPE)
    assert (
        local == engine_fingerprint(str(snapshot), LAYOUT, DTYPE) == checkpoint_fingerprint(copy, *context, dtype=DTYPE)
    )
    assert by_name != local
    # The layout and the dtype are bound too.
    assert engine_fingerprint(REPO, LAYOUT * 2, DTYPE, None, str(tmp_path / "hub")) != by_name
    assert engine_fingerprint(REPO, LAYOUT, "torch.float16", None, str(tmp_path / "hub")) != by_name


def test_two_revisions_of_one_repository_have_different_fingerprints(tmp_path):
    cache = tmp_path / "hub"
    hub_snapshot_on_disk(cache, MAIN)
    hub_snapshot_on_disk(cache, V2, weights=WEIGHTS[::-1], ref="v2")
    main, v2 = fetched(cache), fetched(cache, "v2")
    assert main != v2 and fetched(cache, V2) == v2
    # Even two commits holding the same files are two names: the revision is part of it.
    same_files = tmp_path / "same"
    hub_snapshot_on_disk(same_files, MAIN)
    hub_snapshot_on_disk(same_files, V2, ref="v2")
    assert fetched(same_files) == main != fetched(same_files, "v2")


def test_one_changed_weight_byte_changes_the_fingerprint(tmp_path):
    changed = bytearray(WEIGHTS)
    changed[len(changed) // 2] ^= 1
    hub_snapshot_on_disk(tmp_path / "a", MAIN)
    hub_snapshot_on_disk(tmp_path / "b", MAIN, weights=bytes(changed))
    assert fetched(tmp_path / "a") != fetched(tmp_path / "b")


@pytest.mark.parametrize(
    "name, revision",
    [(REPO, None), (REPO, "v3"), ("nobody/nothing", None), ("/no/such/checkpoint", None)],
)
def test_a_name_not_in_the_hub_cache_is_refused_in_one_line(tmp_path, name, revision):
    hub_snapshot_on_disk(tmp_path / "hub", MAIN, ref=None if name == REPO and revision is None else "main")
    with pytest.raises(HybridKVError) as refused:
        engine_fingerprint(name, LAYOUT, DTYPE, revision, str(tmp_path / "hub"))
    message = str(refused.value)
    assert "\n" not in message
    assert f"cannot name the model {name!r} (revision {revision or 'main'})" in message
    assert message.endswith("pass the checkpoint's local directory as the model")


def test_without_a_download_dir_the_hubs_own_cache_is_read(tmp_path):
    """vLLM without --download-dir fetches into the hub's cache (HF_HUB_CACHE), and so is it found."""
    hub_snapshot_on_disk(tmp_path / "hub", MAIN)
    script = (
        "import json, sys; from hybridkv.integrations.vllm.block_store import engine_fingerprint; "
        "print(engine_fingerprint(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script, REPO, json.dumps(LAYOUT), DTYPE],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == fetched(tmp_path / "hub")


def old_engine_fingerprint(model: str, layout: list, dtype: str) -> str:
    """The connector's recipe before the one recipe, as it was: a checkpoint's config and weight
    digests under a tag of their own; a fetched model by its name alone."""
    context = json.dumps([layout, dtype], sort_keys=True).encode()
    path = Path(model)
    if path.is_dir():
        config = (path / "config.json").read_bytes()
        return _sha(b"hybridkv-checkpoint", config, checkpoint_digest(path), b"vllm-pages", context).hex()
    return hashlib.sha256(context + model.encode()).hexdigest()


def test_pages_keyed_by_the_old_recipe_are_not_read(tmp_path):
    snapshot = hub_snapshot_on_disk(tmp_path / "hub", MAIN)
    store = GuardedStore(MemoryStore())
    tokens = list(range(3, 3 + 40))
    pages = [{"attn": torch.full((64,), i, dtype=torch.uint8)} for i in range(3)]
    layout = {"attn": 64}
    for model, new in (
        (str(snapshot), engine_fingerprint(str(snapshot), LAYOUT, DTYPE)),
        (REPO, fetched(tmp_path / "hub")),
    ):
        old = BlockStore(store, old_engine_fingerprint(model, LAYOUT, DTYPE), 16)
        assert old.save_blocks(tokens, 0, pages) == 3
        assert old.match(tokens, layout).length == 39  # what an engine of the old recipe found
        assert BlockStore(store, new, 16).match(tokens, layout).length == 0


def test_model_fingerprint_is_the_one_recipe_as_stored_entries_were_keyed(models):
    """A loaded model's fingerprint is the bytes it always was (stored prefixes, chunks and arena
    captures stay readable): SHA-256 over the length-prefixed parts, spelled out here."""
    model = models["random-qwen3-next"]
    parts = [b"hybridkv-model", model.config.model_type.encode(), _canonical_config(model)]
    parts += [_tensor_digest(model), str(model.dtype).encode()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    assert model_fingerprint(model) == digest.hexdigest()
    # A family leaves the weights out by name only: never a model's own fingerprint.
    assert family_fingerprint(model, "qwen") not in (model_fingerprint(model), family_fingerprint(model, "other"))
