"""Tiny random-weight checkpoints that vLLM's CPU build can serve, shaped for the block grid they give vLLM.

vLLM keeps a hybrid model's linear states in pages of the same size as its attention pages, so it
raises the attention block size until one block of one layer's KV is at least one linear layer's
whole state (`Platform._align_hybrid_block_size` in `vllm/platforms/interface.py`):

    block = align * ceil(state_bytes_per_linear_layer / (align * kv_bytes_per_token_per_attention_layer))

with `align` the backend's block alignment: 128 tokens on the CPU backend, 16 with FlashAttention
on a GPU. The layer counts do not enter it. Its prefix cache (`align` mode) can then reuse a prompt
only up to a multiple of that block, and a user's `--block-size` can only raise it. GLM-5.3-Flash's
KDA states against its MLA latent give 3,584 tokens; the bench models below give a production-like
grid and a fine one. The state's dtype enters it: vLLM's CPU build stores Gated DeltaNet states
in float32 on CPUs with AVX512-BF16 and in the model's dtype elsewhere when left on `auto`, so the
bench always asks for float32 and gets the same grid on every machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from hybridkv.errors import HybridKVError
from hybridkv.models.arch import by_name

CPU_BLOCK_ALIGN = 128  # vLLM's CPU backend: its default block size, which the alignment keeps a multiple of


@dataclass(frozen=True)
class BenchModel:
    """A servable tiny Qwen3-Next (Gated DeltaNet + gated attention; the hybrid family vLLM's CPU
    build has native kernels for), with config fields replacing `servable_config`'s."""

    name: str
    why: str
    overrides: dict = field(default_factory=dict)

    def config(self) -> PreTrainedConfig:
        config = by_name("qwen3-next").servable_config()
        for key, value in self.overrides.items():
            setattr(config, key, value)
        return config


BENCH_MODELS = {
    model.name: model
    for model in (
        BenchModel(
            "grid-2048",
            "production-shaped grid: one 32-wide KV head (128 B per token and layer in bf16) against "
            "4 Gated DeltaNet value heads of 128 x 128 float32 states (262 KiB per layer), so vLLM's "
            "block is 2,176 tokens, as GLM-5.3-Flash's is 3,584",
            dict(num_key_value_heads=1, head_dim=32),
        ),
        BenchModel(
            "grid-128",
            "vLLM CPU's finest grid: two 128-wide KV heads (1,024 B per token and layer) against one Gated "
            "DeltaNet value head (66 KiB per layer), a 128-token block: trace-replay's scaled trace blocks",
            dict(num_key_value_heads=2, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=1),
        ),
        BenchModel(
            "grid-640",
            "fine grid: two 64-wide KV heads (512 B per token and layer) against the same states, a "
            "640-token block; the grid costs vLLM's own cache little here",
        ),
    )
}
# The trained checkpoint vLLM's CPU build serves: its first-token distributions are decisive, so the
# bench's fidelity columns mean something; the grid models above are for block grids and timing.
DEFAULT_BENCH_MODEL = "tiny-qwen3-next-vllm"
_SAVE_ONLY = {"architectures", "dtype", "torch_dtype", "transformers_version"}  # set by save_pretrained


def gdn_grid_block(config: PreTrainedConfig, align: int = CPU_BLOCK_ALIGN) -> int:
    """The attention block vLLM derives for a Qwen3-Next config served in bf16 with float32
    recurrent states (`--mamba-ssm-cache-dtype float32`, as the bench serves it): a linear layer's
    conv state ((kernel - 1) x the q, k, v channels, bf16) and recurrent state (value heads x d_v x
    d_k, float32), over one attention layer's K and V bytes per token (bf16)."""
    conv_channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    conv = 2 * (config.linear_conv_kernel_dim - 1) * conv_channels
    recurrent = 4 * config.linear_num_value_heads * config.linear_value_head_dim * config.linear_key_head_dim
    kv_per_token = 2 * config.num_key_value_heads * 2 * config.head_dim
    return align * math.ceil((conv + recurrent) / (align * kv_per_token))


def bench_checkpoint(model: str, out: Path) -> Path:
    """The directory `vllm serve` loads for `--model`: a bench model written to OUT/<name>, a
    trained built-in model's own directory, or a checkpoint directory as given."""
    from hybridkv.models.tiny import TRAINED_MODELS

    if model in BENCH_MODELS:
        return write_servable(out / model, model)
    if model in TRAINED_MODELS:
        return TRAINED_MODELS[model]
    if Path(model).is_dir():
        return Path(model)
    known = ", ".join([*BENCH_MODELS, DEFAULT_BENCH_MODEL])
    raise HybridKVError(f"--model {model!r}: not a checkpoint directory (or one of {known})")


def write_servable(path: str | Path, model: str, seed: int = 0) -> Path:
    """Save the seeded bench model `model` (a BENCH_MODELS name) to `path`, in bfloat16."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():  # written before: it must be this very model
        import json

        want = BENCH_MODELS[model].config().to_diff_dict()
        have = json.loads((path / "config.json").read_text())
        differ = sorted(k for k, v in want.items() if k not in _SAVE_ONLY and have.get(k) != v)
        if differ:
            raise HybridKVError(f"{path} holds another model than {model} ({', '.join(differ[:4])} differ)")
        return path
    torch.manual_seed(seed)
    weights = AutoModelForCausalLM.from_config(BENCH_MODELS[model].config()).to(torch.bfloat16)
    weights.save_pretrained(path)
    return path
