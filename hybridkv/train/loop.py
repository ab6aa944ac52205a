"""`hybridkv train`: train a built-in tiny hybrid on the offline task mix, resumably.

One run directory holds everything: `checkpoint/` (transformers config + safetensors weights,
optimiser, data position and RNG states, written atomically every `save_every` steps),
`log.jsonl` (one line per step and per evaluation) and `loss.png`. Running again with the same
directory resumes where the last checkpoint left off; the data of step s is a pure function of
(seed, s), so the resumed run sees exactly the examples it would have.

The curriculum goes from short to long examples at a fixed number of tokens per step. The loss
is the language-model loss over every token plus `answer_weight` times the loss over the answer
tokens (so an answer weighs the same in a 512- and an 8K-token example), plus, for GLM-5.3-Flash, the DSA indexer's
own loss (`hybridkv.train.indexer`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from hybridkv.errors import HybridKVError
from hybridkv.models.loader import architecture_name, read_with_head, write_with_head
from hybridkv.models.tokenizer import write_byte_tokenizer
from hybridkv.train import data
from hybridkv.train.indexer import IndexerRecorder, indexer_loss
from hybridkv.train.kernels import fast_linear_kernels
from hybridkv.train.shapes import TRAINABLE, build, shape_config

DEFAULT_SCHEDULE = ((512, 400), (1024, 120), (2048, 100), (4096, 60), (8192, 25))


@dataclass
class TrainConfig:
    """A training run. A field's `help` is its `hybridkv train` flag's (or argument's) text."""

    run_dir: Path = field(metadata={"help": "run directory (created; resumed when it holds a checkpoint)"})
    model: str = field(default="tiny-glm5-next", metadata={"help": "model shape to train (hybridkv/train/shapes.py)"})
    seed: int = field(default=0, metadata={"help": "seed for the initial weights and the data stream"})
    schedule: tuple[tuple[int, int], ...] = field(  # (example length, steps) in order
        default=DEFAULT_SCHEDULE,
        metadata={"help": "curriculum: LENGTH:STEPS pairs, example length in tokens and optimiser steps at it"},
    )
    tokens_per_step: int = field(default=8192, metadata={"help": "tokens per batch"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate (cosine decay)"})
    min_lr: float = 2e-4
    warmup: int = 50
    decay: float = 0.15  # share of all steps over which the rate falls from lr to min_lr, at the end
    weight_decay: float = 0.01
    tasks: tuple[str, ...] = field(  # NAME or NAME:WEIGHT from hybridkv.train.data.TASKS; () = the default mix
        default=(),
        metadata={
            "help": "comma list of training tasks, NAME or NAME:WEIGHT (a bare name keeps its default weight; "
            "documents, the rag/agent-reports shape, is drawn only when named with a weight; empty: the whole mix)"
        },
    )
    answer_weight: float = 3.0
    indexer_weight: float = 1.0
    indexer_queries: int = 64
    eval_every: int = field(default=100, metadata={"help": "held-out evaluation interval"})
    eval_lengths: tuple[int, ...] = (1024, 2048, 4096)
    eval_samples: int = 16
    save_every: int = field(default=25, metadata={"help": "checkpoint interval (steps)"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's choice)"})
    stop_at: int | None = field(  # end this stretch (after a save) at this step; run again to go on
        default=None, metadata={"help": "end this stretch at this step (resume later)"}
    )
    # A fresh run starts from these weights (a model directory: a shipped tiny-* or an exported run)
    # instead of the library's initialisation; checkpoints of earlier sessions do not outlive them.
    init: Path | None = field(
        default=None,
        metadata={
            "help": "start a fresh run from these weights (a model directory, e.g. "
            "hybridkv/models/weights/tiny-glm5-next)"
        },
    )
    # Config fields that replace the shape's own (`--shape '{"kv_lora_rank": 128}'`); the exported
    # config.json carries them, so the model loads as trained.
    shape: dict = field(
        default_factory=dict,
        metadata={
            "help": "JSON object of config fields replacing the model shape's own, e.g. "
            '\'{"num_attention_heads": 8, "kv_lora_rank": 128}\' (the exported config.json keeps them)'
        },
    )
    extra: dict = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return sum(steps for _, steps in self.schedule)

    def length_at(self, step: int) -> int:
        for length, steps in self.schedule:
            if step < steps:
                return length
            step -= steps
        return self.schedule[-1][0]

    def lr_at(self, step: int) -> float:
        """Warm-up, constant, then a cosine fall over the last `decay` share of the steps: a run
        whose schedule is lengthened between stretches keeps the rates its past steps had."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        decay_steps = max(1, int(self.decay * self.total_steps))
        progress = (step - (self.total_steps - decay_steps)) / decay_steps
        if progress <= 0:
            return self.lr
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """'256:400,512:400' -> ((256, 400), (512, 400))."""
    try:
        pairs = tuple(tuple(int(x) for x in item.split(":")) for item in text.split(","))
        if not pairs or any(len(p) != 2 or p[0] < 64 or p[1] < 1 for p in pairs):
            raise ValueError
    except ValueError:
        raise HybridKVError(f"bad --schedule {text!r}: expected LENGTH:STEPS pairs, e.g. 256:400,1024:200") from None
    return pairs


class Model(nn.Module):
    """Backbone (the transformers class) and LM head, as the loader runs them."""

    def __init__(self, backbone: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.lm_head = lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=tokens, use_cache=False).last_hidden_state
        return self.lm_head(hidden)


def _batch(examples: list[data.Example]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([e.tokens for e in examples])
    answer = torch.zeros(tokens.shape, dtype=torch.bool)
    for row, e in enumerate(examples):
        for start, end in e.answers:
            answer[row, start:end] = True
    return tokens, answer


def answer_loss_by_task(per_row: torch.Tensor, examples: list[data.Example]) -> dict[str, float]:
    """Mean answer loss per task in a batch (rows without answers have NaN and are left out)."""
    by_task: dict[str, list[float]] = {}
    for value, example in zip(per_row.tolist(), examples, strict=True):
        if not math.isnan(value):
            by_task.setdefault(example.task, []).append(value)
    return {task: round(sum(values) / len(values), 4) for task, values in sorted(by_task.items())}


def losses(
    model: Model, tokens: torch.Tensor, answer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(language-model loss, answer loss, answer tokens all right per row with answers, answer
    loss per row: NaN where a row has none) for a batch."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
    on_answer = answer[:, 1:]
    lm = per_token.mean()
    answer_loss = per_token[on_answer].mean() if on_answer.any() else torch.zeros(())
    right = ((logits.argmax(-1) == targets) | ~on_answer).all(-1)
    per_row = (per_token.detach() * on_answer).sum(-1) / on_answer.sum(-1)
    return lm, answer_loss, right[on_answer.any(-1)], per_row


def _checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoint"


def save_model(model: Model, config, directory: Path) -> None:
    write_with_head(directory, config, model.backbone, model.lm_head)


def load_weights(model: Model, directory: Path) -> None:
    read_with_head(directory, model.backbone, model.lm_head, str(directory))


def _save(run_dir: Path, model: Model, config, optimizer, step: int, generator: torch.Generator) -> None:
    final = _checkpoint_dir(run_dir)
    scratch = run_dir / "checkpoint.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    save_model(model, config, scratch)
    torch.save(optimizer.state_dict(), scratch / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "indexer": generator.get_state()}, scratch / "rng.pt")
    (scratch / "state.json").write_text(json.dumps({"step": step}))
    old = run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    scratch.rename(final)
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def evaluate(model: Model, config: TrainConfig, step: int) -> dict[str, float]:
    """Held-out answer accuracy (every answer token the argmax, teacher forced) per length."""
    model.eval()
    results = {}
    tasks = {"niah": data.TASKS["niah"], "vt": data.TASKS["vt"]}
    for length in config.eval_lengths:
        right = 0
        for i in range(config.eval_samples):
            example = data.example(config.seed, "heldout", 0, i, length, tasks)
            tokens, answer = _batch([example])
            right += int(losses(model, tokens, answer)[2].all())
        results[f"acc@{length}"] = right / config.eval_samples
    model.train()
    return results


def plot(run_dir: Path) -> Path | None:
    """loss.png from log.jsonl: losses per step, held-out accuracy per evaluation."""
    from matplotlib.figure import Figure  # files only: no pyplot, no backend to choose

    log = run_dir / "log.jsonl"
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "lm" in r]
    evals = [r for r in rows if "eval" in r]
    fig = Figure(figsize=(11, 4))
    (left, right) = fig.subplots(1, 2)
    for key in ("lm", "answer", "indexer"):
        left.plot([r["step"] for r in steps], [r[key] for r in steps], label=key, linewidth=0.8)
    # Per-task answer losses are noisy (a few rows per step): a running mean over 25 steps.
    for task in sorted({t for r in steps for t in r.get("answer_by_task", {})}):
        points = [(r["step"], r["answer_by_task"][task]) for r in steps if task in r.get("answer_by_task", {})]
        smooth = [sum(v for _, v in points[max(0, i - 24) : i + 1]) / len(points[max(0, i - 24) : i + 1])
                  for i in range(len(points))]  # fmt: skip
        left.plot([x for x, _ in points], smooth, linestyle="--", linewidth=0.8, label=f"answer: {task}")
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("loss (nats)")
    left.legend()
    for key in sorted({k for r in evals for k in r["eval"]}):
        right.plot([r["step"] for r in evals], [r["eval"][key] for r in evals], marker="o", label=key)
    right.set_xlabel("step")
    right.set_ylabel("held-out answer accuracy")
    right.set_ylim(0, 1)
    if evals:
        right.legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=110)
    return out


def export(run_dir: Path, name: str, root: Path | None = None) -> Path:
    """Copy a run's checkpoint weights (config.json, model.safetensors) and its log summary into the
    package (or `root`), as the built-in trained model `name`."""
    from hybridkv.models.tiny import WEIGHTS_DIR

    checkpoint = _checkpoint_dir(run_dir)
    if not (checkpoint / "model.safetensors").is_file():
        raise HybridKVError(f"{run_dir}: no checkpoint/model.safetensors to export")
    if not name.startswith("tiny-"):
        raise HybridKVError(f"trained built-in models are named tiny-*, not {name!r}")
    target = (root or WEIGHTS_DIR) / name
    target.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copyfile(checkpoint / file, target / file)
    config = json.loads((target / "config.json").read_text())
    if not config.get("architectures"):  # a checkpoint written before write_with_head named its class
        config["architectures"] = [architecture_name(config["model_type"])]
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # The byte tokenizer as files, so Hugging Face loaders (vLLM's server among them) take text.
    write_byte_tokenizer(target)
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    last_step = json.loads((checkpoint / "state.json").read_text())["step"]
    # A stretch that ended between checkpoints logged steps the next stretch ran again: the last
    # row of each step is the one the weights went through.
    steps = list({r["step"]: r for r in rows if "lm" in r and r["step"] < last_step}.values())
    evals = [r for r in rows if "eval" in r and r["step"] <= last_step]
    card = {
        "steps": last_step,
        "tokens": sum(r["tokens"] for r in steps),
        "train_seconds": round(sum(r["seconds"] for r in steps), 1),
        "last_eval": evals[-1] if evals else None,
        "train_config": json.loads((run_dir / "train_config.json").read_text()),
        # Every start of the run (a fresh one, then each resumed stretch) with its config.
        "stretches": [json.loads(line) for line in (run_dir / "stretches.jsonl").read_text().splitlines() if line],
    }
    if (run_dir / "init_training.json").is_file():  # a run started with --init: the weights' history before it
        card["init_training"] = json.loads((run_dir / "init_training.json").read_text())
    (target / "training.json").write_text(json.dumps(card, indent=1) + "\n")
    if (run_dir / "loss.png").exists():
        shutil.copyfile(run_dir / "loss.png", target / "loss.png")
    return target


def _git_commit() -> str | None:
    """The hybridkv commit a stretch ran (its data and loss code), when run from a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "hybridkv"], cwd=Path(__file__).parent.parent.parent,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return None
    return (out.stdout.strip() + ("+dirty" if dirty else "")) if out.returncode == 0 else None


def _check_resume_shape(config: TrainConfig) -> None:
    """A checkpoint resumes only as the model it was trained as: a different --model or --shape
    whose tensors happen to fit would otherwise train and export under another config."""
    recorded = config.run_dir / "train_config.json"
    if not (_checkpoint_dir(config.run_dir).exists() and recorded.is_file()):
        return
    try:
        was = json.loads(recorded.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HybridKVError(f"{recorded}: unreadable ({err}); cannot check what the run was trained as") from None
    before, now = (was.get("model"), was.get("shape") or {}), (config.model, config.shape or {})
    if before != now:
        raise HybridKVError(
            f"{config.run_dir} was trained as {before[0]} with --shape {json.dumps(before[1])}; "
            f"resume it with the same (got {now[0]} with --shape {json.dumps(now[1])})"
        )


def _start_run_dir(config: TrainConfig) -> dict[str, tuple[float, data.Generator]] | None:
    """Refuse a bad run before its directory is touched, then record its config there; the task
    table it draws from."""
    if config.model not in TRAINABLE:
        raise HybridKVError(f"cannot train {config.model!r}: trainable models are {', '.join(TRAINABLE)}")
    # A bad --tasks or --shape is refused before the run directory is touched.
    task_table = data.task_table(config.tasks)
    shape_config(config.model, config.shape)
    if config.threads:
        torch.set_num_threads(config.threads)
    _check_resume_shape(config)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "train_config.json").write_text(json.dumps(asdict(config), default=str, indent=1))
    return task_table


def _optimizer(model: Model, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, with no weight decay on embeddings, norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )


@dataclass
class _Run:
    """What every step of a training stretch works on."""

    config: TrainConfig
    task_table: dict[str, tuple[float, data.Generator]] | None  # None: the default mix
    model: Model
    model_config: object  # the transformers config the checkpoints are written with
    optimizer: torch.optim.Optimizer
    generator: torch.Generator  # the indexer loss's query sampling
    recorder: IndexerRecorder


def _resume_or_init(run: _Run) -> int:
    """The step this stretch starts at: the checkpoint's, restoring its weights, optimiser and RNG
    states; else 0, from --init's weights when given (the library's initialisation otherwise)."""
    config, checkpoint = run.config, _checkpoint_dir(run.config.run_dir)
    if not checkpoint.exists() and config.init is not None:
        load_weights(run.model, Path(config.init))
        # The init's own record travels with the run: its directory may be the very one this run's
        # export overwrites, and the card must still say how the weights were made before this run.
        if (Path(config.init) / "training.json").is_file():
            shutil.copyfile(Path(config.init) / "training.json", config.run_dir / "init_training.json")
    elif checkpoint.exists():
        load_weights(run.model, checkpoint)
        run.optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt"))
        rng = torch.load(checkpoint / "rng.pt")
        torch.set_rng_state(rng["torch"])
        run.generator.set_state(rng["indexer"])
        return json.loads((checkpoint / "state.json").read_text())["step"]
    return 0


def _train_step(run: _Run, step: int) -> dict:
    """One optimiser step on step `step`'s batch; its log row."""
    config, recorder = run.config, run.recorder
    length = config.length_at(step)
    count = max(1, config.tokens_per_step // length)
    examples = [data.example(config.seed, "train", step, i, length, run.task_table) for i in range(count)]
    tokens, answer = _batch(examples)
    for group in run.optimizer.param_groups:
        group["lr"] = config.lr_at(step)
    began = time.perf_counter()
    lm, answer_loss, right, per_row = losses(run.model, tokens, answer)
    aux = indexer_loss(recorder, config.indexer_queries, run.generator) if recorder.handles else torch.zeros(())
    loss = lm + config.answer_weight * answer_loss + config.indexer_weight * aux
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    run.optimizer.step()
    seconds = time.perf_counter() - began
    return {
        "step": step,
        "length": length,
        "lm": round(lm.item(), 5),
        "answer": round(answer_loss.item(), 5),
        "indexer": round(aux.item(), 5),
        "answer_acc": round(right.float().mean().item(), 4) if right.numel() else None,
        "answer_by_task": answer_loss_by_task(per_row, examples),
        "grad_norm": round(norm.item(), 4),
        "lr": config.lr_at(step),
        "tokens": tokens.numel(),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens.numel() / seconds, 1),
        "time": time.time(),
    }


def _evaluate_and_log(run: _Run, done: int, log) -> None:
    """The held-out evaluation after `done` steps, to the log and the terminal."""
    with torch.no_grad():
        results = evaluate(run.model, run.config, done)
    run.recorder.inputs.clear()
    log.write(json.dumps({"step": done, "eval": results}) + "\n")
    log.flush()
    tqdm.write(f"step {done}: held-out " + ", ".join(f"{k} {v:.2f}" for k, v in results.items()))


def train(config: TrainConfig) -> Path:
    task_table = _start_run_dir(config)
    run_dir = config.run_dir
    torch.manual_seed(config.seed)
    model_config, backbone, lm_head = build(config.model, config.shape)
    model = Model(backbone, lm_head)
    optimizer = _optimizer(model, config)
    generator = torch.Generator().manual_seed(config.seed)
    recorder = IndexerRecorder(backbone)  # hooks that only record: loading weights below runs no forward
    run = _Run(config, task_table, model, model_config, optimizer, generator, recorder)
    start = _resume_or_init(run)
    with (run_dir / "stretches.jsonl").open("a") as stretches:
        record = {"from_step": start, "commit": _git_commit(), "config": asdict(config)}
        stretches.write(json.dumps(record, default=str) + "\n")
    model.train()
    log = (run_dir / "log.jsonl").open("a")
    end = min(config.total_steps, config.stop_at or config.total_steps)
    bar = tqdm(range(start, end), initial=start, total=config.total_steps, desc=config.model)
    with fast_linear_kernels():
        for step in bar:
            row = _train_step(run, step)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(
                len=row["length"],
                lm=f"{row['lm']:.3f}",
                ans=f"{row['answer']:.3f}",
                idx=f"{row['indexer']:.3f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
            )
            done = step + 1
            if done % config.eval_every == 0 or done == config.total_steps:
                _evaluate_and_log(run, done, log)
            if done % config.save_every == 0 or done == end:
                _save(run_dir, model, model_config, optimizer, done, generator)
                plot(run_dir)
    log.close()
    recorder.close()
    return _checkpoint_dir(run_dir)
