"""A tiny random-weight Qwen3-Next checkpoint that vLLM's CPU build can serve.

vLLM's CPU Gated-DeltaNet kernel needs bfloat16 and a linear head size it has kernels for (128),
so this differs from hybridkv's own `random-qwen3-next` in those two respects only.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_qwen3_next(path: str | Path, seed: int = 0) -> Path:
    """Save a seeded tiny Qwen3-Next (3 GDN : 1 attention, 8 layers, ~11M parameters) to `path`."""
    from transformers import AutoModelForCausalLM

    from hybridkv.models.tiny import RANDOM_MODELS

    path = Path(path)
    if (path / "config.json").exists():
        return path
    config = RANDOM_MODELS["random-qwen3-next"]()
    config.architectures = ["Qwen3NextForCausalLM"]
    config.linear_key_head_dim = config.linear_value_head_dim = 128
    config.linear_num_key_heads, config.linear_num_value_heads = 2, 4
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path
