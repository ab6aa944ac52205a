"""Falcon-H1 (`falcon_h1`): a parallel hybrid, attention and Mamba-2 side by side in every layer
(one cache layer holding both KV and states: kind "hybrid")."""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import mamba2_probe

ARCHITECTURE = Architecture(name="falcon-h1", model_types=("falcon_h1",), decay_probe=mamba2_probe("mamba"))
