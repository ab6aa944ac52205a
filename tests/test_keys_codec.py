"""Store entry serialisation (hybridkv.store.codec) and cache keys (hybridkv.cache.keys).

Codec: every entry round-trips bit for bit, and every damaged, truncated, extended or
misplaced entry is refused with CorruptEntry (never decoded, never another exception).
Keys: functions of exactly what they claim to commit to — the prefix's tokens, the salt, the
model fingerprint, the chunk size — and the same in every process, whatever PYTHONHASHSEED.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hybridkv.cache.keys import PrefixKeys, model_fingerprint, state_key, variant_slot_key
from hybridkv.models import load_model
from hybridkv.store.codec import _PREFIX, MAGIC, VERSION, CorruptEntry, Entry, decode, encode

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
HEX = "0123456789abcdef"

# ---------------------------------------------------------------------------------------------
# Strategies.


@st.composite
def tensors(draw, views: bool = False) -> torch.Tensor:
    """A tensor of any storable dtype with arbitrary bit patterns (NaNs, infs, denormals too).

    Shapes have 1–4 dims, zero-size dims included. With `views`, also 0-d tensors and
    non-contiguous views (transposed, narrowed, strided) of any shape, as a caller may hand over.
    """
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0 if views else 1, max_size=4))
    layout = draw(st.sampled_from(["contiguous", "transposed", "narrowed", "strided"])) if views else "contiguous"
    if layout in ("narrowed", "strided") and shape:
        shape = [*shape[:-1], shape[-1] * 2 + 2]
    numel = int(np.prod(shape)) if shape else 1
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(dtype).reshape(shape)
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, -1)
    elif layout == "narrowed" and shape:
        tensor = tensor.narrow(-1, 1, (shape[-1] - 2) // 2)
    elif layout == "strided" and shape:
        tensor = tensor[..., ::2]
    return tensor


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
metas = st.dictionaries(st.text(max_size=10), json_values, max_size=5)
fingerprints = st.text(HEX, min_size=2, max_size=64).filter(lambda s: len(s) % 2 == 0)


@st.composite
def entries(draw, views: bool = False) -> Entry:
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=5, unique=True))
    return Entry(
        kind=draw(st.sampled_from(["kv", "state", "other"])),
        fingerprint=draw(fingerprints),
        key=draw(st.text(min_size=1, max_size=70)),
        meta=draw(metas),
        tensors={name: draw(tensors(views)) for name in names},
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    # A fresh tensor with standard strides (`.contiguous()` keeps odd strides of size-1 dims).
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bits(a), _bits(b))


# ---------------------------------------------------------------------------------------------
# Codec: round trip.


@SETTINGS
@given(entries())
def test_codec_round_trip_is_bitwise(entry):
    data = encode(entry)
    assert isinstance(data, bytes)
    back = decode(data, key=entry.key, fingerprint=entry.fingerprint)
    assert (back.kind, back.fingerprint, back.key) == (entry.kind, entry.fingerprint, entry.key)
    assert back.meta == entry.meta
    assert list(back.tensors) == list(entry.tensors)
    for name, tensor in entry.tensors.items():
        assert same_bits(back.tensors[name], tensor), name
    # Encoding is a function of the entry: the same entry always gives the same bytes.
    assert encode(entry) == data
    # A decoded entry re-encodes to the very same bytes.
    assert encode(back) == data


@SETTINGS
@given(entries(views=True))
def test_codec_round_trip_of_any_view_is_bitwise(entry):
    """Non-contiguous views and 0-d tensors are encoded by value, like contiguous ones."""
    back = decode(encode(entry), key=entry.key, fingerprint=entry.fingerprint)
    for name, tensor in entry.tensors.items():
        assert same_bits(back.tensors[name], tensor), name


def test_decoded_tensors_are_independent_of_the_bytes():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    data = bytearray(encode(Entry("kv", "ab", "k", {}, {"t": tensor})))
    back = decode(bytes(data), key="k", fingerprint="ab").tensors["t"]
    back += 1  # writable, and writing to it changes nothing stored
    assert torch.equal(decode(bytes(data), key="k", fingerprint="ab").tensors["t"], tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(torch.tensor(1.5), id="0-d float32"),
        pytest.param(torch.tensor(7), id="0-d int64"),
        pytest.param(torch.arange(4.0).reshape(1, 4).t(), id="transposed row vector"),
        pytest.param(torch.empty(0, 2).transpose(0, 1), id="empty transposed"),
        pytest.param(torch.empty(3, 4, dtype=torch.bfloat16)[:, ::2][:0], id="empty strided slice"),
    ],
)
def test_codec_round_trips_scalars_and_empty_views(tensor):
    """Layouts that `.contiguous()` leaves alone but that cannot be viewed as bytes (0-d tensors,
    size-1 or empty dims with odd strides) are tensors like any other: dtype and shape go in the
    header and the values come back as they went in."""
    entry = Entry("state", "ab", "k", {}, {"t": tensor})
    back = decode(encode(entry), key="k", fingerprint="ab")
    assert same_bits(back.tensors["t"], tensor)


def test_unstorable_dtype_is_refused_at_encode():
    with pytest.raises(ValueError):
        encode(Entry("kv", "ab", "k", {}, {"t": torch.zeros(2, dtype=torch.complex64)}))


# ---------------------------------------------------------------------------------------------
# Codec: damage is always detected.


@SETTINGS
@given(entries(), st.data())
def test_any_flipped_byte_is_corrupt(entry, data):
    encoded = encode(entry)
    index = data.draw(st.integers(0, len(encoded) - 1), label="index")
    mask = data.draw(st.integers(1, 255), label="mask")
    damaged = bytearray(encoded)
    damaged[index] ^= mask
    with pytest.raises(CorruptEntry):
        decode(bytes(damaged), key=entry.key, fingerprint=entry.fingerprint)


@SETTINGS
@given(entries(), st.data())
def test_any_truncation_is_corrupt(entry, data):
    encoded = encode(entry)
    length = data.draw(st.integers(0, len(encoded) - 1), label="length")
    with pytest.raises(CorruptEntry):
        decode(encoded[:length], key=entry.key, fingerprint=entry.fingerprint)


@SETTINGS
@given(entries(), st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_corrupt(entry, tail):
    with pytest.raises(CorruptEntry):
        decode(encode(entry) + tail, key=entry.key, fingerprint=entry.fingerprint)


@SETTINGS
@given(entries(), st.text(min_size=1, max_size=70), fingerprints)
def test_entry_under_another_key_or_model_is_corrupt(entry, other_key, other_fingerprint):
    encoded = encode(entry)
    if other_key != entry.key:
        with pytest.raises(CorruptEntry):
            decode(encoded, key=other_key, fingerprint=entry.fingerprint)
    if other_fingerprint != entry.fingerprint:
        with pytest.raises(CorruptEntry):
            decode(encoded, key=entry.key, fingerprint=other_fingerprint)


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_corrupt(data):
    with pytest.raises(CorruptEntry):
        decode(data, key="k", fingerprint="ab")


def _checksummed(header: bytes, payload: bytes = b"") -> bytes:
    body = _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload
    return body + hashlib.sha256(body).digest()


@SETTINGS
@given(json_values, st.binary(max_size=16))
@example(header=[], payload=b"")
@example(header="kv", payload=b"")
def test_well_checksummed_garbage_header_is_corrupt_not_a_crash(header, payload):
    """Whatever JSON the header holds, decode returns an Entry or raises CorruptEntry — nothing else.

    StoredPrefixCache catches CorruptEntry only; any other exception would escape into the
    request path.
    """
    data = _checksummed(json.dumps(header).encode(), payload)
    with contextlib.suppress(CorruptEntry):
        decode(data, key="k", fingerprint="ab")


def test_header_with_wrong_tensor_specs_is_corrupt():
    good = {"kind": "kv", "fingerprint": "ab", "key": "k", "meta": {}}
    specs = [
        [{"name": "t", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 4}],  # shape needs 8 bytes
        [{"name": "t", "dtype": "float32", "shape": [1], "offset": 8, "nbytes": 4}],  # outside the payload
        [{"name": "t", "dtype": "complex64", "shape": [1], "offset": 0, "nbytes": 8}],  # unknown dtype
        [{"name": "t", "dtype": "float32", "shape": [1], "offset": -4, "nbytes": 4}],
        [{"name": "t", "shape": [1], "offset": 0, "nbytes": 4}],
    ]
    for spec in specs:
        with pytest.raises(CorruptEntry):
            decode(_checksummed(json.dumps({**good, "tensors": spec}).encode(), b"\0" * 8), key="k", fingerprint="ab")


# ---------------------------------------------------------------------------------------------
# Keys.

FP_A = hashlib.sha256(b"model a").hexdigest()
FP_B = hashlib.sha256(b"model b").hexdigest()
token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=80)
chunk_sizes = st.integers(1, 17)


@SETTINGS
@given(token_lists, chunk_sizes, st.text(max_size=5))
def test_chain_is_deterministic_and_has_one_key_per_full_chunk(tokens, size, salt):
    keys = PrefixKeys(FP_A, salt, size)
    chain = keys.chain(tokens)
    assert chain == PrefixKeys(FP_A, salt, size).chain(list(tokens))
    assert len(chain) == len(tokens) // size + 1
    assert chain[0] == keys.root
    assert len(set(chain)) == len(chain)
    # chain[i] commits to tokens[: i*size] only: the chain of a shorter list is a prefix of it.
    for cut in range(len(tokens) + 1):
        assert keys.chain(tokens[:cut]) == chain[: cut // size + 1]


@SETTINGS
@given(st.lists(st.integers(0, 511), min_size=1, max_size=60), chunk_sizes)
def test_keys_do_not_depend_on_the_token_container(tokens, size):
    keys = PrefixKeys(FP_A, "s", size)
    forms = [
        tokens,
        np.asarray(tokens, dtype=np.int64),
        np.asarray(tokens, dtype=np.int32),
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(tokens, dtype=torch.int32),
    ]
    chains = {tuple(keys.chain(form)) for form in forms}
    assert len(chains) == 1
    prefixes = {keys.prefix(form, len(tokens)) for form in forms}
    assert len(prefixes) == 1
    chunks = {keys.chunk(form) for form in forms}
    assert len(chunks) == 1


@SETTINGS
@given(token_lists, st.data(), chunk_sizes, token_lists)
def test_prefix_key_depends_only_on_the_prefix(tokens, data, size, tail):
    p = data.draw(st.integers(0, len(tokens)), label="p")
    keys = PrefixKeys(FP_A, "", size)
    key = keys.prefix(tokens, p)
    assert keys.prefix(tokens[:p], p) == key
    assert keys.prefix(tokens[:p] + tail, p) == key  # any tail
    assert keys.prefix(tokens, p, keys.chain(tokens)) == key  # with the chain precomputed
    assert keys.prefix(tokens, p, keys.chain(tokens[:p] + tail)) == key


@SETTINGS
@given(st.lists(st.integers(0, 511), min_size=1, max_size=60), st.data(), chunk_sizes)
def test_prefix_key_changes_with_any_token_salt_model_or_chunk_size(tokens, data, size):
    p = data.draw(st.integers(1, len(tokens)), label="p")
    i = data.draw(st.integers(0, p - 1), label="i")
    delta = data.draw(st.integers(1, 511), label="delta")
    keys = PrefixKeys(FP_A, "a", size)
    key = keys.prefix(tokens, p)
    changed = list(tokens)
    changed[i] = (changed[i] + delta) % 512
    assert keys.prefix(changed, p) != key
    assert PrefixKeys(FP_A, "b", size).prefix(tokens, p) != key
    assert PrefixKeys(FP_A, "", size).prefix(tokens, p) != key
    assert PrefixKeys(FP_B, "a", size).prefix(tokens, p) != key
    assert PrefixKeys(FP_A, "a", size + 1).prefix(tokens, p) != key


@SETTINGS
@given(st.lists(st.integers(0, 511), max_size=50), chunk_sizes)
def test_prefix_keys_of_different_lengths_differ(tokens, size):
    keys = PrefixKeys(FP_A, "", size)
    chain = keys.chain(tokens)
    all_keys = [keys.prefix(tokens, p, chain) for p in range(len(tokens) + 1)]
    assert len(set(all_keys)) == len(all_keys)


@SETTINGS
@given(
    st.lists(st.integers(0, 511), min_size=1, max_size=20),
    st.lists(st.integers(0, 511), max_size=30),
    st.lists(st.integers(0, 511), max_size=30),
)
def test_chunk_key_is_position_independent(chunk, before_a, before_b):
    keys = PrefixKeys(FP_A, "t", 8)
    a = before_a + chunk + [1, 2]
    b = before_b + chunk
    key = keys.chunk(chunk)
    assert keys.chunk(a[len(before_a) : len(before_a) + len(chunk)]) == key
    assert keys.chunk(torch.tensor(b)[len(before_b) :]) == key
    # independent of the prefix chunk size too, and never a prefix key
    assert PrefixKeys(FP_A, "t", 3).chunk(chunk) == key
    assert keys.prefix(chunk, len(chunk)) != key


@SETTINGS
@given(st.lists(st.integers(0, 511), min_size=1, max_size=20), st.data())
def test_chunk_key_changes_with_tokens_salt_and_model(chunk, data):
    key = PrefixKeys(FP_A, "t", 8).chunk(chunk)
    assert PrefixKeys(FP_A, "u", 8).chunk(chunk) != key
    assert PrefixKeys(FP_A, "", 8).chunk(chunk) != key
    assert PrefixKeys(FP_B, "t", 8).chunk(chunk) != key
    i = data.draw(st.integers(0, len(chunk) - 1), label="i")
    changed = list(chunk)
    changed[i] = (changed[i] + 1) % 512
    assert PrefixKeys(FP_A, "t", 8).chunk(changed) != key
    assert PrefixKeys(FP_A, "t", 8).chunk(chunk + [0]) != key
    assert PrefixKeys(FP_A, "t", 8).chunk(chunk[:-1]) != key


@SETTINGS
@given(st.lists(st.integers(0, 511), min_size=1, max_size=40), chunk_sizes)
def test_store_keys_are_lowercase_hex_digests(tokens, size):
    keys = PrefixKeys(FP_A, "", size)
    chain = keys.chain(tokens)
    made = [variant_slot_key(c, t) for c in chain for t in sorted({0, tokens[0]})]
    made += [state_key(keys.prefix(tokens, p, chain)) for p in range(len(tokens) + 1)]
    for key in made:
        assert len(key) == 64 and all(c in HEX for c in key)
    assert len(set(made)) == len(made)


def test_salts_are_not_ambiguous():
    """Length-prefixed hashing: moving bytes between salt and tokens never yields the same key."""
    tokens = [1, 2, 3, 4]
    keys = {PrefixKeys(FP_A, salt, 2).prefix(tokens, 4) for salt in ["", "a", "ab", "b", "\x00"]}
    assert len(keys) == 5


# ---------------------------------------------------------------------------------------------
# Keys across processes and loads.

KEY_MODELS = ["random-qwen3-next", "random-olmo-hybrid", "random-glm5-next"]
KEY_TOKENS = [(37 * i + 11) % 509 for i in range(150)]

_KEYS_SCRIPT = """
import json, os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
torch.set_num_threads(1)
from hybridkv.cache.keys import PrefixKeys, model_fingerprint, state_key, variant_slot_key
from hybridkv.models import load_model
names, tokens = json.loads(sys.argv[1])
out = {}
for name in names:
    fp = model_fingerprint(load_model(name))
    out[name] = {"fingerprint": fp}
    for salt in ("", "tenant"):
        keys = PrefixKeys(fp, salt, 64)
        chain = keys.chain(tokens)
        out[name][salt] = {
            "chain": [c.hex() for c in chain],
            "prefix": [keys.prefix(tokens, p).hex() for p in (0, 1, 63, 64, 65, 150)],
            "chunk": keys.chunk(tokens[10:30]).hex(),
            "kv": [variant_slot_key(c, tokens[0]) for c in chain],
            "state": state_key(keys.prefix(tokens, 128)),
        }
