"""Start tiny-qwen3-next-vllm from tiny-qwen3-next: the same weights with 64-wide linear heads.

vLLM's CPU Gated-DeltaNet kernels take linear head sizes of 64 or 128 only; tiny-qwen3-next's are
32. Each key/value head's first 32 channels keep their trained weights; the new channels get small
random input weights (so they carry a gradient) and zero output weights. The gated RMSNorm then
averages over 64 channels of which 32 carry the signal, so its weight is scaled by 1/sqrt(2) to
keep each layer's output. The q scale (1/sqrt(head dim)) falls by sqrt(2); the norm after the
recurrence divides it out, but this model's recurrence outputs are small enough (mean square near
1e-6) that the norm's epsilon matters, so it falls by (32/64)^2 with them (every RMSNorm shares
the config's rms_norm_eps; the others' inputs are of order 1, so they do not notice). The widened
model's logits are within 0.01 of the original's on a 3,000-byte text, top-1 agreeing everywhere. Usage: python widen.py OUT_DIR
"""

import math
import sys
from pathlib import Path

import torch

from hybridkv.models.loader import read_with_head, write_with_head
from hybridkv.train.shapes import build

OLD, NEW = 32, 64
NOISE = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
SHAPE = {"linear_key_head_dim": NEW, "linear_value_head_dim": NEW, "rms_norm_eps": 1e-6 * (OLD / NEW) ** 2}


def widen_rows(new: torch.Tensor, old: torch.Tensor, blocks_old: list[int], noise: float) -> torch.Tensor:
    """Rows of `old` laid out as consecutive blocks (sizes `blocks_old`, each of 32-wide heads)
    copied into the first channels of each head of `new`; other rows = `new`'s init * noise."""
    out = new.clone() * noise
    o = n = 0
    for size in blocks_old:
        for _head in range(size // OLD):
            out[n : n + OLD] = old[o : o + OLD]
            o += OLD
            n += NEW
    assert o == old.shape[0] and n == new.shape[0], (o, n)
    return out


def main(out: Path) -> None:
    torch.manual_seed(0)
    config_old, backbone_old, head_old = build("tiny-qwen3-next")
    read_with_head(Path("hybridkv/models/weights/tiny-qwen3-next"), backbone_old, head_old, "tiny-qwen3-next")
    torch.manual_seed(0)
    config, backbone, head = build("tiny-qwen3-next", SHAPE)
    state, old = backbone.state_dict(), backbone_old.state_dict()
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    group = hv // hk
    for key in state:
        if state[key].shape == old[key].shape:
            state[key] = old[key].clone()
            continue
        if key.endswith("in_proj_qkvz.weight"):  # per key head: q, k, group v heads, group z heads
            state[key] = widen_rows(state[key], old[key], [OLD, OLD, group * OLD, group * OLD] * hk, NOISE)
        elif key.endswith("conv1d.weight"):  # q channels, k channels, v channels
            state[key] = widen_rows(state[key], old[key], [hk * OLD, hk * OLD, hv * OLD], 1.0)
        elif key.endswith("out_proj.weight"):  # columns: value heads
            cols = widen_rows(state[key].T.contiguous(), old[key].T.contiguous(), [hv * OLD], 0.0)
            state[key] = cols.T.contiguous()
        elif key.endswith("norm.weight"):
            w = torch.zeros_like(state[key])
            w[:OLD] = old[key] / math.sqrt(NEW / OLD)
            w[OLD:] = old[key].mean() / math.sqrt(NEW / OLD)
            state[key] = w
        else:
            raise SystemExit(f"no rule for {key}: {tuple(old[key].shape)} -> {tuple(state[key].shape)}")
    backbone.load_state_dict(state)
    head.load_state_dict(head_old.state_dict())
    config.architectures = ["Qwen3NextForCausalLM"]
    write_with_head(out, config, backbone, head)
    # the function is kept: compare logits on a prose text
    from hybridkv.models.tokenizer import ByteTokenizer

    text = Path("README.md").read_text()[:3000]
    ids = torch.tensor([ByteTokenizer().encode(text)])
    with torch.no_grad():
        a = head_old(backbone_old(ids).last_hidden_state)
        b = head(backbone(ids).last_hidden_state)
    print("max |logit diff|", (a - b).abs().max().item(), "logit scale", a.abs().max().item(),
          "top-1 agreement", (a.argmax(-1) == b.argmax(-1)).float().mean().item())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
