"""The arena through real `vllm serve` processes on the trained servable model (tiny-qwen3-next-vllm).

The model solves RULER's single-needle tasks at 1K, so its answers are decisive (not the
near-uniform greedy picks of a random-weight model): served answers can be compared exactly.
"""

from __future__ import annotations

import json
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from hybridkv.errors import HybridKVError  # noqa: E402
from hybridkv.eval.arena import ArenaPlan, read_rows  # noqa: E402
from hybridkv.eval.metrics import kl_mean  # noqa: E402
from hybridkv.eval.workloads import get_workload  # noqa: E402
from hybridkv.methods import Budget  # noqa: E402
from hybridkv.models.tiny import WEIGHTS_DIR  # noqa: E402
from hybridkv.models.tokenizer import load_tokenizer  # noqa: E402
from hybridkv.serving.arena import run_served_arena, served_grid  # noqa: E402
from hybridkv.serving.bench import first_token_fidelity  # noqa: E402
from hybridkv.serving.server import Server, ServerSpec  # noqa: E402
from hybridkv.store.codec import Entry, decode, encode  # noqa: E402

MODEL = WEIGHTS_DIR / "tiny-qwen3-next-vllm"


@pytest.fixture(scope="module")
def needles():
    """Two samples of each single-needle task at 1K, the model's own tokenizer."""
    tokenizer = load_tokenizer(str(MODEL))
    ruler = get_workload("ruler")
    found = [s for task in ("niah_single_1", "niah_single_2") for s in ruler.generate(task, 1024, 2, tokenizer, 7)]
    return tokenizer, ruler, found


def test_served_answers_from_exact_pages_equal_vllm_alones(needles, tmp_path):
    """At budget 1.0 the connector replays the whole match; with stored states it resumes from the
    exact state at the context's end: both answer every sample as vLLM without a cache does."""
    tokenizer, ruler, samples = needles
    plan = ArenaPlan("ruler", ["full", "tail-replay@1.0", "checkpoint"], [])
    run_served_arena(str(MODEL), tokenizer, samples, plan, tmp_path, ruler.score, horizon=lambda: 0,
                     show_progress=False)  # fmt: skip
    rows = read_rows(tmp_path / "results.jsonl")
    assert len(rows) == 3 * len(samples) and all(r["engine"] == "vllm" for r in rows)
    by = {(r["id"], r["method"]): r for r in rows}
    for sample in samples:
        full, replay, checkpoint = (by[(sample.id, m)] for m in ("full", "tail-replay", "checkpoint"))
        assert full["score"] == 1.0  # the model answers it: the comparison means something
        assert replay["prediction"] == full["prediction"] and checkpoint["prediction"] == full["prediction"]
        context = full["context_tokens"]
        # the whole context matched; budget 1.0 recomputed all of it, the checkpoint none of it
        assert (replay["matched_tokens"], replay["reused_tokens"], replay["replayed_tokens"]) == (context, 0, context)
        assert (checkpoint["matched_tokens"], checkpoint["reused_tokens"]) == (context, context)
        assert checkpoint["exact_state"] is True and checkpoint["replayed_tokens"] == 0
        for row in (full, replay, checkpoint):  # the engine's first token, apart from the whole answer
            assert 0 < row["ttft_s"] < row["latency_s"]


def test_questions_on_one_shared_context_hit_its_one_served_request_and_resume_exactly(monkeypatch, tmp_path):
    """`rag-shared`: three questions on one retrieved set. The context goes to the server once;
    every question is a hit on it, and with stored states each resumes from the exact state at
    the context's end, though the second and third match past it, through the first question's
    block (the questions share their opening words), which marks no state there."""
    from hybridkv.serving import arena

    tokenizer, rag = load_tokenizer(str(MODEL)), get_workload("rag")
    samples = rag.generate("rag-shared", 2048, 3, tokenizer)
    context = tokenizer.encode(samples[0].context)
    sent: list[tuple[str, int]] = []  # (namespace, max_tokens) of every context-only request
    real = arena.generate

    def spy(client, server, prompt, max_tokens, *args, **kwargs):
        if prompt == context:
            sent.append((args[1], max_tokens))
        return real(client, server, prompt, max_tokens, *args, **kwargs)

    monkeypatch.setattr(arena, "generate", spy)
    run_served_arena(str(MODEL), tokenizer, samples, ArenaPlan("rag", ["full", "checkpoint"], []), tmp_path,
                     rag.score, horizon=lambda: 0, show_progress=False)  # fmt: skip
    assert sent == [("checkpoint-None-0", 1)]  # once, in the checkpoint's namespace; full sends none
    by = {(r["id"], r["method"]): r for r in read_rows(tmp_path / "results.jsonl")}
    assert sum(by[(s.id, "full")]["score"] for s in samples) >= 2  # the model answers: scores mean something
    for sample in samples:
        full, resumed = by[(sample.id, "full")], by[(sample.id, "checkpoint")]
        assert resumed["exact_state"] is True and resumed["reused_tokens"] == len(context)
        assert resumed["matched_tokens"] >= len(context) and resumed["score"] == full["score"]
    assert any(by[(s.id, "checkpoint")]["matched_tokens"] > len(context) for s in samples[1:])


