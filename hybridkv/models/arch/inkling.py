"""Inkling (`inkling_text`, and the multimodal `inkling`): every layer is attention (full or over a
sliding window) beside four short convolutions (keys, values, after attention, after the MLP).

The short convolutions keep only their last K − 1 inputs, four windows per cache layer (slots
`conv.0`–`conv.3`); replaying K − 1 tokens rebuilds them, which the probe tells adaptive-replay.
"""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import short_conv_probe

ARCHITECTURE = Architecture(
    name="inkling", model_types=("inkling_text", "inkling"), decay_probe=short_conv_probe("self_attn.q_proj")
)
