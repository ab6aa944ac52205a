"""Loading hybrid models and describing them (layer kinds, state shapes, bytes, FLOPs)."""

from hybridkv.models.describe import LayerSpec, ModelDescription
from hybridkv.models.loader import HybridModel, load_model
from hybridkv.models.tiny import DEFAULT_MODEL, TINY_MODELS

__all__ = ["DEFAULT_MODEL", "TINY_MODELS", "HybridModel", "LayerSpec", "ModelDescription", "load_model"]
