"""Shadow checks: how far a served zero-state replay's first token is from the exact one, on live traffic.

With `"shadow_rate": p` the scheduler side samples a share p of the requests it resumed inexactly
(zero linear states at the resume point s, exact-KV pages of [0, s) loaded, vLLM prefilling
[s, end) itself) and, once each has been answered, hands its prompt and s to a shadow process.
The shadow process holds a transformers copy of the served checkpoint (`hybridkv.models`) and,
on one code path and in one dtype, computes the prompt's first-token distribution twice through
hybridkv's executor, from one prefill of [0, s) (a full recompute of the prompt, split at s):

- **served recipe**: the attention KV of [0, s) and zero linear states at s, then [s, end) —
  the resume vLLM made (`Recipe(s, s, state_seed=False)`);
- **exact**: the same KV and the exact linear states at s, then [s, end) — a full prefill of the
  prompt split at s (`Recipe(s, s, state_seed=True)`).

The two differ in the linear states at s and nothing else, so their top-1 agreement and KL(exact ‖
served recipe) measure the replay's approximation alone: kernel and dtype differences between vLLM
and transformers, and the prefill's split, cancel out. The first token vLLM actually served is
compared with the served recipe's argmax too ("reproduced"): it tells whether the shadow models
the serving path (it does not where the loaded pages were themselves inexact, or where vLLM's bf16
rounding flips a near-tie). vLLM's stored pages are its own packed bytes, which a transformers
model cannot read, so the shadow never uses a stored state: it recomputes.

The shadow runs in a child process (`python -m hybridkv.integrations.vllm.shadow MODEL DTYPE`),
on one thread and at a lower priority: `torch.set_num_threads` is process-wide and would slow an
engine sharing the process, and the child's work never delays a served answer (it starts once
the request has finished). Jobs and results cross as JSON lines on its stdin and stdout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

log = logging.getLogger("hybridkv.vllm")

# Checks waiting or running at once; a sampled request beyond that is dropped and counted
# (`shadow_dropped`): the shadow falls behind a busy engine rather than holding its prompts.
SHADOW_CAPACITY = 16
# The disagreement rate is judged against `shadow_floor` only over at least this many checks: at a
# true rate of 0.3, 20 checks put the observed rate within ±0.2 of it 95% of the time (binomial).
FLOOR_MIN_CHECKS = 20


@dataclass(frozen=True)
class ShadowJob:
    """A finished request vLLM resumed at `start` from zero linear states with the KV of [0, start)."""

    request_id: str
    tokens: list[int]
    start: int
    served_token: int | None  # the first token vLLM served, where it was chosen greedily


@dataclass(frozen=True)
class ShadowResult:
    request_id: str
    top1_agrees: bool = True  # the served recipe's argmax is the exact one's
    kl: float = 0.0  # KL(exact ‖ served recipe) over the whole vocabulary, in nats
    reproduced: bool | None = None  # vLLM's served token is the served recipe's argmax (None: not compared)
    error: str | None = None  # the check could not be made (the model failed to load, the process died)


def sampled(request_id: str, rate: float) -> bool:
    """Whether a request is shadow-checked at `rate`: a hash of its id, so a given id is always
    sampled the same way (reproducible tests) and the share is `rate` over many ids."""
    if rate <= 0:
        return False
    draw = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") / 2**64
    return draw < rate


class ShadowFloor:
    """The checks' disagreement tally, and whether it crossed the engine's `shadow_floor`: once the
    rate over at least `min_checks` checks is at or above the floor, the floor trips for good (the
    scheduler then makes no inexact resume, so no new check could clear it)."""

    def __init__(self, floor: float | None, min_checks: int = FLOOR_MIN_CHECKS) -> None:
        self.floor = floor
        self.min_checks = min_checks
        self.checks = 0
        self.disagreements = 0
        self.tripped = False

    @property
    def rate(self) -> float | None:
        return self.disagreements / self.checks if self.checks else None

    def record(self, disagrees: bool) -> bool:
        """Count one check; True when this one trips the floor."""
        self.checks += 1
        self.disagreements += int(disagrees)
        if self.tripped or self.floor is None or self.checks < self.min_checks:
            return False
        self.tripped = self.rate >= self.floor
        return self.tripped


class ShadowChecker:
    """The scheduler's handle on the shadow process: a bounded queue of jobs fed to it by a thread,
    and a thread reading its results into `on_result`. The process starts with the first job (on
    the feeding thread, off the engine loop); nothing here blocks the caller."""

    def __init__(
        self, model: str, dtype: str, on_result: Callable[[ShadowResult], None], capacity: int = SHADOW_CAPACITY
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.on_result = on_result
        self.capacity = capacity
        self._jobs: queue.Queue[ShadowJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[str, ShadowJob] = {}  # submitted, not yet answered
        self._process: subprocess.Popen | None = None
        self._feeder: threading.Thread | None = None
        self._dead = False
        self._closing = False  # shut down: the process exiting then is no failure to report

    @property
    def dead(self) -> bool:
        """The shadow process is gone (or never started): no check will be made any more."""
        return self._dead

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, job: ShadowJob) -> bool:
        """Queue a check; False (nothing queued) when `capacity` checks are already pending or the
        process is `dead`."""
        with self._lock:
            if self._dead or len(self._pending) >= self.capacity or job.request_id in self._pending:
                return False
            self._pending[job.request_id] = job
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="hybridkv-shadow-feed", daemon=True)
                self._feeder.start()
        self._jobs.put(job)
        return True

    def _feed(self) -> None:
        try:
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, self.model, self.dtype],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
            )  # fmt: skip
        except OSError as err:
            self._fail_all(f"the shadow process did not start: {err}")
            return
        threading.Thread(target=self._read, name="hybridkv-shadow-read", daemon=True).start()
        while (job := self._jobs.get()) is not None:
            try:
                self._process.stdin.write(json.dumps(asdict(job)) + "\n")
                self._process.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                self._fail_all("the shadow process exited")
                return
        with contextlib.suppress(OSError):
            self._process.stdin.close()

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                result = ShadowResult(**json.loads(line))
            except (TypeError, ValueError):
                continue  # not a result line (a library printing to stdout)
            with self._lock:
                if self._pending.pop(result.request_id, None) is None:
                    continue
            self.on_result(result)
        self._fail_all(f"the shadow process exited (status {self._process.wait()})")

    def _fail_all(self, why: str) -> None:
        """Every pending check fails, and so will every later one: the process is gone."""
        with self._lock:
            failed, self._pending = list(self._pending), {}
            first = not self._dead
            self._dead = True  # no more submissions
        if first and (failed or not self._closing):
            log.warning("hybridkv: shadow checks stop: %s", why)
        for request_id in failed:
            self.on_result(ShadowResult(request_id, error=why))

    def shutdown(self) -> None:
        self._closing = True
        self._jobs.put(None)
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()


# == the shadow process ===========================================================================


def check(model, job: ShadowJob) -> ShadowResult:
    """Compute one check on `model` (a `HybridModel`): see the module's docstring."""
    import torch

    from hybridkv.cache.prefix_cache import CachedMatch
    from hybridkv.cache.prompt import capture_prompt
    from hybridkv.methods import Recipe, execute

    prompt = torch.tensor(job.tokens, dtype=torch.long)
    s = job.start
    with torch.inference_mode():
        # one prefill of [0, s) gives both runs their KV, and the exact run its states at s
        hit = CachedMatch(capture_prompt(model, prompt[:s], checkpoint_interval=s), s)
        served = execute(model, prompt, hit, Recipe(s, s, state_seed=False)).logits[-1].double()
        exact = execute(model, prompt, hit, Recipe(s, s, state_seed=True)).logits[-1].double()
    log_p, log_q = exact.log_softmax(-1), served.log_softmax(-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))
    served_top1 = int(served.argmax())
    reproduced = None if job.served_token is None else job.served_token == served_top1
    return ShadowResult(job.request_id, served_top1 == int(exact.argmax()), kl, reproduced)


