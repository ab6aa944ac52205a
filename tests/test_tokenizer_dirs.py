"""A model directory's tokenizer: its own files, the byte tokenizer for a model `hybridkv train`
exported, and a clear refusal for a directory with neither (transformers would otherwise hand back
a tokenizer that encodes every text to nothing)."""

from __future__ import annotations

import random
import shutil

import pytest
from transformers import AutoTokenizer

from hybridkv.errors import HybridKVError
from hybridkv.models import TRAINED_MODELS
from hybridkv.models.tokenizer import ByteTokenizer, load_tokenizer, write_byte_tokenizer


def test_an_exported_model_directory_reads_text_as_its_name_does(tmp_path):
    name = next(iter(TRAINED_MODELS))
    copy = tmp_path / "exported"
    shutil.copytree(TRAINED_MODELS[name], copy)
    text = "The surveyed population of Pure Soup is 5287288."
    assert load_tokenizer(str(copy)).encode(text) == load_tokenizer(name).encode(text)
    assert isinstance(load_tokenizer(str(copy)), ByteTokenizer)


def test_a_directory_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    name = next(iter(TRAINED_MODELS))
    for file in ("config.json", "model.safetensors"):
        shutil.copyfile(TRAINED_MODELS[name] / file, tmp_path / file)
    with pytest.raises(HybridKVError, match="no tokenizer") as refused:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(refused.value)


def test_an_exported_model_ships_a_tokenizer_file_with_the_byte_tokenizers_ids(tmp_path):
    """The tokenizer.json `export` writes is what Hugging Face loaders (vLLM's server) read: its ids
    must be the byte tokenizer's the model was trained on, for any UTF-8 text, and decode back."""
    write_byte_tokenizer(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    byte = ByteTokenizer()
    rng = random.Random(5)
    alphabet = "ab Z09.,;\n\t  é€日本🙂\x00\x7f"
    texts = [
        "",
        " leading and  double  spaces ",
        "line\r\nbreaks\n\n",
        *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(50)),
    ]
    for text in texts:
        ids = byte.encode(text)
        assert loaded.encode(text) == ids and hf(text, add_special_tokens=False).input_ids == ids, repr(text)
        assert loaded.decode([1, *ids, 2]) == text == byte.decode(ids)
