"""IBM Granite 4 hybrids (`granitemoehybrid`): Mamba-2 layers and attention layers, MoE."""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import mamba2_probe

ARCHITECTURE = Architecture(name="granite-4", model_types=("granitemoehybrid",), decay_probe=mamba2_probe("mamba"))
