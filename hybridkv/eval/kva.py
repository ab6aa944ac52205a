"""`hybridkv arena export --format kva`: an arena run's answers as KVShareArena result files.

KVShareArena (github.com/xishi404/KVShareArena, `kvsharearena/schema.py`, read, not copied) takes
one `kva.result.v1` JSON document per method, track and subset:

    {"schema": "kva.result.v1",
     "summary": {method, track, subset, model, n, backend, versions, git_rev, ...},
     "results": [{_id, pred, golds, f1_raw, recomputed_layer_tokens, dense_payload_layer_tokens,
                  kv_bytes, ttft_ms, ...}, ...],          # n of them, one per _id
     "method_card": {name, provenance, backend, versions, cost_notes, training_data}}

Its scorer recomputes `f1_raw` from `pred` and `golds` and PGR = (method − floor) / (oracle −
floor) from the means over the samples, None when oracle − floor ≤ 1e-3 — the arena's own PGR
(`hybridkv.eval.stats.pgr`) with no-context as the floor and full prefill as the oracle. Its
anchors (the floor's and the oracle's per-sample F1) are its own model's, so the export also writes
`anchors_<model>.json` in its anchors layout from this run's no-context and full rows:
`kva score FILE --anchors anchors_<model>.json` then gives the PGR the arena's summary gives.

The cost fields, from the arena's rows (`aux` keeps the arena's own numbers):
- `recomputed_layer_tokens`: layer-tokens run at answer time, less the question's (KVShareArena
  counts the payload only);
- `dense_payload_layer_tokens`: the context's tokens × layers. The payload here is the whole cached
  context, the template's head included (the arena caches it as a chunk; KVShareArena prefills it);
- `kv_bytes`: attention KV plus linear-layer state bytes held for the context, in the run's dtype;
- `ttft_ms`: cache in hand to first-token logits; the cache build's time is `aux.build_ms`.

The model, dtype, device and versions come from OUT/run.json, which `arena run` writes.
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.eval.jsonl import read_json_object

SCHEMA = "kva.result.v1"
SUMMARY_KEYS = ("method", "track", "subset", "model", "n", "backend", "versions", "git_rev")
ITEM_KEYS = ("_id", "pred", "golds", "f1_raw", "recomputed_layer_tokens", "dense_payload_layer_tokens", "kv_bytes",
             "ttft_ms")  # fmt: skip
CARD_KEYS = ("name", "provenance", "backend", "versions", "cost_notes", "training_data")
PROVENANCE = ("official", "port", "reference")
BACKEND = "hybridkv-transformers"
RUN_FILE = "run.json"
COST_NOTES = (
    "hybridkv arena telemetry counted on tensors: recomputed_layer_tokens = tokens run through the model at answer "
    "time x layers (plus a selection pass's layer-tokens), less the question's; dense_payload_layer_tokens = context "
    "tokens (the LongBench template head and every chunk) x layers; kv_bytes = attention KV plus linear-layer state "
    "bytes held for the context, in the run's dtype; ttft_ms = host wall time from the cache in hand to the first "
    "token's logits; the cache build is apart (aux.build_ms)"
)


# ---------------------------------------------------------------------------------------------
# What the run used


def _git_rev() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import hybridkv

    found = {"hybridkv": hybridkv.__version__}
    for package in ("torch", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


# What makes a run this run: a resumed run must ask for exactly these again, or its rows would mix
# models, prompts or answer caps. Each key with the `arena run` option that sets it.
RUN_OPTIONS = {"model": "--model", "cache_model": "--cache-model", "dtype": "--dtype", "seed": "--seed",
               "max_new_tokens": "--max-new-tokens", "workload": "--workload", "tasks": "--tasks",
               "lengths": "--lengths", "samples": "--samples", "data": "--data", "engine": "--engine"}  # fmt: skip


def _options(run: dict, keys: list[str]) -> str:
    def value(v) -> str:
        return ",".join(map(str, v)) if isinstance(v, list) else "none" if v is None else str(v)

    return " ".join(f"{RUN_OPTIONS[k]} {value(run[k])}" for k in keys)


def check_resume(out: Path, **run) -> None:
    """Refuse, in one line, to add to OUT with other options than those it was started with
    (`RUN_OPTIONS`'s keys; a run.json written before a key was recorded is not checked on it)."""
    path = Path(out) / RUN_FILE
    if not path.exists():
        return
    old = _read_run(path)
    json_run = json.loads(json.dumps(run))  # lists and None as run.json holds them
    changed = [k for k in RUN_OPTIONS if k in json_run and k in old and old[k] != json_run[k]]
    if changed:
        raise HybridKVError(
            f"{out} was started with {_options(old, changed)}, not {_options(json_run, changed)}: "
            "give the same options to resume it, or use another --out"
        )


def record_run(out: Path, *, device: str, **run) -> None:
    """Write OUT/run.json: the run's options (`RUN_OPTIONS`'s keys), the device, versions and git
    revision, for the exports and for `check_resume`; a resumed run keeps the file it started with
    (the caller has run `check_resume` before loading anything)."""
    path = Path(out) / RUN_FILE
    if path.exists():
        return
    info = {**run, "device": device, "versions": versions(), "git_rev": _git_rev()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2) + "\n")


