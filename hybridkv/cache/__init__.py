"""Cached prompts, token-level prefix matching, and assembling transformers caches from them."""

from hybridkv.cache.assemble import (
    assemble_batch,
    assemble_cache,
    exact_attention_for_first_tokens,
    set_attention,
    set_linear_states,
    split_batch,
    zero_states,
)
from hybridkv.cache.prefix_cache import Hit, PrefixCache
from hybridkv.cache.prefix_index import PrefixIndex
from hybridkv.cache.prompt import CachedPrompt, LinearState, capture_prompt, read_attention, read_linear_states

__all__ = [
    "CachedPrompt",
    "Hit",
    "LinearState",
    "PrefixCache",
    "PrefixIndex",
    "assemble_batch",
    "assemble_cache",
    "exact_attention_for_first_tokens",
    "capture_prompt",
    "read_attention",
    "read_linear_states",
    "set_attention",
    "set_linear_states",
    "split_batch",
    "zero_states",
]