def _entries(store: Path, kind: str) -> list[tuple[Path, Entry]]:
    """Every `kind` entry of a file store, decoded, with its path."""
    found = []
    for path in sorted(store.rglob("*.hkv")):
        data = path.read_bytes()
        header_length = struct.unpack_from("<4sHI", data)[2]  # the codec's documented prefix
        header = json.loads(data[10 : 10 + header_length])
        if header["kind"] == kind:
            found.append((path, decode(data, key=header["key"], fingerprint=header["fingerprint"])))
    return found


def _rewrite(path: Path, entry: Entry, pages: list) -> None:
    """Write `entry` back as a valid entry holding `pages`, which the connector trusts and loads."""
    tensors = dict(zip(entry.tensors, pages, strict=True))
    path.write_bytes(encode(Entry(entry.kind, entry.fingerprint, entry.key, entry.meta, tensors)))


def _rotate_states(store: Path) -> int:
    """Give each stored state entry's layers the next layer's state (real states of the model, in
    the wrong place). Returns how many entries it rewrote."""
    entries = _entries(store, "vllm-state")
    for path, entry in entries:
        pages = list(entry.tensors.values())
        assert len(pages) > 1
        _rewrite(path, entry, pages[1:] + pages[:1])
    return len(entries)


def _swap_attention(store: Path) -> set[tuple[int, tuple[int, ...]]]:
    """Give each stored attention block the page of a block at the same start holding other tokens
    (another prompt's stretch of context, so the positions stay right and the needle of the block's
    own prompt is gone from its pages), preferring one at least as long so that no slot is read
    that vLLM never wrote. Whole pages move: raw bytes moved inside a page would carry vLLM's unused
    padding into values, NaNs among them. Returns the (start, tokens) of the blocks it rewrote."""
    entries = _entries(store, "vllm-kv")
    swapped = set()
    for path, entry in entries:
        start, tokens = entry.meta["start"], entry.meta["tokens"]
        others = [e for _, e in entries if e.meta["start"] == start and e.meta["tokens"] != tokens]
        if not others:  # every prompt holds these very tokens here: nothing to swap for
            continue
        other = max(others, key=lambda e: len(e.meta["tokens"]))
        _rewrite(path, entry, list(other.tensors.values()))
        swapped.add((start, tuple(tokens)))
    return swapped


def _empty(store: Path) -> None:
    for path in store.rglob("*.hkv"):
        path.unlink()


# Every stretch of haystack is stored up to this token, so one vLLM alone prefilling in chunks of
# this many tokens splits each prompt where the connector's resume splits it: the same computation.
STRETCH_AT = 640
# A stretch is used only where transformers (float32) says its next token depends on the linear
# states (KL at least STATE_MATTERS with each layer's state given the next layer's, as the test
# scrambles them) and is no near-tie: its top-1 lead at least NEAR_TIE_LEAD nats in float32 and in
# bfloat16, and KL(float32 || bfloat16) at most NEAR_TIE_KL. On an Intel Xeon without AVX-512-BF16
# one prompt's token sat on a mixture-of-experts router near-tie (KL 0.36 between float32 and
# bfloat16; others at most 7e-5): where the prefill was split moved vLLM's answer on it by as much
# as a scrambled state moves others.
STATE_MATTERS = 0.05
NEAR_TIE_LEAD = 0.5
NEAR_TIE_KL = 1e-3


@dataclass
class Stretch:
    stored: list[int]  # STRETCH_AT tokens of haystack, stored with their final states
    more: list[int]  # the 4 tokens after them, computed on a hit
    bf16_kl: float  # KL(float32 || bfloat16) of transformers' next token: bf16's own noise here


