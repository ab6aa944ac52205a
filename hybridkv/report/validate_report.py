"""The `hybridkv validate` table (terminal and Markdown) and its files."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [
    ("method", "method", "{}"),
    ("budget", "budget", "{}"),
    ("prefix_length", "L", "{}"),
    ("reused_tokens", "reused", "{}"),
    ("replayed_tokens", "replayed", "{}"),
    ("recomputed_tokens", "recomputed", "{}"),
    ("kl_mean", "KL", "{:.2e}"),
    ("decay_bound", "decay bound", "{:.1e}"),
    ("top1_agreement", "top-1", "{:.3f}"),
    ("greedy_agreement", "greedy", "{:.3f}"),
    ("split_noise_kl", "split KL", "{:.1e}"),
    ("split_noise_max_logit_diff", "split Δlogit", "{:.1e}"),
    ("ttft_s", "TTFT ms", "{:.1f}"),
    ("full_ttft_s", "full ms", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("bound", "bound", "{:.1f}x"),
    ("kv_bytes", "KV MiB", "{:.2f}"),
    ("state_bytes", "state MiB", "{:.2f}"),
]
_SCALE = {"ttft_s": 1e3, "full_ttft_s": 1e3, "kv_bytes": 1 / 2**20, "state_bytes": 1 / 2**20}


def _cells(row: dict) -> list[str]:
    cells = []
    for key, _, fmt in COLUMNS:
        value = row.get(key)
        if value is None:
            cells.append("—")
        else:
            cells.append(fmt.format(value * _SCALE[key] if key in _SCALE else value))
    return cells


def format_table(rows: list[dict]) -> str:
    """A plain-text table for the terminal."""
    header = [title for _, title, _ in COLUMNS]
    body = [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
        for line in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    header = [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def render_report(results: dict) -> str:
    model, config = results["model"], results["config"]
    kinds = model["layer_kinds"]
    return "\n".join(
        [
            f"# hybridkv validate — {model['name']}",
            "",
            f"Model `{model['model_type']}`: {model['num_layers']} layers "
            f"({len(model['linear_layers'])} linear, {len(model['attention_layers'])} attention; "
            f"pattern `{' '.join(k[0] for k in kinds)}`), {model['parameters'] / 1e6:.2f}M parameters; "
            f"{model['kv_bytes_per_token']} B of attention KV per token, "
            f"{model['state_bytes_per_checkpoint'] / 1024:.1f} KiB per linear-state checkpoint.",
            "",
            f"Workload: cached and new prompt share exactly L tokens (L = {config['prefix_lengths']}), then "
            f"diverge; suffix {config['suffix_length']} tokens; checkpoints every {config['checkpoint_interval']} "
            f"tokens; seed {config['seed']}; {config['torch_threads']} torch threads.",
            "",
            f"Reference: {results['reference']}. KL is mean KL(full ‖ method) in nats; top-1 is the share of "
            f"suffix positions with the same argmax; greedy is the common leading run of {config['greedy_tokens']} "
            "greedily decoded tokens, as a fraction. `decay bound`: how much of the linear states a method drops "
            "can survive to the hit, from the gates summarised at caching time (0: exact states; 1: no guarantee). "
            "`split KL` / `split Δlogit` (largest absolute logit "
            "difference) are the noise floor: the same model run as prefix pass + suffix from an exactly kept cache, "
            "against one pass (non-zero only where transformers' "
            "outputs depend on how a prompt is split, e.g. glm5_next past its DSA index_topk).",
            "",
            f"TTFT: cache in hand to first-token logits, median of {config['repeats']} repeats, each method timed "
            "beside full prefill in the same run. Token counts: reused = prompt tokens whose attention KV came from "
            "the cache, replayed = matched-prefix tokens pushed through the model, recomputed = prompt tokens whose "
            "KV was computed. KV / state MiB: bytes the scheme holds for the cached prompt.",
            "",
            format_markdown(results["rows"]),
            "",
            *_store_lines(results.get("store")),
        ]
    )


def _store_lines(store: dict | None) -> list[str]:
    if store is None:
        return ["Cache: kept in this process (no store)."]
    events = ", ".join(f"{name} {count}" for name, count in sorted(store["events"].items())) or "none"
    return [
        f"Cache: through the store `{store['url']}`; the hit is what came back (`matched_length` in results.json). "
        f"Store events: {events}."
    ]


def write_outputs(results: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "report.md"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(render_report(results))
    return json_path, md_path
