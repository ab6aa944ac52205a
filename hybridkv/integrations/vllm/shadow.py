"""Shadow checks: what vLLM served, against exact full prefill, on live traffic, beside the engine's own noise.

With `"shadow_rate": p` the scheduler side samples a share p of its finished requests (a hash of the
request id) and hands each, once answered, to a shadow process with its prompt, the tokens vLLM
served and how the connector computed the prompt — its **kind**:

- `full`: nothing loaded from the store (a miss, or a match recomputed in full);
- `exact`: resumed from an exact stored linear-state checkpoint with its attention pages;
- `stored`: resumed from a stored state that was itself approximate (saved after a zero-state resume);
- `zero@<budget>`: resumed from zero linear states at s with the pages of [0, s) (a tail replay).

The shadow process holds a transformers copy of the served checkpoint (`hybridkv.models`) and makes,
per sampled request, one or two checks:

- **the served answer** (greedy requests): one teacher-forced forward of prompt + served answer,
  computed exactly (a full prefill). Per answer position: is the served token the exact argmax
  (ties count as agreeing)? The first position where it is not is the divergence, with the exact
  log-prob gap there (log p(argmax) − log p(served), nats). An answer that runs on past the point
  where exact greedy stops diverges there, so a wrong ending shows as a divergence at the answer's end.
  This measures what the user got: the pages vLLM loaded, its kernels, bf16, its batching — everything.
  `full` checks are the **control group**: vLLM computing from nothing must agree with transformers up
  to the engine's own noise (kernels, dtype, batch shapes); every other kind's divergence rate is read
  as an excess over it. `exact` resumes are not part of the control: they read stored bytes, which is
  what can go wrong (a bad page), so they are a kind whose excess is measured like the others.
- **the served recipe's first token** (zero-state kinds): the prompt's first-token distribution from
  the KV of [0, s) with zero linear states at s, against the same KV with the exact states at s (one
  prefill of [0, s), `Recipe(s, s, state_seed=False/True)`). The two differ in the states alone, so
  their top-1 agreement and KL(exact ‖ served recipe) isolate the replay's approximation from every
  kernel and dtype difference. "Reproduced" says whether vLLM's first served token is that recipe's argmax.

vLLM's stored pages are its own packed bytes, which a transformers model cannot read, so the shadow
never uses a stored state: it recomputes. A check costs one forward of prompt + answer (and for a
zero-state resume a prefill of the prompt split at s, twice from s): about the request's own prefill.

The shadow runs in a child process (`python -m hybridkv.integrations.vllm.shadow MODEL DTYPE`),
on one thread, in Linux's idle scheduling class, on any core: `torch.set_num_threads` is
process-wide and would slow an engine sharing the process, and the child's work never delays a
served answer (it starts once the request has finished, and takes only CPU time the engine
leaves). Jobs and results cross as JSON lines on its stdin and stdout. A process that dies is
started again with the next job, at most once per `RESTART_AFTER_S`.

`ShadowGuard` turns the results into action: the excess of the loaded kinds' answer-divergence rate
over the control group's, over a window of recent checks, steps the connector's resumes up a ladder
(larger tails, then exact stored states only, then full prefills) and back down after clean windows.
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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

log = logging.getLogger("hybridkv.vllm")

# Checks waiting or running at once; a sampled request beyond that is dropped and counted
# (`shadow_dropped`): the shadow falls behind a busy engine rather than holding its prompts.
SHADOW_CAPACITY = 16
# A shadow process that died is started again with the next job, but not more often than this:
# a model that cannot load would otherwise be loaded once per sampled request.
RESTART_AFTER_S = 10.0

FULL, EXACT, STORED, ZERO = "full", "exact", "stored", "zero"
CONTROL = FULL  # the kind every other kind's divergence rate is read against


def zero_label(budget: str) -> str:
    """The series a zero-state resume at `budget` counts under."""
    return f"{ZERO}@{budget}"


@dataclass(frozen=True)
class ShadowJob:
    """A finished request: its prompt, how vLLM computed it, and what it served."""

    request_id: str
    tokens: list[int]
    kind: str  # FULL, EXACT, STORED or ZERO
    label: str  # the series it counts under: the kind, or zero_label(budget)
    start: int = 0  # where it resumed (the KV of [0, start) loaded); 0 for FULL
    served: list[int] | None = None  # the tokens vLLM served, where chosen greedily; else None
    rung: int = 0  # the guard's rung when it was looked up (`ShadowGuard`)


@dataclass(frozen=True)
class ShadowResult:
    request_id: str
    # the served answer, teacher-forced through exact full prefill (0 checked: not greedy, or nothing served)
    answer_length: int = 0
    diverged_at: int | None = None  # the first answer position whose served token is not the exact argmax
    gap: float | None = None  # log p(exact argmax) - log p(served token) there, in nats
    mismatches: int = 0  # answer positions whose served token is not the exact argmax (given the served prefix)
    # the served recipe's first token (zero-state kinds; None elsewhere)
    top1_agrees: bool | None = None  # the served recipe's argmax is the exact one's
    kl: float | None = None  # KL(exact ‖ served recipe) over the whole vocabulary, in nats
    reproduced: bool | None = None  # vLLM's first served token is the served recipe's argmax
    error: str | None = None  # the check could not be made (the model failed to load, the process died)

    @property
    def flagged(self) -> bool | None:
        """What the guard weighs: the answer diverged, or (no answer checked) the recipe's first
        token flipped; None: nothing to judge."""
        if self.answer_length:
            return self.diverged_at is not None
        return None if self.top1_agrees is None else not self.top1_agrees


def sampled(request_id: str, rate: float) -> bool:
    """Whether a request is shadow-checked at `rate`: a hash of its id, so a given id is always
    sampled the same way (reproducible tests) and the share is `rate` over many ids."""
    if rate <= 0:
        return False
    draw = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") / 2**64
    return draw < rate


# == the guard: a window, a ladder, a policy for when checks stop =====================================


class ShadowGuard:
    """The connector's answer to its checks. Rungs, from the configured behaviour up:

        0            the configured budget (and horizon)
        1 .. k       the ladder's larger tails (`tails`, each a Budget), no horizon
        k + 1        exact stored states only (a lookup reaches over the whole match for one; else full)
        k + 2        full prefill

    Each result of a check made at the current rung goes in: a **loaded** one (the request read the
    store: any kind but FULL) into the rung's window of the last `window` such flags, a FULL one into
    the control window (the last `window` FULL checks, at any rung). Once the rung's window is full
    and its flag rate exceeds the control window's by `floor` or more, the guard steps up one rung
    (its window starts empty). At a rung above 0, `window` checks made there (of any kind) whose
    loaded flags (if any) stay under the floor step it back down; a rung tripped into again needs
    twice as many clean checks each time, so a budget that is wrong for the model does not flap.
    With `floor` None the guard only counts. With `on_error` "exact", checks that stopped (the shadow
    dead, failing or dropping jobs) hold lookups at the exact-states rung at least, until one succeeds."""

    def __init__(
        self, floor: float | None, window: int, tails: tuple = (), on_error: str = "ignore"
    ) -> None:  # fmt: skip
        self.floor = floor
        self.window = window
        self.tails = tails
        self.on_error = on_error
        self.exact_rung = len(tails) + 1
        self.top = len(tails) + 2
        self.rung = 0
        self.loaded: deque[bool] = deque(maxlen=window)
        self.control: deque[bool] = deque(maxlen=window)
        self.checks_at_rung = 0
        self.entered = [0] * (self.top + 1)  # times each rung was stepped up into
        self.unavailable = False  # checks stopped (on_error "exact" then holds the exact rung)
        self.judged: float | None = None  # the excess the last check was judged on

    @property
    def effective_rung(self) -> int:
        """The rung lookups follow now."""
        if self.unavailable and self.on_error == "exact":
            return max(self.rung, self.exact_rung)
        return self.rung

    def excess(self) -> float | None:
        """The rung's window's flag rate over the control window's (no control yet: over 0)."""
        if not self.loaded:
            return None
        control = sum(self.control) / len(self.control) if self.control else 0.0
        return sum(self.loaded) / len(self.loaded) - control

    def record(self, kind: str, flagged: bool | None, rung: int) -> int:
        """One check's result (made at `rung`); returns the step taken: +1 up, -1 down, 0 none."""
        if flagged is None:
            return 0
        if kind == CONTROL:
            self.control.append(flagged)
        if rung != self.rung:  # looked up before the last step: it says nothing of this rung
            return 0
        self.checks_at_rung += 1
        if kind != CONTROL:
            self.loaded.append(flagged)
        if self.floor is None:
            return 0
        excess = self.judged = self.excess()
        if len(self.loaded) == self.window and excess >= self.floor and self.rung < self.top:
            self._move(self.rung + 1)
            self.entered[self.rung] += 1
            return 1
        clean_needed = self.window * 2 ** max(0, self.entered[self.rung] - 1)
        if self.rung > 0 and self.checks_at_rung >= clean_needed and (excess is None or excess < self.floor):
            self._move(self.rung - 1)
            return -1
        return 0

    def _move(self, rung: int) -> None:
        self.rung = rung
        self.loaded.clear()
        self.checks_at_rung = 0

    def describe(self, rung: int | None = None) -> str:
        rung = self.rung if rung is None else rung
        if rung == 0:
            return "the configured budget"
        if rung <= len(self.tails):
            return f"tails of {self.tails[rung - 1]}"
        return "exact stored states only" if rung == self.exact_rung else "full prefills"