def _next_token(model, stored: list[int], more: list[int], rotate: bool = False) -> torch.Tensor:
    """Transformers' next-token logits after `stored` + `more` [1, vocab]; with `rotate`, computed
    from each linear layer's state after `stored` moved to the layer before it."""
    from hybridkv.cache.assemble import assemble_cache
    from hybridkv.models import adapter

    cache = model.new_cache()
    model.forward(torch.tensor(stored), cache, 0)
    if rotate:
        states = adapter.read_states(model.description, cache)
        layers = sorted(states)
        rotated = {layer: states[other] for layer, other in zip(layers, layers[1:] + layers[:1], strict=True)}
        cache = assemble_cache(model, adapter.read_kv(model.description, cache), rotated)
    return model.forward(torch.tensor(more), cache, len(stored), 1)


def _lead(logits: torch.Tensor) -> float:
    """The top token's log-probability above the second's (a logit difference: the same)."""
    first, second = logits[0].topk(2).values
    return float(first - second)


@pytest.fixture(scope="module")
def stretches() -> list[Stretch]:
    """Four stretches of haystack, chosen in transformers (see STATE_MATTERS)."""
    from hybridkv.models import load_model

    tokenizer, ruler = load_tokenizer(str(MODEL)), get_workload("ruler")
    exact, rounded = load_model(str(MODEL)), load_model(str(MODEL), dtype=torch.bfloat16)
    candidates = [s for task in ("niah_single_1", "niah_single_2") for s in ruler.generate(task, 1024, 8, tokenizer, 7)]
    chosen, measured = [], []
    for sample in candidates:
        context = [t for piece in sample.segments() for t in tokenizer.encode(piece)]
        stored, more = context[:STRETCH_AT], context[STRETCH_AT : STRETCH_AT + 4]
        assert len(more) == 4
        a, b = _next_token(exact, stored, more), _next_token(rounded, stored, more)
        scrambled = _next_token(exact, stored, more, rotate=True)
        bf16_kl, state_kl, leads = kl_mean(a, b), kl_mean(a, scrambled), (_lead(a), _lead(b))
        measured.append(f"bf16 KL {bf16_kl:.1e}, state KL {state_kl:.3f}, leads {leads[0]:.2f}/{leads[1]:.2f}")
        if bf16_kl <= NEAR_TIE_KL and min(leads) >= NEAR_TIE_LEAD and state_kl >= STATE_MATTERS:
            chosen.append(Stretch(stored, more, bf16_kl))
        if len(chosen) == 4:
            return chosen
    raise AssertionError(f"too few stretches whose states matter, clear of a near-tie: {measured}")