def _read_run(path: Path) -> dict:
    return read_json_object(path, "run record")


# ---------------------------------------------------------------------------------------------
# The schema


def problems(doc: dict) -> list[str]:
    """What keeps `doc` from being a kva.result.v1 document (empty: none), by the rules of
    KVShareArena's `validate` without its frozen-queryset checks (100 samples, the release's _ids)."""
    found = []
    if doc.get("schema") != SCHEMA:
        found.append(f"schema is {doc.get('schema')!r}, not {SCHEMA}")
    summary = doc.get("summary") or {}
    found += [f"summary has no {key}" for key in SUMMARY_KEYS if key not in summary]
    rows = doc.get("results")
    if not isinstance(rows, list):
        found.append("results is not a list")
        rows = []
    if summary.get("n") != len(rows):
        found.append(f"summary.n is {summary.get('n')!r} but results holds {len(rows)}")
    ids = [row.get("_id") for row in rows]
    if len(set(ids)) != len(ids):
        found.append("an _id occurs twice in results")
    for index, row in enumerate(rows):
        found += [f"results[{index}] has no {key}" for key in ITEM_KEYS if key not in row]
        for key in ("recomputed_layer_tokens", "dense_payload_layer_tokens", "kv_bytes"):
            value = row.get(key)
            if value is not None and (not isinstance(value, int | float) or value < 0):
                found.append(f"results[{index}].{key} is not a non-negative number: {value!r}")
    card = doc.get("method_card") or {}
    found += [f"method_card has no {key}" for key in CARD_KEYS if key not in card]
    if card.get("provenance") not in PROVENANCE:
        found.append(f"method_card.provenance is not one of {', '.join(PROVENANCE)}")
    return found


def provenance(method: str) -> str:
    """reference: the floor and the oracle; port: the position-independent pairs (EPIC, CacheBlend,
    ProphetKV, LinearKV, HYPIC reimplemented) and methods from outside; official: hybridkv's own."""
    from hybridkv.methods import METHODS

    if method in ("no-context", "full"):
        return "reference"
    return "official" if method in METHODS else "port"


# ---------------------------------------------------------------------------------------------
# The export


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+@-]+", "-", text).strip("-") or "x"


def _item(row: dict, sample, f1: float) -> dict:
    prompt = row["context_tokens"] + row["question_tokens"]
    layers, rest = divmod(row["dense_layer_tokens"], prompt) if prompt else (0, 0)
    if rest:
        raise HybridKVError(f"row {row['id']}/{row['method']}: dense_layer_tokens is not a multiple of its prompt")
    return {
        "_id": sample.meta["_id"],
        "pred": row["prediction"],
        "golds": row["golds"],
        "f1_raw": f1,
        "n_chunks": len(sample.chunks) - 1,  # the record's own chunks (or notes), not the template head
        "recomputed_layer_tokens": max(0, row["recomputed_layer_tokens"] - row["question_tokens"] * layers),
        "dense_payload_layer_tokens": row["context_tokens"] * layers,
        "kv_bytes": row["kv_bytes"] + row["state_bytes"],
        "ttft_ms": row["ttft_s"] * 1000.0,
        "aux": {
            "hybridkv_id": row["id"],
            "build_ms": row["build_s"] * 1000.0,
            "context_tokens": row["context_tokens"],
            "question_tokens": row["question_tokens"],
            "chunks": row["chunks"],
            "layers": layers,
            "reused_tokens": row["reused_tokens"],
            "replayed_tokens": row["replayed_tokens"],
            "recomputed_tokens": row["recomputed_tokens"],
            "recomputed_layer_tokens": row["recomputed_layer_tokens"],
            "dense_layer_tokens": row["dense_layer_tokens"],
            "attention_kv_bytes": row["kv_bytes"],
            "state_bytes": row["state_bytes"],
        },
    }


