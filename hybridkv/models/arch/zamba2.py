"""Zamba2 (`zamba2`): Mamba-2 layers, some of them hybrid layers that also run a shared attention block.

(Zamba, the first version, is refused at load: its transformers code starts every multi-token
forward from a zero SSM state, whatever the cache holds.)"""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import mamba2_probe

ARCHITECTURE = Architecture(
    name="zamba2", model_types=("zamba2",), decay_probe=mamba2_probe("mamba", "mamba_decoder.mamba")
)