class ShadowChecker:
    """The scheduler's handle on the shadow process: a bounded queue of jobs fed to it by a thread,
    and a thread reading its results into `on_result(job, result)`. The process starts with the
    first job (on the feeding thread, off the engine loop), and again with a job after it died
    (at most once per `RESTART_AFTER_S`); its death is told to `on_down(why)` as it happens (its
    pending jobs then fail with why). Nothing here blocks the caller."""

    def __init__(
        self, model: str, dtype: str, on_result: Callable[[ShadowJob, ShadowResult], None],
        capacity: int = SHADOW_CAPACITY, on_down: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.dtype = dtype
        self.on_result = on_result
        self.on_down = on_down
        self.capacity = capacity
        self._lock = threading.Lock()
        self._pending: dict[str, ShadowJob] = {}  # submitted, not yet answered
        self._jobs: queue.Queue[ShadowJob | None] | None = None  # the running process's queue
        self._process: subprocess.Popen | None = None
        self._died_at: float | None = None
        self._closing = False  # shut down: the process exiting then is no failure to report

    @property
    def dead(self) -> bool:
        """The shadow process is gone and too recently to start again: a job now would fail."""
        with self._lock:
            return self._restart_too_soon()

    def _restart_too_soon(self) -> bool:  # under the lock
        return self._died_at is not None and time.monotonic() - self._died_at < RESTART_AFTER_S

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    def submit(self, job: ShadowJob) -> bool:
        """Queue a check; False (nothing queued) when `capacity` checks are already pending, or the
        process died less than `RESTART_AFTER_S` ago."""
        with self._lock:
            if self._closing or len(self._pending) >= self.capacity or job.request_id in self._pending:
                return False
            if self._jobs is None:  # not started, or died: start one
                if self._restart_too_soon():
                    return False
                jobs = self._jobs = queue.Queue()
                threading.Thread(target=self._run, args=(jobs,), name="hybridkv-shadow-feed", daemon=True).start()
            self._pending[job.request_id] = job
            self._jobs.put(job)
        return True

    def _run(self, jobs: queue.Queue) -> None:
        """Start a process and feed it `jobs` until it exits or the checker shuts down."""
        try:
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            process = self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, self.model, self.dtype],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
            )  # fmt: skip
        except OSError as err:
            self._fail_all(jobs, f"the shadow process did not start: {err}")
            return
        threading.Thread(target=self._read, args=(process, jobs), name="hybridkv-shadow-read", daemon=True).start()
        while (job := jobs.get()) is not None:
            try:
                process.stdin.write(json.dumps(asdict(job)) + "\n")
                process.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                break  # the reader sees it exit and fails what is pending
        with contextlib.suppress(OSError, BrokenPipeError):
            process.stdin.close()

    def _read(self, process: subprocess.Popen, jobs: queue.Queue) -> None:
        for line in process.stdout:
            try:
                result = ShadowResult(**json.loads(line))
            except (TypeError, ValueError):
                continue  # not a result line (a library printing to stdout)
            with self._lock:
                job = self._pending.pop(result.request_id, None)
            if job is not None:
                self.on_result(job, result)
        self._fail_all(jobs, f"the shadow process exited (status {process.wait()})")

    def _fail_all(self, jobs: queue.Queue, why: str) -> None:
        """The process is gone: every pending check fails; the next job starts another."""
        with self._lock:
            failed, self._pending = list(self._pending.values()), {}
            if self._jobs is jobs:
                self._jobs, self._died_at = None, time.monotonic()
            closing = self._closing
        jobs.put(None)  # the feeder stops
        if not closing:
            log.warning("hybridkv: shadow checks stop until the process starts again: %s", why)
            if self.on_down is not None:
                self.on_down(why)
        for job in failed:
            self.on_result(job, ShadowResult(job.request_id, error=why))

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
            if self._jobs is not None:
                self._jobs.put(None)
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()


