"""Qwen4-Exp (`qwen4_exp`, text and multimodal): Gated DeltaNet layers and QSA attention layers
(an indexer picks each query's key blocks), hyper-connections, and per-layer n-gram embeddings
(PLE) on some linear layers.

What its cache holds beyond keys, values and GDN states, and how hybridkv keeps it:
- QSA indexer keys, one per token (`indexer_keys`): the indexer pools complete blocks of
  `indexer_compress_ratio` visible tokens afresh on every forward, so no block is cached and a
  prefix of any length resumes exactly;
- every token's position ids, held on the cache object (`adapter.POSITIONS`);
- on PLE layers, conv slot 1 (the dilated short conv's window) and conv slot 2 (the last
  `ngram_size − 1` token ids, which start as end-of-sequence ids: `zero_state_fills`).
Its GDN layers forget like Qwen3.5's; the PLE windows are replaced by any replay of at least
(ple_conv_kernel_size − 1) · ngram_size tokens, far under one decay span.
"""

from transformers import PreTrainedConfig

from hybridkv.models.arch.base import Architecture
from hybridkv.models.gates import gdn_probe

# transformers' `Qwen4ExpTextNGramEmbedding` keeps its token context in this conv slot.
NGRAM_CONTEXT = "conv.2"


def zero_state_fills(config: PreTrainedConfig) -> dict[str, int]:
    text = config.get_text_config()
    if not text.ple_layer_ids:
        return {}
    eos = text.eos_token_id
    return {NGRAM_CONTEXT: eos[0] if isinstance(eos, list | tuple) else eos}


ARCHITECTURE = Architecture(
    name="qwen4-exp",
    model_types=("qwen4_exp", "qwen4_exp_text"),
    decay_probe=gdn_probe,
    zero_state_fills=zero_state_fills,
)
