"""Makes this process, and every Python process it starts, take the kernels vLLM's CPU build and
oneDNN take on a CPU with AVX-512 but neither AVX-512-BF16 nor AMX (an Intel Xeon seen in CI).

Active only while `HYBRIDKV_CPU_ISA=avx512` is set and this folder is on PYTHONPATH (Python imports
`sitecustomize` at start-up, so vLLM's engine processes and `vllm serve` servers, started with this
environment, apply it too). `scripts/test.sh` runs the vLLM tests a second time this way; what it
can and cannot force is in docs/design.md ("Two kinds of x86 CPU").

- vLLM decides by `torch.cpu`'s capability flags: without `avx512_bf16` it loads `_C_AVX512`
  instead of `_C`, runs Gated DeltaNet's causal conv on its plain-torch fallback, and leaves
  `VLLM_SSM_CONV_STATE_LAYOUT` unset; without `amx_tile` it skips its AMX attention, GEMM and MoE
  kernels. Those flags are read from cpuinfo once and cached, so the mapping is replaced here.
- oneDNN (torch's and vLLM's bf16 GEMMs) asks the CPU itself; `ONEDNN_MAX_CPU_ISA` caps it at
  AVX-512 with VNNI, which has no bf16 dot-product instructions.
"""

import os

EMULATED = {"avx512": ("AVX512_CORE_VNNI", ("avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16"))}


def _emulate(name: str) -> None:
    if name not in EMULATED:
        raise SystemExit(f"HYBRIDKV_CPU_ISA={name!r}: not one this hook emulates ({', '.join(EMULATED)})")
    onednn_isa, removed = EMULATED[name]
    os.environ["ONEDNN_MAX_CPU_ISA"] = onednn_isa
    from types import MappingProxyType

    import torch.cpu

    real = dict(torch.cpu.get_capabilities())
    if not real.get("avx512_f"):
        raise SystemExit(f"HYBRIDKV_CPU_ISA={name}: this CPU has no AVX-512 to emulate it with")
    emulated = MappingProxyType({**real, **dict.fromkeys(removed, False)})
    torch.cpu.get_capabilities = lambda: emulated


if os.environ.get("HYBRIDKV_CPU_ISA"):
    _emulate(os.environ["HYBRIDKV_CPU_ISA"])
