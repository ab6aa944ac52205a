"""The training-only Gated DeltaNet chunk function equals transformers' own, alone and inside the
models that call it, and `fast_linear_kernels()` installs it only while its block runs."""

from __future__ import annotations

import pytest
import torch
from transformers import OlmoHybridConfig, OlmoHybridModel, Qwen3NextConfig, Qwen3NextModel
from transformers.models.glm5_next import modeling_glm5_next
from transformers.models.olmo_hybrid import modeling_olmo_hybrid
from transformers.models.qwen3_next import modeling_qwen3_next

from hybridkv.train import kernels
from hybridkv.train.kernels import chunk_gdn_solve, fast_linear_kernels

GDN_MODULES = (modeling_qwen3_next, modeling_olmo_hybrid)


def _gdn_inputs(length: int, seed: int, heads: int = 3, k_dim: int = 16, v_dim: int = 24):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float().requires_grad_()

    q, k = randn(2, length, heads, k_dim), randn(2, length, heads, k_dim)
    v = randn(2, length, heads, v_dim)
    # GDN's gate: one log-decay per head and token, in [-5, 0); beta in (0, 2) as OLMo Hybrid allows.
    g = (-5 * torch.rand(2, length, heads, generator=generator)).requires_grad_()
    beta = (2 * torch.rand(2, length, heads, generator=generator)).requires_grad_()
    state = randn(2, heads, k_dim, v_dim)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("l2norm", [True, False], ids=["qk-l2norm", "raw-qk"])
@pytest.mark.parametrize("length", [1, 37, 64, 130])
def test_chunk_gdn_solve_equals_the_library_chunk_gated_delta_rule(length, l2norm):
    """Outputs, final state and the gradient of every input, initial state included."""
    results = []
    for fn in (modeling_qwen3_next.torch_chunk_gated_delta_rule, chunk_gdn_solve):
        inputs = _gdn_inputs(length, seed=length)
        q, k, v, g, beta, state = inputs
        out, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        ((out * weights).sum() + final.square().sum()).backward()
        results.append((out.detach(), final.detach(), [x.grad for x in inputs]))
    (out_ref, final_ref, grads_ref), (out, final, grads) = results
    assert out.shape == out_ref.shape and final.shape == final_ref.shape
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-4)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), grads, grads_ref, strict=True):
        assert got is not None, name
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3, msg=lambda m, name=name: f"grad {name}: {m}")


def test_chunk_gdn_solve_without_state_returns_none_and_keeps_dtype():
    q, k, v, g, beta, _ = _gdn_inputs(20, seed=3)
    want, _ = modeling_qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    got, final = chunk_gdn_solve(q, k, v, g=g, beta=beta)
    assert final is None and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _qwen3_next() -> torch.nn.Module:
    config = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return Qwen3NextModel(config)


def _olmo_hybrid() -> torch.nn.Module:
    config = OlmoHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=32, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return OlmoHybridModel(config)


def _run(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=tokens, use_cache=False).last_hidden_state
    (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


@pytest.mark.parametrize("make", [_qwen3_next, _olmo_hybrid], ids=["qwen3-next", "olmo-hybrid"])
def test_fast_kernels_keep_the_gdn_model_forward_and_backward(make, monkeypatch):
    torch.manual_seed(0)
    model = make()
    module = modeling_qwen3_next if isinstance(model, Qwen3NextModel) else modeling_olmo_hybrid
    gdn_layers = model.config.layer_types.count("linear_attention")
    assert gdn_layers >= 2
    # Count the calls, so the test fails if the model never reaches the patched name.
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("chunk_size"))
        return chunk_gdn_solve(*args, **kwargs)

    monkeypatch.setattr(kernels, "chunk_gdn_solve", spy)
    tokens = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(1))
    library = {m: m.torch_chunk_gated_delta_rule for m in GDN_MODULES}
    kda_library = modeling_glm5_next.chunk_kimi_delta_attention
    want, want_grads = _run(model, tokens)
    with fast_linear_kernels():
        assert all(m.torch_chunk_gated_delta_rule is spy for m in GDN_MODULES)
        got, got_grads = _run(model, tokens)
    assert len(calls) == gdn_layers
    assert all(m.torch_chunk_gated_delta_rule is library[m] for m in GDN_MODULES)
    assert module.torch_chunk_gated_delta_rule is not spy
    assert modeling_glm5_next.chunk_kimi_delta_attention is kda_library
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_fast_kernels_restore_the_library_after_an_error():
    library = {m: m.torch_chunk_gated_delta_rule for m in GDN_MODULES}
    kda_library = modeling_glm5_next.chunk_kimi_delta_attention
    with pytest.raises(RuntimeError, match="boom"), fast_linear_kernels():
        assert all(m.torch_chunk_gated_delta_rule is chunk_gdn_solve for m in GDN_MODULES)
        raise RuntimeError("boom")
    assert all(m.torch_chunk_gated_delta_rule is library[m] for m in GDN_MODULES)
    assert modeling_glm5_next.chunk_kimi_delta_attention is kda_library