@dataclass(frozen=True)
class _Run:
    """What every exported file says of the run as a whole: the model that answered, the versions
    and git revision it ran on (run.json's, else this process's), and run.json itself."""

    model: str
    versions: dict
    git_rev: str | None
    record: dict


def _read_results(run_dir: Path) -> list[dict]:
    """RUN_DIR/results.jsonl's rows, refused when there are none or some are not kvsharearena's."""
    from hybridkv.eval.arena import read_rows

    results = run_dir / "results.jsonl"
    if not results.exists():
        raise HybridKVError(f"{results}: no results to export")
    rows = read_rows(results)
    if not rows:
        raise HybridKVError(f"{results}: no results to export")
    if others := sorted({row["workload"] for row in rows} - {"kvsharearena"}):
        raise HybridKVError(
            f"{run_dir} holds {', '.join(others)} rows; --format kva exports --workload kvsharearena runs"
        )
    return rows


def _read_run_facts(run_dir: Path, model: str | None) -> _Run:
    """The run's model (`model` overrides run.json's; one of them must say), versions and revision."""
    run_file = run_dir / RUN_FILE
    run = _read_run(run_file) if run_file.exists() else {}
    if model is None and "model" not in run:
        raise HybridKVError(f"{run_dir}: no {RUN_FILE} says which model answered; pass --model NAME")
    model = model or run["model"]
    run_versions = run.get("versions") or versions()
    git_rev = run["git_rev"] if "git_rev" in run else _git_rev()
    return _Run(model, run_versions, git_rev, run)


def _queryset(meta: dict) -> dict:
    """The release files the samples came from, with their hashes, as KVShareArena names them."""
    queryset = {"file": meta["file"], "sha256": meta["sha256"],
                "manifest_checked": meta.get("manifest_checked")}  # fmt: skip
    if "reports_file" in meta:
        queryset.update({"reports_file": meta["reports_file"], "reports_sha256": meta["reports_sha256"]})
    return queryset


def _result_doc(key: tuple, items: list[dict], first, summary_row: dict, run: _Run, samples: dict) -> dict:
    """One kva.result.v1 document: the (task, length, method, budget) group `key`'s `items`,
    `first` its first sample, `summary_row` the arena summary's row for it (its PGR)."""
    task, length, method, budget = key
    name = method if budget is None else f"{method}@{budget}"
    cap = run.record.get("max_new_tokens")
    budget_tokens = first.meta["tokens_to_generate"] if cap is None else min(cap, first.meta["tokens_to_generate"])
    return {
        "schema": SCHEMA,
        "summary": {
            "method": name,
            "track": first.meta["track"],
            "subset": first.meta["subset"],
            "model": run.model,
            "n": len(items),
            "backend": BACKEND,
            "versions": run.versions,
            "git_rev": run.git_rev,
            "max_new_tokens": budget_tokens,
            "queryset": _queryset(first.meta),
            "f1_raw": statistics.fmean(item["f1_raw"] for item in items),
            "pgr": summary_row["pgr"],
            "pgr_ci95": summary_row["pgr_ci95"],
            "recompute_fraction": sum(i["recomputed_layer_tokens"] for i in items)
            / max(1, sum(i["dense_payload_layer_tokens"] for i in items)),
            "hybridkv": {
                "workload": "kvsharearena",
                "task": task,
                "length": length,
                "method": method,
                "budget": budget,
                "dtype": run.record.get("dtype"),
                "device": run.record.get("device"),
                "samples_in_run": sum(1 for s in samples.values() if s.task == task and s.length == length),
                "receiver": "LongBench template, no system prompt, no chat template",
            },
        },
        "results": items,
        "method_card": {
            "name": name,
            "provenance": provenance(method),
            "backend": BACKEND,
            "versions": run.versions,
            "cost_notes": COST_NOTES,
            "training_data": None,
        },
    }


