"""A tiny random-weight checkpoint that vLLM's CPU build can serve (the architecture's `servable_config`)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridkv.models.arch import by_name


def write_servable(path: str | Path, family: str = "qwen3-next", seed: int = 0) -> Path:
    """Save a seeded tiny model of `family` in the variant vLLM's CPU build serves, to `path`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    make_config = by_name(family).servable_config
    if make_config is None:
        raise ValueError(f"{family} has no vLLM-servable tiny variant")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config()).to(torch.bfloat16)
    model.save_pretrained(path)
    return path
