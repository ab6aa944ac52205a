"""LFM2 (`lfm2`, `lfm2_moe`, and the multimodal `lfm2_vl`): short-convolution layers and attention layers.

A short-convolution layer's whole state is its window of the last K − 1 inputs (no recurrent
state), so replaying K − 1 tokens recovers it exactly; the decay probe says so to adaptive-replay."""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import short_conv_probe

ARCHITECTURE = Architecture(
    name="lfm2", model_types=("lfm2", "lfm2_moe", "lfm2_vl"), decay_probe=short_conv_probe("conv.in_proj")
)