def load_shadow_model(path: str, dtype: str):
    """The served checkpoint in transformers, in the served dtype where hybridkv can resume it
    exactly; else in float32 (the bf16 bench models fail `why_not_resumable` on the CPU's
    reference kernels: a resumed bf16 forward drifts as far as a zeroed state)."""
    import torch

    from hybridkv.errors import HybridKVError
    from hybridkv.models import load_model

    wanted = getattr(torch, dtype, None)
    if isinstance(wanted, torch.dtype) and wanted != torch.float32:
        try:
            return load_model(path, dtype=wanted)
        except HybridKVError as err:
            log.warning("hybridkv shadow: %s; checking in float32", err)
    return load_model(path, dtype=torch.float32)


def main(argv: list[str]) -> None:
    """The shadow process: one job per line on stdin, one result per line on stdout."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with contextlib.suppress(OSError):
        os.nice(10)  # the engine first
    import torch

    torch.set_num_threads(1)
    path, dtype = argv
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints goes to the log, not into the results
    try:
        model, failure = load_shadow_model(path, dtype), None
    except Exception as err:  # answer every job with why, rather than die unseen
        model, failure = None, f"the shadow model did not load: {type(err).__name__}: {err}".splitlines()[0]
    for line in sys.stdin:
        job = ShadowJob(**json.loads(line))
        if model is None:
            result = ShadowResult(job.request_id, error=failure)
        else:
            try:
                result = check(model, job)
            except Exception as err:
                result = ShadowResult(job.request_id, error=f"{type(err).__name__}: {err}".splitlines()[0])
        if not math.isfinite(result.kl):
            result = ShadowResult(job.request_id, error=f"KL {result.kl}")
        out.write(json.dumps(asdict(result)) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
