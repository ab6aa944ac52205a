"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`, text and multimodal): 3 Gated DeltaNet layers : 1 gated attention
layer, dense or MoE. The Tail-Replay paper's Qwen3.5-4B and Qwen3.6-27B are this family."""

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import gdn_probe

ARCHITECTURE = Architecture(
    name="qwen3-5",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
    decay_probe=gdn_probe,
)