def test_a_scrambled_state_or_attention_page_moves_what_the_server_answers(needles, stretches, tmp_path):
    """What the connector loads is what the server answers from: resumed from clean stored states
    it answers as vLLM alone splitting the prefill at the same token, to the bit (the same
    computation); with the stored linear states scrambled the first-token distribution moves far
    beyond how much vLLM's own answer moves when the prefill is split there instead of not at all;
    with each prompt's attention pages swapped for another prompt's at the same positions (this
    model reads its answer from attention) no answer holds its needle's value any more."""
    tokenizer, _, samples = needles
    store = tmp_path / "store"
    prompts = [
        ([t for piece in s.segments() for t in tokenizer.encode(piece)], tokenizer.encode(s.question)) for s in samples
    ]

    def post(server, prompt, salt, max_tokens=1) -> dict:
        body = {
            "model": str(MODEL),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "cache_salt": salt,
            "logprobs": 20,
            "return_tokens_as_token_ids": True,
        }
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).json()
        assert "choices" in reply, reply
        choice = reply["choices"][0]
        first = choice["logprobs"]["top_logprobs"][0]
        return {"tokens": choice["token_ids"], "hybridkv": (reply.get("kv_transfer_params") or {}).get("hybridkv"),
                "first": {int(k.removeprefix("token_id:")): v for k, v in first.items()}}  # fmt: skip

    def answers(server, namespace) -> list[dict]:
        return [post(server, c + q, f"{namespace}-{i}", 16) for i, (c, q) in enumerate(prompts)]

    def store_contexts(server, namespace) -> None:
        for i, (context, _) in enumerate(prompts):
            post(server, context, f"{namespace}-{i}")

    # A stored stretch of the haystack and 4 more of its tokens: the next token is language
    # modelling over the last few tokens, which the linear layers (short conv, fast decays) carry.
    def first_tokens(server, namespace) -> list[dict]:
        return [post(server, s.stored + s.more, f"{namespace}-{i}") for i, s in enumerate(stretches)]

    def store_stretches(server, namespace) -> None:
        for i, stretch in enumerate(stretches):
            post(server, stretch.stored, f"{namespace}-{i}")

    with Server(ServerSpec(str(MODEL), "no-cache", 2048), tmp_path / "alone.log") as server:
        alone = answers(server, "alone")
        alone_next = first_tokens(server, "alone")
    with Server(ServerSpec(str(MODEL), "no-cache", 2048, prefill_chunk=STRETCH_AT), tmp_path / "split.log") as server:
        split_next = first_tokens(server, "split")
    spec = ServerSpec(str(MODEL), "hybridkv", 2048, f"file://{store}", namespace=uuid.uuid4().hex)
    with Server(spec, tmp_path / "connector.log") as server:
        store_contexts(server, "clean")
        clean = answers(server, "clean")
        store_stretches(server, "clean-next")
        clean_next = first_tokens(server, "clean-next")
        _empty(store)  # only the namespace under test from here on
        store_stretches(server, "state")
        assert _rotate_states(store) == len(stretches)
        bad_state = first_tokens(server, "state")
        _empty(store)
        store_contexts(server, "kv")
        swapped = _swap_attention(store)
        bad_kv = answers(server, "kv")
    for i, (context, _) in enumerate(prompts):
        assert clean[i]["hybridkv"] == {"matched": len(context), "reused": len(context), "exact_state": True}
        assert bad_kv[i]["hybridkv"] == clean[i]["hybridkv"]  # loaded and trusted
    for i in range(len(stretches)):
        assert clean_next[i]["hybridkv"] == {"matched": STRETCH_AT, "reused": STRETCH_AT, "exact_state": True}
        assert bad_state[i]["hybridkv"] == clean_next[i]["hybridkv"]
        assert clean_next[i]["first"] == split_next[i]["first"]  # one computation, bit for bit
    # KL between first-token distributions (over the reference's top 20 and the rest), as vllm-bench
    noise = [first_token_fidelity(a["first"], s["first"])[1] for s, a in zip(split_next, alone_next, strict=True)]
    moved = [first_token_fidelity(c["first"], b["first"])[1] for b, c in zip(bad_state, clean_next, strict=True)]
    print(f"KL of vLLM's prefill split at {STRETCH_AT} from unsplit {noise}; scrambled state KL {moved}")
    # Every sample beyond twice vLLM's largest split noise and ten times bf16's own noise on it (the
    # split noise was 0.0 on every sample, on an AMD EPYC and with the Xeon's kernels forced), and
    # far beyond both on average; on an AMD EPYC scrambled KL 0.1 to 2.9.
    floors = [max(2 * max(noise), 10 * s.bf16_kl) for s in stretches]
    assert all(m > f for m, f in zip(moved, floors, strict=True)), (moved, floors)
    assert sum(moved) / len(moved) > max(10 * max(noise), 0.05), (moved, noise)
    # each prompt lost its own blocks to another's; its answer, read from attention, goes with them
    assert all(any(c[s : s + len(t)] == list(t) for s, t in swapped) for c, _ in prompts)
    said = [[tokenizer.decode(r["tokens"]) for r in replies] for replies in zip(alone, clean, bad_kv, strict=True)]
    print("answers alone / from clean / from swapped attention:", said)
    for sample, (alone_said, from_clean, from_swapped) in zip(samples, said, strict=True):
        # solved alone and from clean pages (the comparison means something); not from swapped ones
        assert all(gold in alone_said and gold in from_clean for gold in sample.golds)
        assert not any(gold in from_swapped for gold in sample.golds)


def test_layer_counts_come_from_every_servable_family_s_config():
    """Nemotron-H's config.json names its layers in `layers_block_type`, with no `num_hidden_layers`:
    the served arena must count them as transformers does, or it fails before serving."""
    from hybridkv.serving.arena import _model_facts

    for name in ("tiny-qwen3-next-vllm", "tiny-nemotron-h"):
        raw = json.loads((WEIGHTS_DIR / name / "config.json").read_text())
        layers, eos = _model_facts(str(WEIGHTS_DIR / name))
        assert layers == raw.get("num_hidden_layers", len(raw.get("layers_block_type", ()))) > 0
        assert eos == [raw["eos_token_id"]]
    assert "num_hidden_layers" not in json.loads((WEIGHTS_DIR / "tiny-nemotron-h" / "config.json").read_text())


