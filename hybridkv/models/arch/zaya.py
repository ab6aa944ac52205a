"""Zaya (`zaya`): every layer is attention with convolved queries and keys (CCA), full or over a
sliding window, and MoE.

Each layer's state beside its KV is short: the causal convolution's window of q/k projections
and the previous token's delayed value projection. A whole span of replayed tokens rebuilds
both exactly, so the probe tells adaptive-replay the state forgets everything per token. The
sliding-window layers keep every token's KV in hybridkv's cache layer (`adapter._KeepsHistory`),
since a resume at any L needs the window before L.
"""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import short_conv_probe

ARCHITECTURE = Architecture(
    name="zaya", model_types=("zaya",), decay_probe=short_conv_probe("self_attn.qkv_proj.q_proj")
)
