"""vLLM serves the Nemotron-H function transformers trained: with hybridkv's general plugin
(`integrations/vllm/mamba_floor.py`) vLLM's Mamba-2 prefill clamps the step size at the config's
`time_step_min` as transformers does, so teacher-forced log-probs agree to float32 round-off; the same
prompt without the floor (vLLM as shipped) parts by far more (results/vllm-nemotron-h-divergence/)."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from hybridkv.eval.workloads import get_workload  # noqa: E402
from hybridkv.models.tokenizer import load_tokenizer  # noqa: E402
from hybridkv.serving.server import Server, ServerSpec  # noqa: E402

MODEL = Path(__file__).parent.parent / "hybridkv" / "models" / "weights" / "tiny-nemotron-h"


def transformers_logprobs(ids: list[int], floor: bool) -> torch.Tensor:
    """log p(token i | tokens < i) for i ≥ 1, transformers float32; `floor=False` builds the mixer
    with time_step_min 0, which is vLLM's unclamped scan."""
    config = AutoConfig.from_pretrained(MODEL)
    if not floor:
        config = copy.deepcopy(config)
        config.time_step_min = 0.0
    model = AutoModelForCausalLM.from_pretrained(MODEL, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_served_float32_logprobs_equal_transformers_with_its_time_step_floor(tmp_path):
    tokenizer = load_tokenizer(str(MODEL))
    sample = get_workload("ruler").generate("niah_single_1", 2048, 1, tokenizer, 3)[0]
    ids = tokenizer.encode(sample.context + sample.question + f" {sample.golds[0]}.")
    spec = ServerSpec(model=str(MODEL), config="no-cache", max_model_len=2304, extra_args=("--dtype", "float32"))
    with Server(spec, tmp_path / "server.log") as server:
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": str(MODEL), "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0},
            timeout=300.0,
        ).json()
    assert "clamps dt at time_step_min" in (tmp_path / "server.log").read_text(), "the plugin did not reach the engine"
    positions = reply["choices"][0]["prompt_logprobs"][1:]
    served = torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(positions, ids[1:], strict=True)])
    with_floor, without = transformers_logprobs(ids, True), transformers_logprobs(ids, False)
    # The prompt exercises the floor: without it transformers itself moves by far more than round-off.
    assert (with_floor - without).abs().max() > 0.05
    # float32 on both sides, different kernels (vLLM's CPU scan, transformers' chunked one): round-off.
    assert (served - with_floor).abs().max() < 2e-3
