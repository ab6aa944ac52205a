"""hybridkv: token-level prefix KV-cache reuse for hybrid (attention + linear/state-space) LLMs."""

from hybridkv.errors import HybridKVError

__version__ = "0.1.0"
__all__ = ["HybridKVError", "__version__"]
