"""Training-only speed-ups for the plain-PyTorch linear-attention paths of transformers.

transformers' CPU fallback for KDA (`chunk_kimi_delta_attention`) inverts each chunk's
unit-lower-triangular matrix with a Python loop over the chunk's rows (64 small ops per chunk,
each kept for autograd). The loop computes T = (I - L)^-1 for the strictly lower L it starts from,
so one batched triangular solve gives the same matrix. Everything else is the library's algorithm,
step for step. Its Gated DeltaNet fallback (`torch_chunk_gated_delta_rule`, used by Qwen3-Next and
OLMo Hybrid) already solves, but indexes chunks inside its loop, which makes backward quadratic in
the sequence length; `chunk_gdn_solve` keeps its steps and iterates chunks with `unbind`.
`tests/test_train.py` and `tests/test_train_kernels.py` check outputs and gradients against the
library's functions.

Mamba-2 (Nemotron-H's `mamba2_chunk_scan`) is left as the library has it: it has no Python loop,
its backward is linear in the sequence length, and it is a minor share of a training step.

The patch is applied only inside `fast_linear_kernels()`, which training enters; inference, the
arena and every recovery method run the library's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Largest total log-decay of one chunk for which exp(+-decay) stays far inside float32 (e^88).
_FACTOR_LIMIT = 80.0


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
    chunk size only regroups the same sums), and a bounded gate keeps every factor of the
    pairwise decays finite within 16 tokens.
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
    # Pairwise decays exp(g_i - g_j) factor through a reference point r inside the chunk as
    # exp(g_i - g_r) * exp(g_r - g_j), which turns the [chunk, chunk, head_dim] products into
    # matrix products. Each factor is at most exp(chunk's total log-decay), finite when the
    # gate is bounded (GLM-5.3-Flash's safe gate: g >= -5 per token, so >= -80 per chunk). An
    # unbounded gate whose chunk decays further takes the library's elementwise form.
    if (g[..., -1, :] - g[..., 0, :]).min() > -_FACTOR_LIMIT:
        reference = g[..., chunk_size // 2 : chunk_size // 2 + 1, :]
        to_ref, from_ref = (g - reference).exp(), (reference - g).exp()
        key_from_ref = (key * from_ref).transpose(-1, -2)
        lower = -((k_beta * to_ref) @ key_from_ref).masked_fill(upper, 0)
        intra = ((query * to_ref) @ key_from_ref).masked_fill(strict_upper, 0)
    else:
        decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_upper[..., None], float("-inf")).exp()
        lower = -(k_beta.unsqueeze(-2) * key.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(upper, 0)
        intra = (query.unsqueeze(-2) * key.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(strict_upper, 0)
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


def chunk_gdn_solve(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next, OLMo Hybrid) for training.

    The library's function already solves the UT system with `solve_triangular`; its cost under
    autograd is the chunk loop: it reads chunk i as `x[:, :, i]` and writes the output with
    `core_attn_out[:, :, i] = ...`, so backward builds one full-size gradient per chunk per read
    (SelectBackward) and copies the whole output buffer per write (CopySlices), O(N^2) in the
    sequence length. Here the loop walks `unbind` views and the outputs are stacked once.

    Every other step is the library's, in its order: fp32, l2norm (its rsqrt form), query scaled
    by head_dim^-0.5, zero right-padding, beta-weighted keys and values, per-head log-decay
    cumulated within each chunk, pairwise decays masked above the diagonal, one unit-lower
    triangular solve (here for values and decayed keys together: the same system, two right-hand
    sides), then per chunk v_new = v - k_cumdecay @ S, out = q @ S + intra @ v_new,
    S = S * exp(g_last) + k^T @ v_new.

    The chunk size stays the library's 64. KDA's replacement uses 16 because its per-channel decays
    are [chunk, chunk, head_dim] tensors; GDN's are [chunk, chunk] per head, so smaller chunks
    only add loop steps (measured on the tiny-qwen3-next shape: 16 is slower, 32 and 64 tie).
    With the same chunking, the sums are grouped as the library groups them.
    """
    initial_dtype = query.dtype
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(dim=-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    batch, heads, length, k_dim = key.shape
    v_dim = value.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (
        x.reshape(batch, heads, -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    )
    g = g.reshape(batch, heads, -1, chunk_size).cumsum(dim=-1)
    strict_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(strict_upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * decay
    intra = (query @ key.transpose(-1, -2)) * decay
    solved = torch.linalg.solve_triangular(
        ut_system, torch.cat((v_beta, k_beta * g.exp().unsqueeze(-1)), dim=-1), upper=False, unitriangular=True
    )
    value, k_cumdecay = solved.split((v_dim, k_dim), dim=-1)
    state = (
        torch.zeros(batch, heads, k_dim, v_dim, dtype=value.dtype, device=value.device)
        if initial_state is None
        else initial_state.to(value)
    )
    query = query * g.exp().unsqueeze(-1)
    key = key * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    outputs = []
    for q_i, k_i, v_i, intra_i, kc_i, decay_i in zip(
        *(x.unbind(2) for x in (query, key, value, intra, k_cumdecay, chunk_decay)), strict=True
    ):
        v_new = v_i - kc_i @ state
        outputs.append(q_i @ state + intra_i @ v_new)
        state = state * decay_i + k_i.transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, v_dim)[:, :, :length]
    return out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format), (
        state if output_final_state else None
    )


@contextlib.contextmanager
def fast_linear_kernels() -> Iterator[None]:
    """Route transformers' KDA and Gated DeltaNet chunk paths through the functions above while
    the block runs; the library's functions are back in place when it exits, even on error."""
    from transformers.models.glm5_next import modeling_glm5_next
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid
    from transformers.models.qwen3_next import modeling_qwen3_next

    patches = [
        (modeling_glm5_next, "chunk_kimi_delta_attention", chunk_kda_solve),
        (modeling_qwen3_next, "torch_chunk_gated_delta_rule", chunk_gdn_solve),
        (modeling_olmo_hybrid, "torch_chunk_gated_delta_rule", chunk_gdn_solve),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, replacement in patches:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
