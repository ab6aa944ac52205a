"""Shared fixtures: tiny models loaded once per session, and prefix-sharing workloads."""

from __future__ import annotations

import os

# On a 2-core machine shared with other processes, OpenMP worker threads that spin while
# waiting make every forward pass up to ~100x slower. Passive waiting must be set before
# torch (and its OpenMP runtime) is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# vLLM and LMCache report usage to their authors' servers by default; tests stay on this machine.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

# HYBRIDKV_CPU_ISA=avx512: this run takes the kernels vLLM and oneDNN take on a CPU with AVX-512 but
# no AVX-512-BF16 or AMX (tests/cpu_isa/sitecustomize.py), here and in every process it starts
# (vLLM's engines, `vllm serve`, shadow models), which import the hook from PYTHONPATH.
if os.environ.get("HYBRIDKV_CPU_ISA"):
    _hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_isa")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_hook, os.environ.get("PYTHONPATH")) if p)
    import tests.cpu_isa.sitecustomize  # noqa: E402, F401  (applies it to this process)

import pytest  # noqa: E402
import torch  # noqa: E402

from hybridkv.models import RANDOM_MODELS, load_model  # noqa: E402
from tests.helpers import free_port  # noqa: E402

torch.set_num_threads(2)

# Token ids drawn for test prompts stay clear of the small ids the tiny configs use as
# pad/bos/eos tokens.
LOW_TOKEN = 3


class ModelCache:
    """Loads each tiny model once (seed 0, float32) and hands the same object back.

    `family:<key>` is the random checkpoint of one of `tests/families.py`'s families, saved by
    transformers and loaded as a user's checkpoint directory."""

    def __init__(self, scratch) -> None:
        self._models: dict[str, object] = {}
        self._scratch = scratch

    def __getitem__(self, name: str):
        if name not in self._models:
            if name.startswith("family:"):
                from tests.families import save_random_checkpoint

                directory = self._scratch.mktemp(name.removeprefix("family:").replace("-", "_"))
                save_random_checkpoint(name.removeprefix("family:"), directory)
                self._models[name] = load_model(str(directory))
            else:
                self._models[name] = load_model(name)
        return self._models[name]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> ModelCache:
    return ModelCache(tmp_path_factory)


def random_tokens(n: int, seed: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(LOW_TOKEN, vocab, (n,), generator=generator, dtype=torch.long)


def build_workload(
    matched: int, prompt_len: int, cached_len: int, seed: int = 0, vocab: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cached prompt C, new prompt P): identical for exactly the first `matched` tokens.

    P[matched] != C[matched] whenever both exist, so the longest common prefix is `matched`.
    """
    if not 0 <= matched <= min(prompt_len, cached_len):
        raise ValueError("matched prefix longer than a prompt")
    cached = random_tokens(cached_len, seed, vocab)
    suffix = random_tokens(prompt_len - matched, seed + 10_000, vocab)
    prompt = torch.cat([cached[:matched], suffix])
    if matched < min(prompt_len, cached_len) and prompt[matched] == cached[matched]:
        span = vocab - LOW_TOKEN
        prompt[matched] = LOW_TOKEN + (int(cached[matched]) - LOW_TOKEN + 1) % span
    return cached, prompt


@pytest.fixture(scope="session")
def make_workload():
    return build_workload


@pytest.fixture(scope="session")
def tiny_model_names() -> list[str]:
    return list(RANDOM_MODELS)


class RedisServer:
    """A real redis-server on a free loopback port, owned by the test session."""

    def __init__(self, *extra: str) -> None:
        import shutil
        import subprocess
        import time

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; .ci/run installs it (apt-get install -y redis-server)")
        self.port = free_port()
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def redis_factory():
    """Start extra servers (e.g. one to kill, or one with a memory limit); all are killed afterwards."""
    servers = []

    def start(*extra: str) -> RedisServer:
        servers.append(RedisServer(*extra))
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


# The integration tier: tests that start or reach real services (redis / valkey servers,
# LMCache, vLLM). `pytest -m "not integration"` runs the fast tier, which needs only torch
# and transformers; CI runs both.
_INTEGRATION_MODULES = {"test_lmcache_store", "test_store_faults", "test_vllm_connector"}
_SERVER_FIXTURES = {"redis_server", "redis_factory"}
_SERVER_BACKENDS = {"redis", "valkey", "lmcache"}


def _needs_services(item: pytest.Item) -> bool:
    if item.module.__name__.rsplit(".", 1)[-1] in _INTEGRATION_MODULES:
        return True
    if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(str(value).split(":", 1)[0] in _SERVER_BACKENDS for value in params.values())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_services(item):
            item.add_marker(pytest.mark.integration)
