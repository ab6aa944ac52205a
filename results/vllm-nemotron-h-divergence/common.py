"""Shared pieces of the vLLM-vs-transformers divergence study on tiny-nemotron-h (issue #45 §4).

Not a script: `teacher_force.py`, `layers.py`, `generate.py` and `repro_plain_vllm.py` import it.

- `sequences(...)`: the arena's RULER niah 2K samples as byte-token ids (context + question, as
  hybridkv's served arena sends them: UTF-8 byte + 3, no BOS), plus an answer " <gold>.\n".
- `hf_model(dtype, dt_min)`: transformers' NemotronHForCausalLM. `dt_min=None` keeps transformers'
  own clamp (its Mamba-2 mixer clamps softplus(dt + dt_bias) at `config.time_step_min` = 1e-3 in
  the chunked scan, and not at all in its one-token recurrent step); `dt_min=0.0` removes it.
- `vllm_engine(dtype)` + `set_vllm_dt_min(mode, value)`: vLLM's in-process LLM, and a switch that
  wraps vLLM's Mamba-2 kernels (mamba_mixer2's `mamba_chunk_scan_combined_varlen` for prefill,
  `selective_state_update` for decode) so that softplus(dt + dt_bias) is clamped at `value`:
  mode "none" (vLLM as shipped), "prefill" (what transformers does) or "all".
- hooks capturing, per decoder layer, the residual stream after the layer, the mixer's output and,
  for Mamba-2 layers, the scan output y (before the gated norm) and the dt each head used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# one thread, engine in this process (hooks and monkeypatches reach the model)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "hybridkv/models/weights/tiny-nemotron-h"
ARENA = ROOT / "results/arena-vllm-nemotron-h-2k"
OUT = Path(__file__).resolve().parent
OFFSET = 3  # hybridkv's ByteTokenizer: byte b is token b + 3; 0 pad, 1 bos, 2 eos
EOS = 2
TIME_STEP_MIN = 1e-3  # config.json's time_step_min (transformers clamps dt at it)

# 5 samples on which served `full` runs on past the answer, 1 on which it changes a digit,
# 2 on which everything agrees
DEFAULT_IDS = [
    "niah_single_2-2048-0", "niah_single_2-2048-6", "niah_single_2-2048-8", "niah_single_2-2048-14",
    "niah_single_2-2048-26", "niah_single_1-2048-19", "niah_single_1-2048-0", "niah_single_1-2048-1",
]  # fmt: skip


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode("utf-8")]


def decode(ids) -> str:
    return bytes(i - OFFSET for i in ids if OFFSET <= i < 256 + OFFSET).decode("utf-8", errors="replace")


def samples() -> dict[str, dict]:
    rows = [json.loads(line) for line in open(ARENA / "samples.jsonl")]
    return {r["id"]: r for r in rows}


def prompt_of(sample: dict) -> tuple[list[int], list[int]]:
    """(context ids, question ids), as hybridkv's served arena builds them."""
    segments = sample["chunks"] or [sample["context"]]
    context = [t for seg in segments for t in encode(seg)]
    return context, encode(sample["question"])


def sequence(sample: dict) -> tuple[list[int], int]:
    """prompt + " <gold>.\\n" (teacher-forced answer); returns (ids, prompt length)."""
    context, question = prompt_of(sample)
    prompt = context + question
    return prompt + encode(f" {sample['golds'][0]}.\n"), len(prompt)


def arena_rows(sub: str = "") -> dict[tuple[str, str, object], dict]:
    path = ARENA / sub / "results.jsonl"
    rows = [json.loads(line) for line in open(path)]
    return {(r["id"], r["method"], r.get("budget")): r for r in rows}


# ---------------------------------------------------------------- transformers


def hf_model(dtype: torch.dtype = torch.float32, dt_min: float | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(WEIGHTS), dtype=dtype).eval()
    if dt_min is not None:
        for layer in model.model.layers:
            if hasattr(layer.mixer, "time_step_limit"):
                layer.mixer.time_step_limit = (dt_min, float("inf"))
    return model


def hf_hooks(model, store: dict) -> list:
    """Capture into `store` (first call per key only; clear `store` to re-arm)."""
    handles = []

    def keep(key, value):
        if key not in store:
            store[key] = value.detach().float()[0].clone()

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: keep(f"stream.{i}", o)))
        handles.append(layer.mixer.register_forward_hook(lambda m, a, o, i=i: keep(f"mixer.{i}", o[0] if isinstance(o, tuple) else o)))
        handles.append(layer.norm.register_forward_hook(lambda m, a, o, i=i: keep(f"norm.{i}", o)))
        if hasattr(layer.mixer, "dt_bias"):
            mixer = layer.mixer
            handles.append(mixer.norm.register_forward_pre_hook(lambda m, a, i=i: keep(f"y.{i}", a[0])))
            handles.append(mixer.in_proj.register_forward_hook(
                lambda m, a, o, i=i, mx=mixer: keep(f"dt.{i}", F.softplus(o[..., -mx.num_heads:].float() + mx.dt_bias.float()))
            ))  # fmt: skip
    handles.append(model.model.norm_f.register_forward_hook(lambda m, a, o: keep("norm_f", o)))
    return handles


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------- vLLM

