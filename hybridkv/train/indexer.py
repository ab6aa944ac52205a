"""An auxiliary loss for GLM-5.3-Flash's DSA indexer, which transformers runs under `no_grad`.

As in DeepSeek-V3.2's indexer warm-up: the indexer's pool scores, softmaxed over the pools a
query can select, are pulled (KL divergence) toward the MLA layer's own attention at that query,
summed over heads and over the tokens of each pool. The target is computed densely, with every
complete visible pool, so a pool the sparse selection missed can still be learned. The indexer
sees the layer's inputs detached: the loss trains the indexer only, never the model under it.

A forward pre-hook records each indexed attention layer's input during the training forward pass;
`indexer_loss` then scores a sample of query positions. The scoring mirrors the library's
`Glm5NextTextIndexer.forward` (its pooling is the library's own `get_pooled_states`);
`tests/test_train.py` checks that its top pools are the ones the library selects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class IndexerRecorder:
    """Records the input of every attention layer that runs its own indexer."""

    def __init__(self, backbone: nn.Module) -> None:
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.handles = []
        for layer in backbone.layers:
            attention = getattr(layer, "self_attn", None)  # other families name their mixers otherwise
            if getattr(attention, "indexer", None) is not None:
                self.handles.append(attention.register_forward_pre_hook(self._record, with_kwargs=True))

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.inputs[module] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def index_scores(
    attention: nn.Module, hidden: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's pool scores [B, Q, P] at query positions `queries`, and pool token indices [B, P, kpool]."""
    indexer = attention.indexer
    batch, length = hidden.shape[:2]
    q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden[:, queries]))
    q = indexer.wq_b(q_resid).view(batch, len(queries), -1, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden))
    gates = F.linear(hidden, indexer.index_kpool_compress_gate)
    packed = torch.cat([k, gates, torch.ones_like(k[..., :1])], dim=-1)
    pool_keys, pool_indices, _ = indexer.get_pooled_states(packed_states=packed)
    scores = F.relu(torch.matmul(q.float(), pool_keys.float().transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden[:, queries]).float() * indexer.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2), pool_indices


@torch.no_grad()
def attention_by_pool(attention: nn.Module, hidden: torch.Tensor, queries: torch.Tensor, pool: int) -> torch.Tensor:
    """The MLA layer's dense causal attention at `queries`, summed over heads and pools: [B, Q, P]."""
    batch, length = hidden.shape[:2]
    q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden[:, queries]))
    q = attention.q_b_proj(q_resid).view(batch, len(queries), -1, attention.qk_head_dim).transpose(1, 2)
    kv_pass, k_rot = torch.split(
        attention.kv_a_proj_with_mqa(hidden), [attention.kv_lora_rank, attention.qk_rope_head_dim], dim=-1
    )
    k_pass = attention.kv_a_layernorm(kv_pass).view(batch, 1, length, -1)
    keys, _ = attention.expand_kv(k_pass, k_rot.view(batch, 1, length, -1))
    logits = torch.matmul(q, keys.transpose(-1, -2)) * attention.scaling
    future = torch.arange(length)[None, :] > queries[:, None]
    probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1).sum(dim=1)
    pools = length // pool
    return probs[..., : pools * pool].reshape(batch, len(queries), pools, pool).sum(-1)


def indexer_loss(recorder: IndexerRecorder, num_queries: int, generator: torch.Generator) -> torch.Tensor:
    """Mean KL(attention by pool || indexer softmax) over the recorded layers and sampled queries."""
    losses = []
    for attention, hidden in recorder.inputs.items():
        hidden = hidden.detach()
        length = hidden.shape[1]
        pool = attention.indexer.index_kpool
        if length < 4 * pool:
            continue
        # Queries that can see at least two complete pools; the last position always among them.
        low = 2 * pool
        queries = torch.randint(low, length, (num_queries,), generator=generator)
        queries = torch.unique(torch.cat([queries, torch.tensor([length - 1])]))
        target = attention_by_pool(attention, hidden, queries, pool)
        scores, pool_indices = index_scores(attention, hidden, queries)
        pools = target.shape[-1]
        scores = scores[..., :pools]
        visible = (torch.arange(pools) * pool + pool - 1)[None, :] <= queries[:, None]  # [Q, P] complete, visible
        target = target.masked_fill(~visible, 0)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
        log_probs = scores.masked_fill(~visible, float("-inf")).log_softmax(dim=-1)
        kl = (target * (target.clamp_min(1e-9).log() - log_probs.masked_fill(~visible, 0))).sum(-1)
        losses.append(kl.mean())
    recorder.inputs.clear()
    return torch.stack(losses).mean() if losses else torch.zeros(())
