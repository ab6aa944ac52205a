"""Tokenizers: a byte-level one that ships with the package for the built-in tiny models, and
the checkpoint's own (transformers' AutoTokenizer) for a model directory.

The byte tokenizer is lossless for any UTF-8 text: each byte b is token `b + OFFSET`, below it
sit the special tokens. Every tiny model has a 512-token vocabulary, which holds all 256 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import TINY_VOCAB
from hybridkv.models.tiny import BUILTIN_MODELS


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids (0 pad, 1 bos, 2 eos)."""

    OFFSET = 3

    def __init__(self, vocab_size: int = TINY_VOCAB) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 259 ids")
        self.name = "bytes"
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        # Ids outside the byte range (specials, or unused ids a model may still emit) are dropped.
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")


def write_byte_tokenizer(directory: Path) -> None:
    """`ByteTokenizer` as files any Hugging Face loader reads (tokenizer.json for the `tokenizers`
    library, tokenizer_config.json for transformers and vLLM): byte-level pieces with no merges, so
    every UTF-8 byte b is id b + OFFSET and the specials sit at 0, 1, 2, as `ByteTokenizer` has them.
    The one difference: a text holding a special token's own string ("</s>") encodes it as that id."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Built
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = {"<pad>": 0, "<s>": 1, "</s>": 2}
    pieces = bytes_to_unicode()  # the byte-level pre-tokenizer's printable stand-in for each byte
    vocab = specials | {pieces[b]: b + ByteTokenizer.OFFSET for b in range(256)}
    built = Built(models.BPE(vocab=vocab, merges=[]))
    built.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    built.decoder = decoders.ByteLevel()
    built.add_special_tokens([AddedToken(text, special=True) for text in specials])
    directory.mkdir(parents=True, exist_ok=True)
    built.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


class HFTokenizer:
    """A checkpoint directory's own tokenizer."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise HybridKVError(f"{path}: no usable tokenizer ({str(err).splitlines()[0]})") from err
        self.name = str(path)
        self.vocab_size = len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


# Files one of which a checkpoint's own tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_dir: str) -> Tokenizer:
    if name_or_dir in BUILTIN_MODELS:
        return ByteTokenizer(TINY_VOCAB)
    path = Path(name_or_dir)
    if path.is_dir():
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return HFTokenizer(path)
        # `hybridkv train` trains on the byte tokenizer: a model it exported before exports wrote
        # tokenizer files (training.json beside the weights), or a run's own RUN_DIR/checkpoint
        # (beside RUN_DIR/train_config.json), which a probe or arena run may read without an export.
        exported = (path / "training.json").is_file()
        if exported or ((path / "state.json").is_file() and (path.parent / "train_config.json").is_file()):
            return ByteTokenizer(TINY_VOCAB)
        # transformers would hand back a tokenizer that encodes every text to nothing.
        raise HybridKVError(f"{path}: no tokenizer ({', '.join(TOKENIZER_FILES)}) and not a model hybridkv train wrote")
    raise HybridKVError(f"unknown model {name_or_dir!r}: not a directory and not one of {', '.join(BUILTIN_MODELS)}")