def test_the_served_grid_comes_from_the_methods_declarations(monkeypatch):
    """A server per configuration; a recovery method reaches vLLM when it declares it may run as
    vLLM resumes, on the server storing states when it reads checkpoints; its requests name it."""
    from hybridkv.methods import METHODS
    from hybridkv.methods.tail_replay import TailReplay
    from hybridkv.serving.arena import request_params

    for name in ("epic+linearkv", "nope"):
        with pytest.raises(HybridKVError, match="runs only in the harness"):
            served_grid(ArenaPlan("ruler", [name], []), horizon=lambda: 0)
    with pytest.raises(HybridKVError, match="takes no budget"):
        served_grid(ArenaPlan("ruler", ["checkpoint@0.2"], []), horizon=lambda: 0)
    plan = ArenaPlan("ruler", ["full", "no-context", "tail-replay", "horizon-replay", "checkpoint", "zero-state",
                               "adaptive-replay@0.05", "seeded-replay"],
                     [Budget(fraction=0.05), Budget(fraction=1.0)])  # fmt: skip
    servers = served_grid(plan, horizon=lambda: 96)
    assert [(s.config, s.save_states) for s in servers] == [("no-cache", True), ("hybridkv", False), ("hybridkv", True)]
    assert [(m, str(b)) for m, b in servers[1].settings] == [
        ("zero-state", "None"),
        ("tail-replay", "0.05"),
        ("tail-replay", "1.0"),
        ("adaptive-replay", "0.05"),
        ("horizon-replay", "96tok"),
    ]
    assert [(m, str(b)) for m, b in servers[2].settings] == [
        ("checkpoint", "None"), ("seeded-replay", "0.05"), ("seeded-replay", "1.0")
    ]  # fmt: skip
    assert request_params("horizon-replay", Budget(tokens=96)) == {"method": "tail-replay", "replay_budget": "96tok"}
    assert request_params("checkpoint", None) == {"method": "checkpoint"} and request_params("full", None) is None
    # A method that declares it cannot run as vLLM resumes stays in the harness.
    monkeypatch.setitem(METHODS, "tail-replay", TailReplay(engine_resumable=False))
    with pytest.raises(HybridKVError, match="runs only in the harness"):
        served_grid(ArenaPlan("ruler", ["tail-replay"], [Budget(fraction=0.05)]), horizon=lambda: 0)


def test_the_report_sets_served_scores_beside_the_harnesss_and_flags_cis_apart(tmp_path):
    from hybridkv.report.arena_report import beside_table

    def write(directory: Path, engine: str, rows: list[tuple[str, object, float, list[float]]]) -> Path:
        directory.mkdir()
        (directory / "run.json").write_text(json.dumps({"engine": engine}))
        summary = [{"task": "t", "length": 2048, "method": m, "budget": b, "n": 30, "score": s, "score_ci95": ci,
                    "same_as_full": 1.0} for m, b, s, ci in rows]  # fmt: skip
        (directory / "summary.json").write_text(json.dumps({"rows": summary}))
        return directory

    served = write(tmp_path / "served", "vllm", [("full", None, 0.9, [0.8, 1.0]),
                   ("tail-replay", 0.05, 0.2, [0.1, 0.3]), ("horizon-replay", "64tok", 0.9, [0.8, 1.0])])  # fmt: skip
    harness = write(tmp_path / "harness", "transformers", [("full", None, 0.95, [0.9, 1.0]),
                    ("tail-replay", 0.05, 0.9, [0.8, 1.0]), ("tail-replay", "64tok", 0.85, [0.7, 0.95])])  # fmt: skip
    table = "\n".join(beside_table(json.loads((served / "summary.json").read_text())["rows"], served, harness))
    assert "| t | 2048 | full | — | 30 | 0.9 [0.8, 1] | 0.95 [0.9, 1] | yes |" in table
    assert "| t | 2048 | tail-replay | 0.05 | 30 | 0.2 [0.1, 0.3] | 0.9 [0.8, 1] | **no** |" in table
    # the connector replaying the calibrated horizon is set beside tail-replay at that many tokens
    assert "| t | 2048 | horizon-replay | 64tok | 30 | 0.9 [0.8, 1] | 0.85 [0.7, 0.95] | yes |" in table


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engine", "vllm", "--model", "tiny-qwen3-next-vllm"], "serves a checkpoint directory"),
        (["--engine", "vllm", "--model", str(MODEL), "--methods", "full,epic+linearkv"], "runs only in the harness"),
        (["--engine", "vllm", "--model", str(MODEL), "--shadow-rate", "1.5"], "a share of requests"),
        (["--shadow-rate", "0.5"], "give --engine vllm"),
        (["--engine", "vllm", "--model", str(MODEL), "--dtype", "float16"], "vllm serve runs the model in bfloat16"),
    ],
)
def test_a_served_arena_it_cannot_run_is_refused_in_one_line_before_any_work(argv, says, tmp_path, capsys):
    from hybridkv.cli import main

    out = tmp_path / "out"
    assert main(["arena", "run", "--samples", "1", "--lengths", "1024", "--out", str(out), *argv]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and says in error[0]
    assert not out.exists()