# == the shadow process ===========================================================================


def check_answer(model, prompt: list[int], served: list[int]) -> tuple[int | None, float | None, int]:
    """Teacher-force `served` after `prompt` through one exact prefill of `model` (a `HybridModel`):
    the first answer position whose served token is not the argmax, the log-prob gap there, and how
    many positions' served tokens are not the argmax."""
    import torch

    ids = torch.tensor(prompt + served[:-1], dtype=torch.long)
    with torch.inference_mode():
        logits = model.forward(ids, model.new_cache(), 0, logits_to_keep=len(served)).double()
    log_p = logits.log_softmax(-1)
    served_log_p = log_p.gather(1, torch.tensor(served).unsqueeze(1)).squeeze(1)
    best = log_p.max(-1).values
    below = (served_log_p < best).nonzero()  # a tie with the argmax agrees
    if not len(below):
        return None, None, 0
    at = int(below[0])
    return at, float(best[at] - served_log_p[at]), len(below)


def check_first_token(model, job: ShadowJob) -> tuple[bool, float, bool | None]:
    """The served recipe's first token against the exact one (see the module's docstring): top-1
    agreement, KL(exact ‖ served recipe), and whether vLLM's first served token is the recipe's argmax."""
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
    reproduced = None if not job.served else job.served[0] == served_top1
    return served_top1 == int(exact.argmax()), kl, reproduced