print(json.dumps(out))
"""


def _keys_in_this_process(models) -> dict:
    out = {}
    for name in KEY_MODELS:
        fp = model_fingerprint(models[name])
        out[name] = {"fingerprint": fp}
        for salt in ("", "tenant"):
            keys = PrefixKeys(fp, salt, 64)
            chain = keys.chain(KEY_TOKENS)
            out[name][salt] = {
                "chain": [c.hex() for c in chain],
                "prefix": [keys.prefix(KEY_TOKENS, p).hex() for p in (0, 1, 63, 64, 65, 150)],
                "chunk": keys.chunk(KEY_TOKENS[10:30]).hex(),
                "kv": [variant_slot_key(c, KEY_TOKENS[0]) for c in chain],
                "state": state_key(keys.prefix(KEY_TOKENS, 128)),
            }
    return out


def test_keys_are_the_same_in_fresh_processes_with_other_hash_seeds(models):
    expected = _keys_in_this_process(models)
    fingerprints = {expected[name]["fingerprint"] for name in KEY_MODELS}
    assert len(fingerprints) == len(KEY_MODELS)
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT, json.dumps([KEY_MODELS, KEY_TOKENS])],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == expected, f"PYTHONHASHSEED={hash_seed}"


@pytest.mark.parametrize("name", ["random-qwen3-next", "random-glm5-next"])
def test_model_fingerprint_tracks_the_weights(models, name):
    base = model_fingerprint(models[name])
    assert len(base) == 64 and all(c in HEX for c in base)
    assert model_fingerprint(load_model(name, seed=0)) == base  # another load, same seed
    other = load_model(name, seed=1)
    assert model_fingerprint(other) != base
    # One changed weight is enough to change the fingerprint.
    fresh = load_model(name, seed=0)
    with torch.no_grad():
        fresh.lm_head.weight[0, 0] += 1.0
    assert model_fingerprint(fresh) != base


def test_model_fingerprint_differs_between_architectures(models):
    assert len({model_fingerprint(models[name]) for name in KEY_MODELS}) == len(KEY_MODELS)


def test_checkpoint_fingerprint_reads_the_weights_once(tmp_path):
    """A checkpoint directory is named by its files' digests, computed once and kept beside it."""
    from transformers import Qwen3NextForCausalLM

    from hybridkv.cache.keys import DIGESTS_FILE
    from hybridkv.models import RANDOM_MODELS

    def save(seed: int) -> None:
        torch.manual_seed(seed)
        Qwen3NextForCausalLM(RANDOM_MODELS["random-qwen3-next"]()).save_pretrained(tmp_path)

    save(0)
    first = model_fingerprint(load_model(str(tmp_path)))
    record_path = tmp_path / DIGESTS_FILE
    record = json.loads(record_path.read_text())
    assert set(record) == {"model.safetensors"}
    assert model_fingerprint(load_model(str(tmp_path))) == first
    # The kept digest is what names the weights (the file is not read again): change it, and the
    # fingerprint changes with it.
    altered = {name: {**entry, "sha256": "0" * 64} for name, entry in record.items()}
    record_path.write_text(json.dumps(altered))
    assert model_fingerprint(load_model(str(tmp_path))) != first
    record_path.write_text(json.dumps(record))
    assert model_fingerprint(load_model(str(tmp_path))) == first
    # Rewritten weights are hashed again; the same weights in another dtype are another model.
    assert model_fingerprint(load_model(str(tmp_path), dtype=torch.bfloat16)) != first
    save(1)
    assert model_fingerprint(load_model(str(tmp_path))) != first
    assert json.loads(record_path.read_text())["model.safetensors"]["sha256"] != record["model.safetensors"]["sha256"]


