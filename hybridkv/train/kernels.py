"""Training-only speed-ups for the plain-PyTorch linear-attention paths of transformers.

transformers' CPU fallback for KDA (`chunk_kimi_delta_attention`) inverts each chunk's
unit-lower-triangular matrix with a Python loop over the chunk's rows (64 small ops per chunk,
each kept for autograd). The loop computes T = (I - L)^-1 for the strictly lower L it starts from,
so one batched triangular solve gives the same matrix. Everything else is the library's algorithm,
step for step. `tests/test_train.py` checks outputs and gradients against the library's function.

The patch is applied only inside `fast_linear_kernels()`, which training enters; inference, the
arena and every recovery method run the library's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # transformers' (and FLA's) l2norm: x / sqrt(sum x^2 + eps)
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_kda_solve(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kimi_delta_attention` with the per-row loop replaced by a triangular solve.

    Chunks of 16 instead of the library's 64: the result is the same up to float rounding (the
    chunk size only regroups the same sums) and the [chunk, chunk, head_dim] decay tensors shrink 4x.
    """
    initial_dtype = query.dtype
    query, key, value, beta, g = (x.transpose(1, 2).contiguous().float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    batch, heads, length, k_dim = key.shape
    v_dim = value.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    query = F.pad(query, (0, 0, 0, pad)) * k_dim**-0.5
    key, value, g = (F.pad(x, (0, 0, 0, pad)) for x in (key, value, g))
    beta = F.pad(beta, (0, pad))
    k_beta, v_beta = key * beta.unsqueeze(-1), value * beta.unsqueeze(-1)
    query, key, g, k_beta, v_beta = (
        x.reshape(batch, heads, -1, chunk_size, x.shape[-1]) for x in (query, key, g, k_beta, v_beta)
    )
    g = g.cumsum(dim=-2)
    eye = torch.eye(chunk_size, dtype=query.dtype, device=query.device)
    upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=0)
    strict_upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_upper[..., None], float("-inf")).exp()
    lower = -(k_beta.unsqueeze(-2) * key.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(upper, 0)
    # (I - L) T = I, T unit lower triangular: the matrix the library's row loop builds.
    solved = torch.linalg.solve_triangular(eye - lower, eye.expand_as(lower), upper=False, unitriangular=True)
    value = solved @ v_beta
    k_cumdecay = solved @ (k_beta * g.exp())
    state = (
        torch.zeros(batch, heads, k_dim, v_dim, dtype=value.dtype, device=value.device)
        if initial_state is None
        else initial_state.to(value)
    )
    # Whole-tensor terms first; the loop keeps only what depends on the running state. Chunks are
    # taken with unbind (one backward node), not indexing (one full-size gradient per chunk).
    intra = (query.unsqueeze(-2) * key.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(strict_upper, 0)
    q_decayed = query * g.exp()
    k_to_end = key * (g[..., -1:, :] - g).exp()
    outputs = []
    for q_i, k_i, v_i, g_i, intra_i, kc_i in zip(
        *(x.unbind(2) for x in (q_decayed, k_to_end, value, g, intra, k_cumdecay)), strict=True
    ):
        v_new = v_i - kc_i @ state
        outputs.append(q_i @ state + intra_i @ v_new)
        state = state * g_i[:, :, -1].exp().unsqueeze(-1) + k_i.transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, v_dim)[:, :, :length]
    return out.transpose(1, 2).contiguous().to(initial_dtype), state if output_final_state else None


@contextlib.contextmanager
def fast_linear_kernels() -> Iterator[None]:
    """Route transformers' KDA chunk path through `chunk_kda_solve` while the block runs."""
    from transformers.models.glm5_next import modeling_glm5_next

    saved = modeling_glm5_next.chunk_kimi_delta_attention
    modeling_glm5_next.chunk_kimi_delta_attention = chunk_kda_solve
    try:
        yield
    finally:
        modeling_glm5_next.chunk_kimi_delta_attention = saved
