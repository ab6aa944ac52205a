"""Per-layer comparison of vLLM and transformers on the same tokens; where do they first part?

    python results/vllm-nemotron-h-divergence/layers.py

Reads the per-layer captures teacher_force.py wrote (/work/scratch45/captures, run it first) for
two sequences (niah_single_2-2048-0: served `full` runs on; niah_single_1-2048-0: it does not).
Captured, per decoder layer i (0 M2, 1 MLP, 2 M2, 3 MLP, 4 M2, 5 attention, 6 MLP):
  norm.i    the layer's pre-norm output (the mixer's input)
  dt.i      softplus(dt + dt_bias) per token and head, before any clamp (Mamba-2 layers)
  y.i       the Mamba-2 scan output (D skip included), before the gated RMSNorm
  mixer.i   the mixer's output
  stream.i  the residual stream after the layer (vLLM: its (output, residual) pair summed)
  norm_f    the final norm
Table 1: max |Δ| / max |ref| per capture, for several pairs. Table 2: dt below time_step_min
(1e-3) per Mamba-2 layer and head, and the state's time constant 1 / (|A| · median dt) with and
without the clamp (how many tokens a state zeroed at s takes to refill). Writes layers.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

CAPTURES = Path("/work/scratch45/captures")
PAIRS = [
    ("vllm-fp32", "hf-fp32"),  # as shipped, both float32
    ("vllm-fp32-clamp", "hf-fp32"),  # vLLM with transformers' clamp
    ("vllm-fp32", "hf-fp32-noclamp"),  # transformers without its clamp
    ("vllm-bf16", "hf-fp32"),  # the served dtype
    ("vllm-bf16-clamp", "hf-bf16"),
    ("hf-bf16", "hf-fp32"),  # bf16 alone
]
ORDER = ["norm.0", "dt.0", "y.0", "mixer.0", "stream.0", "stream.1", "dt.2", "y.2", "stream.2", "stream.3",
         "dt.4", "y.4", "stream.4", "mixer.5", "stream.5", "stream.6", "norm_f"]  # fmt: skip


def main() -> None:
    caps = {name: torch.load(CAPTURES / f"{name}.pt") for name in {n for p in PAIRS for n in p}}
    lines = ["# Per-layer: max |Δ| / max |reference| over all positions", ""]
    for sid in caps["hf-fp32"]["layers"]:
        lines += [f"## {sid}", "", "| capture | " + " | ".join(f"{a} vs {b}" for a, b in PAIRS) + " |",
                  "|---" * (len(PAIRS) + 1) + "|"]  # fmt: skip
        for key in ORDER:
            cells = []
            for a, b in PAIRS:
                x, r = caps[a]["layers"][sid][key], caps[b]["layers"][sid][key]
                rel = (x - r).abs().max() / r.abs().max()
                cells.append(f"{rel:.2e}")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        # first position where the layer-0 scan output departs (float32, shipped)
        x, r = caps["vllm-fp32"]["layers"][sid]["y.0"], caps["hf-fp32"]["layers"][sid]["y.0"]
        per = (x - r).abs().max(-1).values / r.abs().max()
        first = int((per > 1e-4).nonzero()[0]) if (per > 1e-4).any() else None
        lines += ["", f"Layer-0 scan output y (vllm-fp32 vs hf-fp32): first position with relative |Δ| > 1e-4: {first}; "
                  f"at the last position {per[-1]:.2e}.", ""]  # fmt: skip
    # dt statistics and time constants, from vLLM's unclamped dt
    model = common.hf_model(torch.float32)
    sid = next(iter(caps["vllm-fp32"]["layers"]))
    lines += [f"## dt = softplus(dt_proj + dt_bias) on {sid} (vLLM float32, before any clamp)", "",
              "| layer | head | A | share of tokens with dt < 1e-3 | median dt | time constant 1/(|A|·median dt), no clamp (vLLM) | with clamp at 1e-3 (transformers prefill) |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for i in (0, 2, 4):
        dt = caps["vllm-fp32"]["layers"][sid][f"dt.{i}"]
        A = -torch.exp(model.model.layers[i].mixer.A_log.float())
        for h in range(dt.shape[-1]):
            med = dt[:, h].median().item()
            medc = dt[:, h].clamp(min=common.TIME_STEP_MIN).median().item()
            share = (dt[:, h] < common.TIME_STEP_MIN).float().mean().item()
            lines.append(f"| {i} | {h} | {A[h]:.2f} | {share:.2f} | {med:.2e} | {1 / (abs(A[h]) * med):,.0f} | {1 / (abs(A[h]) * medc):,.0f} |")
    text = "\n".join(lines) + "\n"
    (common.OUT / "layers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
