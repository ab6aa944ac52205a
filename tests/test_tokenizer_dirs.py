"""A model directory's tokenizer: its own files, the byte tokenizer for a model `hybridkv train`
exported, and a clear refusal for a directory with neither (transformers would otherwise hand back
a tokenizer that encodes every text to nothing)."""

from __future__ import annotations

import shutil

import pytest

from hybridkv.errors import HybridKVError
from hybridkv.models import TRAINED_MODELS
from hybridkv.models.tokenizer import ByteTokenizer, load_tokenizer


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
