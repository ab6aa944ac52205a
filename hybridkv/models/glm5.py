"""GLM-5.3-Flash's cache sizes, from its config alone (no weights).

    attention KV per token, per MLA layer:  (kv_lora_rank + qk_rope_head_dim) latent entries
                                            + the DSA indexer's packed key: index_head_dim key
                                              + index_head_dim k-pool gate scores + 1 valid flag
    KDA state per linear layer:             heads × head_dim × head_dim recurrent (float32)
                                            + 3 × heads × head_dim channels × conv kernel (q, k, v
                                              short-conv windows, model dtype)

The tiny model's probe-derived description must agree with these formulas (a test checks it),
which is what lets us quote the full-size numbers without 320B weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig


@dataclass(frozen=True)
class Glm5CacheSizes:
    linear_layers: int
    attention_layers: int
    kv_bytes_per_token_per_layer: int
    state_bytes_per_layer: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.attention_layers

    @property
    def state_bytes_per_checkpoint(self) -> int:
        return self.state_bytes_per_layer * self.linear_layers

    @classmethod
    def from_config(
        cls, config: Glm5NextTextConfig | None = None, dtype_bytes: int = 2, state_dtype_bytes: int = 4
    ) -> Glm5CacheSizes:
        """Defaults: GLM-5.3-Flash (transformers' Glm5NextTextConfig defaults) in bfloat16, float32 states."""
        config = config or Glm5NextTextConfig()
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        indexer = 2 * config.index_head_dim + 1
        heads, head_dim = config.linear_num_heads, config.linear_head_dim
        recurrent = heads * head_dim * head_dim * state_dtype_bytes
        conv = 3 * heads * head_dim * config.linear_conv_kernel_dim * dtype_bytes
        return cls(
            linear_layers=config.layer_types.count("linear_attention"),
            attention_layers=config.layer_types.count("indexed_attention"),
            kv_bytes_per_token_per_layer=(latent + indexer) * dtype_bytes,
            state_bytes_per_layer=recurrent + conv,
        )
