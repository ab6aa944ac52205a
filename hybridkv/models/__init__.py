"""Loading hybrid models and describing them (layer kinds, state shapes, bytes, FLOPs)."""

from hybridkv.models.describe import LayerSpec, ModelDescription
from hybridkv.models.loader import HybridModel, load_model
from hybridkv.models.tiny import BUILTIN_MODELS, DEFAULT_MODEL, RANDOM_MODELS, TRAINED_MODELS

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "RANDOM_MODELS",
    "TRAINED_MODELS",
    "HybridModel",
    "LayerSpec",
    "ModelDescription",
    "load_model",
]
