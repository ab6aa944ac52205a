"""HybridKVConnector inside real vLLM (the CPU build) on a tiny random-weight Qwen3-Next.

Engines: vLLM alone (the reference: a full prefill of every prompt), vLLM with the connector on a
redis store, a second engine process on the same store, and one whose store is killed mid-run.
vLLM's block here is 640 tokens; prompts end off that grid.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's CPU engine reserves one core for its own processes, and one more once any KV connector is
# configured (vllm/utils/ompmultiprocessing.py), so on a 2-core machine vLLM alone ran 1 OpenMP thread
# and vLLM with a connector 2. bf16 GEMMs split over another number of threads round differently on
# some CPUs (by up to 4e-3 in logprob on an AMD EPYC). Every engine here reserves the same one core.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

from vllm import LLM, SamplingParams  # noqa: E402

from hybridkv.serving.models import write_servable  # noqa: E402
from tests.helpers import flip_one_weight_in_the_middle  # noqa: E402

TOP = 5


def connector_config(store: str, **extra) -> dict:
    return {
        "kv_connector": "HybridKVConnector",
        "kv_connector_module_path": "hybridkv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, **extra},
    }


# Where the exact-checkpoint tests resume. vLLM's own result depends on where a prefill is split (on
# an AMD EPYC a prefill split at 1,900 tokens moves the second decode step's logprobs by 0.14 against
# one unsplit pass), so a resume from the exact state at 1,900 is held to vLLM prefilling the same
# prompt in chunks of 1,900 tokens: the same computation, bit for bit.
EXACT_AT = 1900


def make_engine(model, kv_transfer_config: dict | None = None, prefill_chunk: int = 8192) -> LLM:
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=8192,
        max_num_batched_tokens=prefill_chunk,
        dtype="bfloat16",
        # vLLM's CPU build keeps linear states in float32 where the CPU has AVX-512-BF16 and in bf16
        # elsewhere when left on auto, which also moves the block grid: the same on every CPU here.
        mamba_ssm_cache_dtype="float32",
        seed=0,
        kv_transfer_config=kv_transfer_config,
    )


def pool_layout(llm: LLM) -> list[int]:
    """The block size of each of the running engine's KV-cache groups, as its scheduler holds them
    (a linear-state group's block spans the whole model length: a request holds one)."""
    return [group["block_size"] for group in llm.llm_engine.engine_core.call_utility("get_kv_cache_group_metadata")]


def blocks_held(layout: list[int], tokens: int) -> int:
    """Blocks of the pool a request of `tokens` tokens holds: in each group, one per block begun."""
    return sum(math.ceil(tokens / size) for size in layout)


def shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def run(llm: LLM, prompts: list[list[int]], budget=None) -> list[dict]:
    extra = {"kv_transfer_params": {"replay_budget": budget}} if budget is not None else None
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=TOP, detokenize=False, extra_args=extra)
    return [result(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def result(output) -> dict:
    """A request's greedy tokens, top-k logprobs per step, and the connector's reuse record."""
    return {
        "tokens": list(output.outputs[0].token_ids),
        "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs],
        "reuse": (output.kv_transfer_params or {}).get("hybridkv"),
    }


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# Two runs that compute the same thing by different code paths (another prefill split, another
# OpenMP thread count, a kernel chosen for this CPU's ISA) differ by bf16 rounding: bf16 keeps 8
# significant bits (unit roundoff 2^-9 ≈ 2e-3), so a logprob of size ~5 after a dozen bf16 layers
# moves by a few of its ulps: 0.02 is the least tolerance that resolution allows. How far it moves on
# this machine is measured (`bf16_logprob_tol`); exactness is claimed bit for bit only between runs
# of one code path.
BF16_LOGPROB_RESOLUTION = 0.02


def assert_agrees(got: dict, want: dict, tol: float) -> None:
    """Two greedy runs of one prompt agree within `tol`, step by step.

    While both runs have produced the same tokens, the top-k logprobs both report at the next step
    differ by less than `tol`. Where the chosen tokens differ, that step must be a near-tie in the
    reference (its top-1 lead under 2·tol, so noise of `tol` on each side may flip the argmax, as it
    does on a random-weight model's near-uniform distribution); the runs then condition on different
    tokens and later steps are not compared.
    """
    steps = zip(got["tokens"], want["tokens"], got["logprobs"], want["logprobs"], strict=True)
    for step, (got_token, want_token, got_lp, want_lp) in enumerate(steps):
        shared = got_lp.keys() & want_lp.keys()
        assert shared, f"step {step}: no top-k token in common"
        gap = max(abs(got_lp[t] - want_lp[t]) for t in shared)
        assert gap < tol, f"step {step}: logprobs differ by {gap:.2e} (tolerance {tol})"
        if got_token != want_token:
            first, second = sorted(want_lp.values(), reverse=True)[:2]
            assert first - second < 2 * tol, (
                f"step {step}: tokens {got_token} != {want_token} with a lead of {first - second:.2e}"
            )
            return


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_servable(tmp_path_factory.mktemp("vllm") / "grid-640", "grid-640")


@pytest.fixture(scope="module")
def alone(checkpoint):
    llm = make_engine(checkpoint)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def split_at_exact(checkpoint):
    """vLLM alone, prefilling in chunks of EXACT_AT tokens: its own state carried across the split."""
    llm = make_engine(checkpoint, prefill_chunk=EXACT_AT)
    yield llm
    shutdown(llm)


def largest_gap_while_agreeing(got: dict, want: dict) -> float:
    """The largest logprob difference of a top-k token both runs report, over the steps up to and
    including the first at which their tokens differ (after it they condition on different tokens)."""
    gap = 0.0
    for got_token, want_token, got_lp, want_lp in zip(
        got["tokens"], want["tokens"], got["logprobs"], want["logprobs"], strict=True
    ):
        gap = max([gap, *(abs(got_lp[t] - want_lp[t]) for t in got_lp.keys() & want_lp.keys())])
        if got_token != want_token:
            break
    return gap


@pytest.fixture(scope="module")
def bf16_logprob_tol(alone, split_at_exact) -> float:
    """How far vLLM alone moves from itself in bf16 when its prefill is split elsewhere, measured on
    this machine (AMX, AVX-512-bf16 and AVX2 kernels round differently) at the first step of two
    prompts like the tests'. A resume re-shapes the computation at most twice (the passes that wrote
    the pages, then the pass that continues from them), so by the triangle inequality it lies within
    twice that of vLLM alone; never less than bf16's own resolution."""
    probes = [tokens(EXACT_AT + 200, seed=90 + i) for i in range(2)]
    measured = 0.0
    for split, whole in zip(run(split_at_exact, probes), run(alone, probes), strict=True):
        split_lp, whole_lp = split["logprobs"][0], whole["logprobs"][0]
        measured = max([measured, *(abs(split_lp[t] - whole_lp[t]) for t in split_lp.keys() & whole_lp.keys())])
    return max(BF16_LOGPROB_RESOLUTION, 2 * measured)


def first_step(result: dict) -> dict:
    return {**result, "tokens": result["tokens"][:1], "logprobs": result["logprobs"][:1]}


@pytest.fixture(scope="module")
def with_connector(checkpoint, redis_server):
    llm = make_engine(checkpoint, connector_config(redis_server.url, replay_budget=0.05))
    yield llm
    shutdown(llm)


def test_the_engine_runs_the_kernels_vllm_chooses_for_this_cpu(alone):
    """vLLM loads `_C` where torch reports AVX-512-BF16, `_C_AVX512` where it reports AVX-512 alone,
    `_C_AVX2` below that. Under HYBRIDKV_CPU_ISA=avx512 (scripts/test.sh's second pass) torch reports
    no AVX-512-BF16: this shows the emulation reached the engine's own processes, oneDNN's cap with it."""
    import psutil
    import torch

    if not torch.cpu._is_avx512_supported():
        want = "_C_AVX2.abi3.so"
    else:
        want = "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
    engines = {}
    for child in psutil.Process().children(recursive=True):
        try:
            maps = Path(f"/proc/{child.pid}/maps").read_text()
            environment = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        loaded = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/vllm/_C" in line}
        if loaded:
            cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
            engines[child.pid] = (loaded, cap is None or f"ONEDNN_MAX_CPU_ISA={cap}".encode() in environment)
    assert engines, "no engine process has vLLM's kernels loaded"
    for pid, (loaded, same_onednn_cap) in engines.items():
        assert loaded == {want}, f"engine process {pid} loaded {loaded}, not {want}"
        assert same_onednn_cap, f"engine process {pid} runs without this run's ONEDNN_MAX_CPU_ISA"


def test_a_budget_covering_the_whole_match_answers_exactly_as_vllm_alone(
    alone, with_connector, checkpoint, bf16_logprob_tol
):
    first = tokens(2000, seed=1)
    run(with_connector, [first])  # stored
    prompt = first[:1500] + tokens(300, seed=2)
    (got,) = run(with_connector, [prompt], budget=1.0)
    assert got["reuse"] == {"matched": 1500, "reused": 0, "exact_state": False}
    (want,) = run(alone, [prompt])
    # With the same thread count this matched vLLM alone bit for bit (AMD EPYC), but vLLM alone has no
    # connector hooks at all: it is held to bf16 noise, the do-nothing connector to every bit.
    assert_agrees(got, want, bf16_logprob_tol)
    # Bit for bit, it answers as vLLM with a connector that does nothing: the same code path.
    control = make_engine(checkpoint, {**connector_config(""), "kv_connector": "NoOpConnector",
                                       "kv_connector_module_path": "tests.vllm_noop_connector"})  # fmt: skip
    try:
        (plain,) = run(control, [prompt])
    finally:
        shutdown(control)
    assert got["tokens"] == plain["tokens"] and got["logprobs"] == plain["logprobs"]


def test_resuming_from_an_exact_checkpoint_answers_as_vllm_split_there(
    alone, split_at_exact, with_connector, bf16_logprob_tol
):
    turn = tokens(EXACT_AT, seed=3)
    run(with_connector, [turn])  # stores its blocks and its linear states after its last token
    prompt = turn + tokens(200, seed=4)
    (got,) = run(with_connector, [prompt])
    assert got["reuse"] == {"matched": EXACT_AT, "reused": EXACT_AT, "exact_state": True}
    (split,) = run(split_at_exact, [prompt])
    assert got["tokens"] == split["tokens"] and got["logprobs"] == split["logprobs"]
    (want,) = run(alone, [prompt])
    assert_agrees(first_step(got), first_step(want), bf16_logprob_tol)  # bf16 noise of a different prefill split


def test_tail_replay_reuses_all_but_the_tail_and_stays_close_to_full_prefill(alone, with_connector):
    document = tokens(2400, seed=5)
    run(with_connector, [document])
    prompt = document[:2300] + tokens(150, seed=6)
    (got,) = run(with_connector, [prompt])
    assert got["reuse"] == {"matched": 2300, "reused": 2300 - round(0.05 * 2300), "exact_state": False}
    (want,) = run(alone, [prompt])
    assert_agrees(got, want, 0.1)  # zero state at s: approximate, unlike the checkpoint


SECOND_PROCESS = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from tests.test_vllm_connector import connector_config, make_engine, run, shutdown

    def main():
        model, store, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        llm = make_engine(model, connector_config(store))
        print("REUSE " + json.dumps(run(llm, [prompt])[0]["reuse"]), flush=True)
        shutdown(llm)

    if __name__ == "__main__":
        main()
    """
)


def test_two_engine_processes_share_one_store(
    alone, split_at_exact, with_connector, checkpoint, redis_server, tmp_path, bf16_logprob_tol
):
    shared = tokens(EXACT_AT, seed=7)
    script = tmp_path / "second_engine.py"
    script.write_text(SECOND_PROCESS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(script), str(checkpoint), redis_server.url, json.dumps(shared)],
        capture_output=True, text=True, timeout=600, env=env, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("REUSE ")]
    assert json.loads(line.removeprefix("REUSE ")) == {"matched": 0, "reused": 0, "exact_state": False}
    prompt = shared + tokens(100, seed=8)
    (got,) = run(with_connector, [prompt])  # this engine never saw `shared`
    assert got["reuse"] == {"matched": EXACT_AT, "reused": EXACT_AT, "exact_state": True}
    (split,) = run(split_at_exact, [prompt])
    assert got["tokens"] == split["tokens"] and got["logprobs"] == split["logprobs"]
    (want,) = run(alone, [prompt])
    assert_agrees(first_step(got), first_step(want), bf16_logprob_tol)


def test_two_checkpoints_differing_in_one_middle_weight_never_share_a_page(
    checkpoint, with_connector, redis_server, tmp_path
):
    """One weight in the middle of a weight file makes another model: the connector of a
    checkpoint that differs from the stored one only there misses its pages (a hit would serve
    one model the other's KV), and still hits its own."""
    other = tmp_path / "one-weight-changed"
    shutil.copytree(checkpoint, other)
    (weights,) = other.glob("*.safetensors")
    assert weights.stat().st_size > 4 << 20  # the middle lies past the first and last MiB
    flip_one_weight_in_the_middle(weights)
    assert weights.stat().st_size == (checkpoint / weights.name).stat().st_size
    stored = tokens(1200, seed=17)
    run(with_connector, [stored])
    llm = make_engine(other, connector_config(redis_server.url))
    try:
        (got,) = run(llm, [stored + tokens(60, seed=18)])
        (again,) = run(llm, [stored + tokens(60, seed=19)])
    finally:
        shutdown(llm)
    assert got["reuse"] == {"matched": 0, "reused": 0, "exact_state": False}
    assert again["reuse"]["matched"] >= 1200  # its own pages, stored by the request before


def test_a_store_killed_mid_run_leaves_every_request_answered(alone, checkpoint, redis_factory, bf16_logprob_tol):
    server = redis_factory()
    llm = make_engine(checkpoint, connector_config(server.url))
    try:
        first = tokens(1700, seed=9)
        run(llm, [first])
        server.kill()
        prompts = [first + tokens(60, seed=10), tokens(900, seed=11), first[:1000] + tokens(50, seed=12)]
        got = run(llm, prompts)
        want = run(alone, prompts)
        for g, w in zip(got, want, strict=True):
            assert g["reuse"]["reused"] == 0  # nothing could be read: full prefill
            assert len(g["tokens"]) == 4
            assert_agrees(g, w, bf16_logprob_tol)
            assert all(math.isfinite(lp) for step in g["logprobs"] for lp in step.values())
    finally:
        shutdown(llm)


def test_a_request_preempted_after_its_load_is_recomputed_and_answers_as_vllm_alone(alone, checkpoint, redis_factory):
    """vLLM preempts a running request when the KV pool runs out, frees its blocks and later asks the
    connector again from zero computed tokens: the loaded pages are gone with the blocks, so the
    connector must answer "nothing to load" and vLLM computes the request in full.

    The pool is sized from the engine's own layout (block size per group, read from the running
    engine: it differs between CPUs): it holds two prompts that end 40 tokens short of an attention
    block's end, so two run at once and the first to decode 40 tokens finds no free block.

    Under that pressure vLLM batches and splits the prefills differently from an unhurried run, and
    bf16 rounding on this random-weight model moves logprobs by more than bf16_logprob_tol (up to
    0.19 over 100 steps on an AMD EPYC). How far is measured here, with vLLM alone put through the
    same two re-shapings: the same pool pressure, and its prefill split at 1,000 tokens (where the
    connector's exact resume is bit-equal to that split). The outputs are held to twice the larger:
    a request computed from garbage pages or the wrong slot fails it; a small error in a linear
    state would not, and the exact-resume tests cover that."""
    server = redis_factory()
    layout = pool_layout(alone)  # the same model and dtypes as the engine under pressure
    attention = min(layout)
    length = math.ceil((1000 + 50 + 40) / attention) * attention - 40  # 40 short of a block's end
    pool = 2 * blocks_held(layout, length) + 1  # two such requests, and vLLM's null block
    read = f"groups' block sizes {layout}, prompts of {length} tokens, a pool of {pool} blocks"

    def under_pressure(kv_transfer_config: dict | None) -> LLM:
        return LLM(
            model=str(checkpoint), skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False,
            max_model_len=2048, dtype="bfloat16", mamba_ssm_cache_dtype="float32", seed=0,
            kv_transfer_config=kv_transfer_config, num_gpu_blocks_override=pool, disable_log_stats=False,
        )  # fmt: skip

    llm = under_pressure(connector_config(server.url))

    def preemptions() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")

    try:
        # the engine under pressure lays its pool out as the one the pool was sized from
        assert [min(s, 2048) for s in pool_layout(llm)] == [min(s, 2048) for s in layout], read
        prefixes = [tokens(1000, seed=20 + i) for i in range(4)]
        run(llm, prefixes)  # saved, each with its exact state at 1,000
        prompts = [prefix + tokens(length - 1000, seed=30 + i) for i, prefix in enumerate(prefixes)]
        params = SamplingParams(max_tokens=100, temperature=0.0, logprobs=TOP, detokenize=False, ignore_eos=True)
        before = preemptions()
        got = [result(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert preemptions() > before, f"the pool never ran out: {read}"
        assert all(g["reuse"]["matched"] == 1000 for g in got)
        assert any(g["reuse"]["reused"] == 0 for g in got)  # a load taken back by the preemption
    finally:
        shutdown(llm)

    def answers(engine: LLM) -> list[dict]:
        return [result(o) for o in engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    want = answers(alone)
    noise = 0.0
    for reshaped in (lambda: under_pressure(None), lambda: make_engine(checkpoint, prefill_chunk=1000)):
        engine = reshaped()
        try:
            noise = max(
                [noise, *(largest_gap_while_agreeing(r, w) for r, w in zip(answers(engine), want, strict=True))]
            )
        finally:
            shutdown(engine)
    for g, w in zip(got, want, strict=True):
        assert len(g["tokens"]) == 100
        assert all(math.isfinite(lp) for step in g["logprobs"] for lp in step.values())
        # loaded from the exact state at 1,000, or recomputed in full
        assert_agrees(g, w, max(BF16_LOGPROB_RESOLUTION, 2 * noise))


def test_a_calibrated_horizon_caps_the_replay(checkpoint, redis_server, tmp_path):
    """With "replay_horizon": "calibrated" the connector reads `hybridkv calibrate`'s file beside the
    model and replays min(horizon, budget): 40 tokens here instead of 5% of 2,300 (115)."""
    import shutil

    from hybridkv.models.calibration import CALIBRATION_FILE, Calibration

    model = tmp_path / "calibrated"
    shutil.copytree(checkpoint, model)
    Calibration(str(model), 0.01, 0.95, 1024, 1, "random token ids", 40, [40]).write(model / CALIBRATION_FILE)
    llm = make_engine(model, connector_config(redis_server.url, replay_budget=0.05, replay_horizon="calibrated"))
    try:
        document = tokens(2400, seed=13)
        run(llm, [document])
        (got,) = run(llm, [document[:2300] + tokens(100, seed=14)])
        (capped,) = run(llm, [document[:1000] + tokens(100, seed=15)], budget="16tok")  # the budget is shorter
    finally:
        shutdown(llm)
    assert got["reuse"] == {"matched": 2300, "reused": 2300 - 40, "exact_state": False}
    assert capped["reuse"] == {"matched": 1000, "reused": 1000 - 16, "exact_state": False}