_DT = {"mode": "none", "value": TIME_STEP_MIN}


def set_vllm_dt_min(mode: str, value: float = TIME_STEP_MIN) -> None:
    """'none' (vLLM as shipped), 'prefill' (clamp in the chunked scan only, as transformers) or 'all'."""
    assert mode in ("none", "prefill", "all")
    _DT["mode"], _DT["value"] = mode, value


def _install_dt_patch() -> None:
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mm2

    if getattr(mm2, "_divergence_patched", False):
        return
    scan, ssu = mm2.mamba_chunk_scan_combined_varlen, mm2.selective_state_update

    def scan_clamped(*args, **kwargs):
        if _DT["mode"] in ("prefill", "all"):
            kwargs["dt_limit"] = (_DT["value"], float("inf"))
        return scan(*args, **kwargs)

    def ssu_clamped(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, **kwargs):
        if _DT["mode"] == "all":
            eff = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
            eff = F.softplus(eff) if dt_softplus else eff
            dt = eff.clamp(min=_DT["value"]).to(dt.dtype)
            dt_bias = torch.zeros_like(dt_bias) if dt_bias is not None else None
            dt_softplus = False
        return ssu(state, x, dt, A, B, C, D, dt_bias, dt_softplus=dt_softplus, **kwargs)

    mm2.mamba_chunk_scan_combined_varlen = scan_clamped
    mm2.selective_state_update = ssu_clamped
    mm2._divergence_patched = True


def vllm_engine(dtype: str = "bfloat16", ssm_dtype: str = "float32", max_len: int = 2400, **extra):
    from vllm import LLM

    _install_dt_patch()
    args = dict(
        model=str(WEIGHTS), skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, max_model_len=max_len,
        max_num_batched_tokens=max_len, enable_prefix_caching=False, mamba_ssm_cache_dtype=ssm_dtype, seed=0,
        max_logprobs=20,
    )  # fmt: skip
    args.update(extra)
    return LLM(**args)


_VSTORE: dict = {}
_VARMED = {"on": False}


def vllm_hooks(llm) -> None:
    """Install capture hooks inside the in-process engine; `vllm_capture(llm, ids)` uses them."""

    def install(model):
        def keep(key, value):
            if _VARMED["on"] and key not in _VSTORE:
                _VSTORE[key] = value.detach().float().clone()

        layers = model.model.layers
        for i, layer in enumerate(layers):
            # vLLM's layers return (output, residual); the residual stream after layer i is their sum
            layer.register_forward_hook(lambda m, a, o, i=i: keep(f"stream.{i}", o[0].float() + o[1].float()))
            layer.mixer.register_forward_hook(lambda m, a, o, i=i: keep(f"mixer.{i}", o[0] if isinstance(o, tuple) else o))
            layer.norm.register_forward_hook(lambda m, a, o, i=i: keep(f"norm.{i}", o[0] if isinstance(o, tuple) else o))
            if hasattr(layer.mixer, "dt_bias"):
                mixer = layer.mixer
                mixer.norm.register_forward_pre_hook(lambda m, a, i=i: keep(f"y.{i}", a[0]))
                nh, inter = mixer.tped_dt_size, mixer.tped_intermediate_size
                mixer.in_proj.register_forward_hook(
                    lambda m, a, o, i=i, mx=mixer, nh=nh: keep(
                        f"dt.{i}", F.softplus((o[0] if isinstance(o, tuple) else o)[..., -nh:].float() + mx.dt_bias.float())
                    )
                )  # fmt: skip
        model.model.norm_f.register_forward_hook(lambda m, a, o: keep("norm_f", o[0] if isinstance(o, tuple) else o))
        return True

    llm.apply_model(install)


def vllm_capture(llm, ids: list[int]) -> dict:
    """One full prefill of `ids` in vLLM; returns its captures and the logits at every position
    (the model's own compute_logits on the final norm's output, as prompt logprobs use it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _VSTORE.clear()
    _VARMED["on"] = True
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False),
        use_tqdm=False,
    )
    _VARMED["on"] = False
    store = {k: v[: len(ids)] for k, v in _VSTORE.items()}
    hidden = _VSTORE["norm_f"][: len(ids)]

    def logits(model):
        p = next(model.parameters())
        return model.compute_logits(hidden.to(p.dtype)).float()[:, :512].clone()

    store["logits"] = llm.apply_model(logits)[0]
    # cross-check: vLLM's own prompt logprobs name the same top-1 token as these logits
    top1 = [max(d.items(), key=lambda kv: kv[1].logprob)[0] if d else -1 for d in out[0].prompt_logprobs]
    store["prompt_top1"] = torch.tensor(top1[1:] + [-1])  # prompt_logprobs[t] scores token t (from t-1)
    return store


def vllm_greedy(llm, ids: list[int], max_tokens: int) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[EOS], detokenize=False),
        use_tqdm=False,
    )
    return [t for t in out[0].outputs[0].token_ids if t != EOS]
