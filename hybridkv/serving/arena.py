"""`hybridkv arena run --engine vllm`: the arena's samples answered by real `vllm serve` processes.

The same frozen samples, golds, scorers and results rows as the harness (`hybridkv.eval.arena`),
so `hybridkv arena score` and `report` read a served run as they read a harness run. Each method
is a server configuration, and requests go the way real traffic reuses a context: the context
(the conversation so far) is served first, then context + question, whose answer is generated
greedily from the prefix hit, to the task's answer length or the model's end-of-sequence token:

| method              | server                                    | requests                         |
|---------------------|-------------------------------------------|----------------------------------|
| `full`              | vLLM without prefix caching (the oracle)  | context + question               |
| `no-context`        | the same server (the PGR floor)           | question                         |
| `vllm-prefix-cache` | vLLM's own hybrid prefix cache (`align`)  | context, then context + question |
| a recovery method   | HybridKVConnector, storing final states   | context, then context + question |
|                     | when the method reads checkpoints         |                                  |
| `horizon-replay`    | the same as `tail-replay`; tail: the      | context, then context + question |
|                     | calibrated horizon                        |                                  |

A recovery method is any of `hybridkv.methods` (built in or registered under `hybridkv.recipes`)
that declares it may run as vLLM resumes (`engine_resumable`): each request names it and its budget
(`"method"`, `"replay_budget"` in its kv_transfer_params), so a budgeted one runs at every plan
budget on one server. Every (context,
method, budget) has a namespace of its own (`cache_salt`): no budget reads another's pages, and
samples sharing only a prefix (RULER's haystacks) never resume from each other's (whose states
would be the other sample's replayed, inexact ones). Samples sharing their whole context
(`prefix`, `rag-shared`) share its namespace: the context is served once, and every question on it
is a hit on that one request's pages and states, as a shared document is in traffic. `horizon-replay` replays
the forgetting horizon `hybridkv calibrate` measures on the model (measured first when none is
beside it): the connector's `"replay_horizon": "calibrated"`; its rows carry that tail as a
token budget, so the harness's `tail-replay@<N>tok` is its counterpart. With stored states the
context's end is an exact checkpoint, so `checkpoint` replays nothing at any budget.

A row's costs are what the server says: `reused_tokens` (the connector's reused tokens, or the
prefix cache's `cached_tokens`), `replayed_tokens` (matched but recomputed: the connector's tail),
`recomputed_tokens` (prompt tokens the engine computed). `ttft_s` is the engine's time to the
answer's first token (vLLM's per-request metrics, `--enable-per-request-metrics`), `latency_s` the
whole request as the client saw it: an answer that runs on costs latency, not time to first token.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from hybridkv.errors import HybridKVError
from hybridkv.eval.arena import (
    SHADOW_CHECKS,
    ArenaPlan,
    answer_budget,
    needle_distance,
    read_rows,
    row_key,
    scored_row,
)
from hybridkv.eval.workloads.base import Sample
from hybridkv.methods import Budget, RecoveryMethod, recovery_methods
from hybridkv.serving.server import Server, ServerSpec, settle_shadow_checks

# Server configurations rather than recovery methods (the table above).
ENGINE_CONFIGS = ("no-context", "full", "vllm-prefix-cache", "horizon-replay")
DEFAULT_SERVED_METHODS = ("no-context", "full", "vllm-prefix-cache", "tail-replay", "horizon-replay", "checkpoint")
DEFAULT_SERVED_BUDGETS = (Budget(fraction=0.05), Budget(fraction=0.2), Budget(fraction=1.0))


def served_methods() -> dict[str, RecoveryMethod]:
    """The recovery methods the connector can run, by name: those declaring `engine_resumable`
    (`full` is a server configuration here)."""
    return {name: m for name, m in recovery_methods().items() if m.engine_resumable and name not in ENGINE_CONFIGS}


@dataclass(frozen=True)
class Served:
    """One server configuration and the (method, budget) settings it answers."""

    config: str  # a `ServerSpec` config
    save_states: bool
    settings: tuple[tuple[str, Budget | None], ...]

    @property
    def label(self) -> str:
        return self.config + ("" if self.config != "hybridkv" else "+states" if self.save_states else "-states")


def served_grid(plan: ArenaPlan, horizon: Callable[[], int]) -> list[Served]:
    """The servers a plan needs, in start order, each with its (method, budget) settings;
    `horizon()` gives the calibrated horizon (asked only when `horizon-replay` runs)."""
    methods = served_methods()
    wanted: dict[str, list[tuple[str, Budget | None]]] = {}
    for entry in plan.methods:
        name, _, pinned = entry.partition("@")
        if name not in ENGINE_CONFIGS and name not in methods:
            raise HybridKVError(
                f"--engine vllm serves {', '.join([*ENGINE_CONFIGS, *methods])}; {name!r} runs only in the harness"
            )
        uses_budget = name in methods and methods[name].uses_budget
        if pinned and not uses_budget:
            raise HybridKVError(f"method {name!r} takes no budget, so {entry!r} names none to run")
        if name == "horizon-replay":
            wanted[name] = [(name, Budget(tokens=horizon()))]
        elif uses_budget:
            budgets = [Budget.parse(pinned)] if pinned else list(plan.budgets)
            wanted.setdefault(name, []).extend((name, b) for b in budgets)
        else:
            wanted[name] = [(name, None)]
    with_states = [name for name, m in methods.items() if m.uses_checkpoints]
    without = [*(name for name in methods if name not in with_states), "horizon-replay"]
    servers = [
        Served("no-cache", True, tuple(s for m in ("full", "no-context") for s in wanted.get(m, []))),
        Served("vllm-prefix-cache", True, tuple(wanted.get("vllm-prefix-cache", []))),
        Served("hybridkv", False, tuple(s for m in without for s in wanted.get(m, []))),
        Served("hybridkv", True, tuple(s for m in with_states for s in wanted.get(m, []))),
    ]
    return [server for server in servers if server.settings]


def request_params(name: str, budget: Budget | None) -> dict | None:
    """The kv_transfer_params a request of (method, budget) carries to the connector."""
    if name in ("full", "no-context", "vllm-prefix-cache"):
        return None
    method = "tail-replay" if name == "horizon-replay" else name
    return {"method": method, **({"replay_budget": str(budget)} if budget is not None else {})}


@dataclass
class Generation:
    """One answered request: the generated token ids and what the server said about the prompt."""

    tokens: list[int]
    seconds: float  # the whole request, generation included, as the client saw it
    ttft_s: float | None  # the engine's time to its first token (its per-request metrics), queueing included
    prompt_tokens: int
    cached_tokens: int  # served by vLLM's own prefix cache
    hybridkv: dict | None  # the connector's {"matched", "reused", "exact_state"}
    request_id: str  # the id it was sent with (the engine's id holds it: `shadow_log` lines name it)


def generate(
    client, server: Server, prompt: list[int], max_tokens: int, stop_ids: list[int], cache_salt: str,
    kv_transfer_params: dict | None = None,
) -> Generation:  # fmt: skip
    """Greedy completion of a token-id prompt, up to `max_tokens` or a stop id."""
    request_id = f"arena-{uuid.uuid4().hex}"
    body = {
        "model": server.spec.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stop_token_ids": stop_ids, "return_token_ids": True, "cache_salt": cache_salt, "request_id": request_id,
    }  # fmt: skip
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    started = time.perf_counter()
    response = client.post(f"{server.url}/v1/completions", json=body)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise HybridKVError(f"vllm serve ({server.spec.config}) answered {response.status_code}: {response.text[:200]}")
    data = response.json()
    choice = data["choices"][0]
    tokens = [t for t in (choice.get("token_ids") or []) if t not in stop_ids]
    usage = data.get("usage") or {}
    ttft_ms = (data.get("metrics") or {}).get("time_to_first_token_ms")
    return Generation(
        tokens=tokens,
        seconds=seconds,
        ttft_s=None if ttft_ms is None else ttft_ms / 1000.0,
        prompt_tokens=usage.get("prompt_tokens", len(prompt)),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        hybridkv=(data.get("kv_transfer_params") or {}).get("hybridkv"),
        request_id=request_id,
    )


def _model_facts(model: str) -> tuple[int, list[int]]:
    """(layer count, end-of-sequence ids) from the checkpoint's config, as transformers reads it
    (Nemotron-H's config.json gives its layers as `layers_block_type`, not `num_hidden_layers`)."""
    from hybridkv.eval.plan import load_config

    config = load_config(model)
    eos = config.eos_token_id
    return config.num_hidden_layers, [eos] if isinstance(eos, int) else list(eos or [])


@dataclass(frozen=True)
class _Prompt:
    """One sample's requests, tokenized: the context, the question, and the answer's token budget."""

    sample: Sample
    context: list[int]
    question: list[int]
    new_tokens: int


@dataclass
class _Session:
    """What answering and recording any request of the run needs, whichever server answers it."""

    plan: ArenaPlan
    tokenizer: object
    score: Callable
    layers: int
    eos_ids: list[int]
    context_ids: dict[tuple[int, ...], int]  # each distinct context's index: its namespace's
    client: object  # an httpx.Client
    sink: object  # results.jsonl, open to append
    progress: tqdm


def _kept_rows(out_dir: Path) -> tuple[Path, set]:
    """results.jsonl rewritten with the rows it holds that read back whole, and their keys: a
    resumed run does not ask them again."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    existing = read_rows(results)
    results.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in existing))
    return results, {row_key(row["id"], row["method"], row["budget"]) for row in existing}


def _prompts(samples: list[Sample], tokenizer, default_new_tokens: int, max_new_tokens: int | None) -> list[_Prompt]:
    prompts = []
    for sample in samples:
        context = [t for segment in sample.segments() for t in tokenizer.encode(segment)]
        question = tokenizer.encode(sample.question)
        prompts.append(_Prompt(sample, context, question, answer_budget(sample, default_new_tokens, max_new_tokens)))
    return prompts


def _server_spec(
    model: str, served: Served, max_model_len: int, store: Path, run_id: str, shadow_rate: float, out_dir: Path
) -> ServerSpec:
    """The server `served` runs on: a scratch file store, namespaced by this run, its shadow checks
    (if any) logged beside the results."""
    return ServerSpec(
        model, served.config, max_model_len, f"file://{store.resolve()}", namespace=f"arena:{run_id}",
        save_states=served.save_states, shadow_rate=shadow_rate,
        connector_settings={"shadow_log": str((out_dir / SHADOW_CHECKS).resolve())} if shadow_rate else {},
    )  # fmt: skip


def _ask(
    session: _Session, server: Server, prompt: _Prompt, name: str, budget: Budget | None, served_contexts: set[str]
) -> Generation:
    """One sample's answer under (method, budget); a resuming method's server is sent the context
    first, once per namespace (`served_contexts`: those this server has been sent)."""
    # Each context in a namespace of its own: samples that share only a prefix (RULER's
    # haystacks) never resume from each other; those sharing the context share it.
    salt = f"{name}-{budget}-{session.context_ids[tuple(prompt.context)]}"  # vLLM takes no "@" in a cache_salt
    params = request_params(name, budget)
    if name == "no-context":
        tokens = prompt.question
    else:
        tokens = prompt.context + prompt.question
        if name != "full" and salt not in served_contexts:  # the context first, once
            generate(session.client, server, prompt.context, 1, session.eos_ids, salt, params)
            served_contexts.add(salt)
    return generate(session.client, server, tokens, prompt.new_tokens, session.eos_ids, salt, params)


def _answer_all(session: _Session, server: Server, todo: list, checked: bool, shadow: dict, shadow_path: Path) -> None:
    """Answer one server's (prompt, method, budget) list, a row each; with shadow checks on
    (`checked`), each setting's figures go to `shadow` and out to `shadow_path`."""
    setting, before = None, {}
    served_contexts: set[str] = set()
    for prompt, name, budget in todo:
        if checked and (name, str(budget)) != setting:  # a new setting: count its checks alone
            if setting is not None:
                shadow[f"{setting[0]}@{setting[1]}"] = _shadow(server, before)
            setting, before = (name, str(budget)), settle_shadow_checks([server])
        answer = _ask(session, server, prompt, name, budget, served_contexts)
        if checked:  # every check made before the next request: none dropped, none beside it
            settle_shadow_checks([server])
        row = _row(session.plan, prompt.sample, name, budget, answer, prompt.context, prompt.question,
                   session.layers, session.tokenizer, session.score)  # fmt: skip
        session.sink.write(json.dumps(row, sort_keys=True) + "\n")
        session.sink.flush()
        session.progress.update()
    if checked and setting is not None:
        shadow[f"{setting[0]}@{setting[1]}"] = _shadow(server, before)
        shadow_path.write_text(json.dumps(shadow, indent=2) + "\n")


def run_served_arena(
    model: str,
    tokenizer,
    samples: list,
    plan: ArenaPlan,
    out_dir: Path,
    score,
    horizon: Callable[[], int],
    show_progress: bool = True,
    max_new_tokens: int | None = None,
    default_new_tokens: int = 32,
    shadow_rate: float = 0.0,
) -> Path:
    """Answer every sample with every served (method, budget); append rows to out_dir/results.jsonl.
    Resumes as the harness does: rows already there are not asked again.

    With `shadow_rate` > 0 the connector runs its shadow checks (`shadow.py`) on that share of its
    requests: each served answer against exact full prefill, per kind (the context's own first
    request, a full prefill, gives the control group), and a zero-state resume's first token against
    the exact one. Each (method, budget) is served in turn and its checks' figures go to
    out_dir/shadow.json, to set beside the score that budget lost; every check, by request, to
    out_dir/shadow-checks.jsonl (the connector's `shadow_log`). Each answer waits for the checks
    before it to finish, so none is dropped and none runs beside a measured request."""
    import httpx

    results, done = _kept_rows(out_dir)
    layers, eos_ids = _model_facts(model)
    prompts = _prompts(samples, tokenizer, default_new_tokens, max_new_tokens)
    longest = max(len(p.context) + len(p.question) + p.new_tokens for p in prompts)
    context_ids: dict[tuple[int, ...], int] = {}
    for p in prompts:
        context_ids.setdefault(tuple(p.context), len(context_ids))
    grid = served_grid(plan, horizon)
    todo = {
        id(served): [
            (p, name, budget) for name, budget in served.settings for p in prompts
            if row_key(p.sample.id, name, budget.label() if budget else None) not in done
        ]
        for served in grid
    }  # fmt: skip
    shadow_path = out_dir / "shadow.json"
    shadow = json.loads(shadow_path.read_text()) if shadow_path.exists() else {}
    run_id = uuid.uuid4().hex  # every namespace is this run's own: a rerun never reads an earlier run's pages
    with (
        results.open("a") as sink,
        tqdm(total=sum(map(len, todo.values())), desc="arena (vllm)", disable=not show_progress) as progress,
        httpx.Client(timeout=httpx.Timeout(600.0)) as client,
    ):
        session = _Session(plan, tokenizer, score, layers, eos_ids, context_ids, client, sink, progress)
        for served in grid:
            if not todo[id(served)]:
                continue
            store = out_dir / "store"
            shutil.rmtree(store, ignore_errors=True)
            checked = shadow_rate if served.config == "hybridkv" else 0.0
            spec = _server_spec(model, served, longest + 16, store, run_id, checked, out_dir)
            progress.set_postfix_str(f"{served.label}: starting vllm serve")
            with Server(spec, out_dir / "logs" / f"{served.label}.log") as server:
                progress.set_postfix_str(served.label)
                _answer_all(session, server, todo[id(served)], bool(checked), shadow, shadow_path)
            shutil.rmtree(store, ignore_errors=True)  # scratch: every namespace was this run's own
    return results


def _shadow(server: Server, before: dict[str, float]) -> dict:
    """The shadow checks' figures since `before` (every queued check counted first)."""
    from hybridkv.serving.bench import shadow_figures

    return shadow_figures(before, settle_shadow_checks([server])) | {"shadow_rate": server.spec.shadow_rate}


def _row(plan, sample, name, budget, answer: Generation, context, question, layers, tokenizer, score) -> dict:
    """A results row as the harness writes it, with the server's reuse counts."""
    prediction = tokenizer.decode(answer.tokens)
    if answer.hybridkv:
        reused, replayed = answer.hybridkv["reused"], answer.hybridkv["matched"] - answer.hybridkv["reused"]
    else:
        reused, replayed = answer.cached_tokens, 0
    computed = answer.prompt_tokens - reused
    prompt_tokens = len(question) if name == "no-context" else len(context) + len(question)
    return {
        **scored_row(plan.workload, sample, name, budget, prediction, score),
        "engine": "vllm",
        "context_tokens": len(context),
        "chunks": len(sample.segments()),
        "question_tokens": len(question),
        "matched_tokens": answer.hybridkv["matched"] if answer.hybridkv else answer.cached_tokens,
        "reused_tokens": reused,
        "replayed_tokens": replayed,
        "needle_distance": needle_distance(sample, tokenizer, len(context)),
        "recomputed_tokens": computed,
        "recomputed_layer_tokens": computed * layers,
        "dense_layer_tokens": prompt_tokens * layers,
        "exact_state": answer.hybridkv.get("exact_state") if answer.hybridkv else None,
        "kv_bytes": None,  # the server does not report them per request
        "state_bytes": None,
        "ttft_s": answer.ttft_s,  # the first token only: a long answer does not make a resume look slow
        "latency_s": answer.seconds,
        "request_id": answer.request_id,
        "build_s": 0.0,
        "cache_model": None,
    }