def _anchors_doc(model: str, settings: dict[tuple, dict]) -> dict | None:
    """One length's anchors file in KVShareArena's layout: per (track, subset), the floor's and the
    oracle's per-sample F1; None when no setting has both."""
    tracks: dict[str, dict] = defaultdict(dict)
    for (track, subset), anchor in sorted(settings.items()):
        if {"floor", "oracle"} <= anchor.keys():
            tracks[track][subset] = {**anchor, "sources": {"floor": "no-context", "oracle": "full"}}
    if not tracks:
        return None
    return {
        "model": model,
        "model_slug": _slug(model.rstrip("/").split("/")[-1]),
        "caliber": "KVShareArena f1_raw (LongBench token F1), recomputed by hybridkv",
        "pgr_def": "PGR=(method-floor)/(oracle-floor); floor = hybridkv no-context, oracle = hybridkv full "
        "prefill, same model, same samples",
        "tracks": tracks,
    }


def _write_json(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def export_kva(run_dir: Path, to: Path | None = None, model: str | None = None) -> list[Path]:
    """Write one kva.result.v1 file per (method, budget, task) of a `--workload kvsharearena` run,
    and the run's anchors file, into `to` (default RUN_DIR/kva; one folder per length when the run
    has several); return the paths written. F1 is recomputed from the stored predictions."""
    from hybridkv.eval.summary import rescore, summarise
    from hybridkv.eval.workloads.frozen import load_frozen
    from hybridkv.eval.workloads.kvsharearena import f1_raw

    run_dir = Path(run_dir)
    to = Path(to) if to is not None else run_dir / "kva"
    rows = _read_results(run_dir)
    samples = {sample.id: sample for sample in load_frozen(run_dir / "samples.jsonl")}
    run = _read_run_facts(run_dir, model)
    rows = rescore(rows, lambda row: f1_raw(row["prediction"], row["golds"]))
    for row in rows:
        if row["id"] not in samples:
            raise HybridKVError(f"{run_dir / 'results.jsonl'}: row {row['id']} has no sample in samples.jsonl")
    ours = {(r["task"], r["length"], r["method"], r["budget"]): r for r in summarise(rows)["rows"]}
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        groups[(row["task"], row["length"], row["method"], row["budget"])][row["id"]] = row  # the last row wins
    lengths = sorted({length for _, length, _, _ in groups})
    written = []
    anchors: dict[int, dict] = defaultdict(lambda: defaultdict(dict))
    order = {sample_id: index for index, sample_id in enumerate(samples)}
    for key, by_id in sorted(groups.items(), key=lambda kv: str(kv[0])):
        _, length, method, _ = key
        folder = to / str(length) if len(lengths) > 1 else to
        picked = sorted(by_id.values(), key=lambda row: order[row["id"]])
        first = samples[picked[0]["id"]]
        items = [_item(row, samples[row["id"]], row["score"]) for row in picked]
        doc = _result_doc(key, items, first, ours[key], run, samples)
        track, subset, name = first.meta["track"], first.meta["subset"], doc["summary"]["method"]
        if method in ("no-context", "full"):
            anchor = "floor" if method == "no-context" else "oracle"
            anchors[length][(track, subset)][anchor] = {item["_id"]: item["f1_raw"] for item in items}
        if found := problems(doc):
            raise HybridKVError(f"{name} {track}/{subset}: the export is not {SCHEMA}: {'; '.join(found)}")
        folder.mkdir(parents=True, exist_ok=True)
        written.append(_write_json(folder / f"{_slug(name)}_{track}_{subset}.json", doc))
    for length, settings in sorted(anchors.items()):
        if (doc := _anchors_doc(run.model, settings)) is None:
            continue
        folder = to / str(length) if len(lengths) > 1 else to
        written.append(_write_json(folder / f"anchors_{doc['model_slug']}.json", doc))
    return written


__all__ = ["SCHEMA", "check_resume", "export_kva", "problems", "provenance", "record_run", "versions"]
