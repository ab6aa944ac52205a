"""Built-in tiny hybrid models: real architectures from transformers, scaled down.

Two kinds, both with a 512-token byte vocabulary (`hybridkv.models.tokenizer.ByteTokenizer`):

- `tiny-*` (TRAINED_MODELS): weights trained by `hybridkv train` and shipped in the package
  (`weights/<name>/`: a transformers config.json and model.safetensors). They read their
  context, so task scores, retention and PGR mean something (the README's model cards give their
  RULER scores). `tiny-glm5-next` ships and is the default.
- `random-*` (RANDOM_MODELS): a transformers config with the same layer pattern and mechanisms
  as the real model (layer kinds, NoPE/RoPE, MoE, hyper-connections, DSA indexer), a few million
  parameters, weights from the model library's own initialisation under a fixed seed, identical
  on every machine for the same seed and torch version. The invariant tests run on these.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedConfig

from hybridkv.models.arch import ARCHITECTURES

# name -> config factory; keyword arguments override the random model's settings (the trained
# shapes are these with other sizes: each architecture's `trained_shape`).
RANDOM_MODELS: dict[str, Callable[..., PreTrainedConfig]] = {
    arch.random_name: arch.tiny_config for arch in ARCHITECTURES if arch.tiny_config is not None
}
WEIGHTS_DIR = Path(__file__).parent / "weights"
# Trained models shipped with the package: name -> directory with config.json and model.safetensors.
TRAINED_MODELS: dict[str, Path] = {
    path.name: path for path in sorted(WEIGHTS_DIR.glob("tiny-*")) if (path / "model.safetensors").is_file()
}
BUILTIN_MODELS = (*TRAINED_MODELS, *RANDOM_MODELS)
# The trained GLM-5.3-Flash shape: the one built-in model whose task scores mean something.
DEFAULT_MODEL = "tiny-glm5-next"
