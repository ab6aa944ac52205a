"""What the benchmark scripts share: their common options and a prompt hit in full by a cached one."""

from __future__ import annotations

import argparse

import torch

from hybridkv.cache import CachedMatch, PrefixCache, capture_prompt
from hybridkv.eval.validate import make_workload
from hybridkv.models import DEFAULT_MODEL, HybridModel


def parser(doc: str, prefix_length: int = 4096, suffix: int = 16) -> argparse.ArgumentParser:
    """--model, --prefix-length, --suffix and --budget, with the script's docstring as its help."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prefix-length", type=int, default=prefix_length)
    parser.add_argument("--suffix", type=int, default=suffix)
    parser.add_argument("--budget", default="0.05")
    return parser


def cached_hit(model: HybridModel, prefix_length: int, suffix: int, seed: int = 0) -> tuple[torch.Tensor, CachedMatch]:
    """A new prompt and its hit on a cached prompt (no checkpoints) that shares its first `prefix_length` tokens."""
    work = make_workload(model, prefix_length, suffix, seed=seed)
    cache = PrefixCache()
    cache.add(capture_prompt(model, work.cached_prompt, None))
    return work.prompt, cache.lookup(work.prompt)