def test_checkpoints_differing_in_one_middle_weight_have_different_fingerprints(tmp_path):
    """Every byte of the weights names a checkpoint, for hybridkv's stores and inside vLLM alike:
    a copy has the same fingerprints, a copy with one weight changed in the middle of its file
    (same size, same first and last MiB) has others."""
    import shutil

    from transformers import Qwen3NextForCausalLM

    from hybridkv.cache.keys import checkpoint_fingerprint
    from hybridkv.integrations.vllm.block_store import engine_fingerprint
    from hybridkv.models import RANDOM_MODELS
    from tests.helpers import flip_one_weight_in_the_middle

    config = RANDOM_MODELS["random-qwen3-next"]()
    config.vocab_size = 8192  # a weight file of several MiB, so its middle lies past the first and last MiB
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).save_pretrained(tmp_path / "a")
    for name in ("copy", "changed"):
        shutil.copytree(tmp_path / "a", tmp_path / name)
    (weights,) = (tmp_path / "changed").glob("*.safetensors")
    assert weights.stat().st_size > 4 << 20
    flip_one_weight_in_the_middle(weights)
    layout = [("FullAttentionSpec", 640, 4096, ["model.layers.3.self_attn.attn"])]

    def fingerprints(name: str) -> tuple[str, str, str]:
        path = tmp_path / name
        return (
            checkpoint_fingerprint(path),
            engine_fingerprint(str(path), layout, "torch.bfloat16"),
            model_fingerprint(load_model(str(path))),
        )

    a, copy, changed = fingerprints("a"), fingerprints("copy"), fingerprints("changed")
    assert a == copy
    assert all(x != y for x, y in zip(a, changed, strict=True))