def check(model, job: ShadowJob) -> ShadowResult:
    """Every check `job` calls for, on `model` (a `HybridModel`)."""
    figures: dict = {}
    if job.served:
        diverged_at, gap, mismatches = check_answer(model, job.tokens, job.served)
        figures |= {"answer_length": len(job.served), "diverged_at": diverged_at, "gap": gap, "mismatches": mismatches}
    if job.kind == ZERO and 0 < job.start < len(job.tokens):
        top1_agrees, kl, reproduced = check_first_token(model, job)
        if not math.isfinite(kl):
            return ShadowResult(job.request_id, error=f"KL {kl}")
        figures |= {"top1_agrees": top1_agrees, "kl": kl, "reproduced": reproduced}
    return ShadowResult(job.request_id, **figures)


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


def _yield_to_the_engine() -> None:
    """Run only on CPU time the engine leaves: Linux's idle scheduling class (the lowest nice value
    elsewhere), on any core. A child process starts with its parent thread's core binding, and
    vLLM's CPU backend pins its threads; at nice 10 with that binding the checks moved served TTFT
    p50 by +19% at `shadow_rate` 0.1, in the idle class on any core by -1% (docs/vllm.md)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(19)


def main(argv: list[str]) -> None:
    """The shadow process: one job per line on stdin, one result per line on stdout."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _yield_to_the_engine()
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
        out.write(json.dumps(asdict(result)) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
