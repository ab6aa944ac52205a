"""Cached prompts, token-level prefix matching, and assembling transformers caches from them."""

from hybridkv.cache.assemble import assemble_batch, assemble_cache, split_batch, zero_states
from hybridkv.cache.prefix_cache import CachedMatch, PrefixCache
from hybridkv.cache.prefix_index import PrefixIndex
from hybridkv.cache.prompt import CHECKPOINT_INTERVAL, CachedPrompt, LinearState, LinearStates, PromptKV, capture_prompt

__all__ = [
    "CHECKPOINT_INTERVAL",
    "CachedPrompt",
    "CachedMatch",
    "LinearState",
    "LinearStates",
    "PrefixCache",
    "PrefixIndex",
    "PromptKV",
    "assemble_batch",
    "assemble_cache",
    "capture_prompt",
    "split_batch",
    "zero_states",
]
