"""Bamba (`bamba`): Mamba-2 layers and attention layers."""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import mamba2_probe

ARCHITECTURE = Architecture(name="bamba", model_types=("bamba",), decay_probe=mamba2_probe("mamba"))
