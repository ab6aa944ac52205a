"""Minimal reproduction against plain vLLM (no hybridkv code): vLLM's Nemotron-H ignores the
dt floor that transformers' NemotronHMamba2Mixer applies (`config.time_step_min`).

    python results/vllm-nemotron-h-divergence/repro_plain_vllm.py

A random 2-layer NemotronH (Mamba-2 + attention, hidden 64, vocab 300; matrices scaled to std 0.5 so
that its outputs depend on its inputs), float32, saved to
/work/scratch45/repro-model. Its dt_bias is set to -12 or -8 in every head (the dt rows of in_proj stay small), so
softplus(dt + dt_bias) sits near 6e-6 or 3e-4, below time_step_min = 1e-3. The log-probabilities of a 256-token random prompt's own
tokens (vLLM: `SamplingParams(prompt_logprobs=0)`) are compared with transformers':
  1. transformers as shipped (clamps dt at time_step_min in its chunked scan)
  2. transformers with each mixer's time_step_limit set to (0, inf), vLLM's hard-coded dt_limit
With dt_bias = 0 (dt ≈ 0.7, never clamped) the control: all three agree. Prints a small table and writes
repro_plain_vllm.txt beside this file. ~1 minute.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)
DIR = Path("/work/scratch45/repro-model")
OUT = Path(__file__).resolve().parent / "repro_plain_vllm.txt"


def build(dt_bias: float) -> None:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=300, hidden_size=64, layers_block_type=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=4, mamba_head_dim=32,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=64, expand=2, intermediate_size=128,
        time_step_min=1e-3, time_step_limit=(0.0, float("inf")), max_position_embeddings=4096,
        use_mamba_kernels=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = NemotronHForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():  # std 0.02 -> 0.5: a random model whose outputs depend on its inputs
            if param.dim() == 2:
                param.mul_(25.0)
        for layer in model.model.layers:
            if hasattr(layer.mixer, "dt_bias"):
                layer.mixer.in_proj.weight[-layer.mixer.num_heads :].div_(25.0)  # dt rows stay small: dt ~ softplus(dt_bias)
                layer.mixer.dt_bias.fill_(dt_bias)
    shutil.rmtree(DIR, ignore_errors=True)
    model.save_pretrained(DIR)


def hf_logprobs(ids: list[int], floor: float | None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32).eval()
    if floor is not None:
        for layer in model.model.layers:
            if hasattr(layer.mixer, "time_step_limit"):
                layer.mixer.time_step_limit = (floor, float("inf"))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def vllm_logprobs(llm, ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([d[t].logprob for d, t in zip(out[0].prompt_logprobs[1:], ids[1:])])


def main() -> None:
    from vllm import LLM

    ids = torch.randint(3, 300, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    lines = ["max |Δ log p(prompt token)| over 255 positions, float32, vLLM vs transformers", "",
             "dt_bias | softplus(dt_bias) | vs transformers as shipped (dt >= time_step_min) | vs transformers with time_step_limit (0, inf)"]  # fmt: skip
    for dt_bias in (-12.0, -8.0, 0.0):
        build(dt_bias)
        llm = LLM(model=str(DIR), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=512,
                  enable_prefix_caching=False, mamba_ssm_cache_dtype="float32", seed=0)  # fmt: skip
        v = vllm_logprobs(llm, ids)
        del llm
        shipped, no_floor = hf_logprobs(ids, None), hf_logprobs(ids, 0.0)
        sp = torch.nn.functional.softplus(torch.tensor(dt_bias)).item()
        lines.append(f"{dt_bias:7.1f} | {sp:.2e} | {(v - shipped).abs().max():.2e} | {(v - no_floor).abs().max():.2e}")
        print(lines[-1], flush=True)
    import vllm

    lines += ["", f"vllm {vllm.__version__}; vllm/model_executor/layers/mamba/mamba_mixer2.py "
              "MambaMixer2.conv_ssm_forward passes dt_limit=(0.0, float('inf')) to mamba_chunk_scan_combined_varlen; "
              "transformers' NemotronHMamba2Mixer uses time_step_limit = (config.time_step_min, inf)."]  # fmt: skip
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
