"""The `hybridkv` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridkv.errors import HybridKVError
from hybridkv.models.tiny import DEFAULT_MODEL, TINY_MODELS


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    from hybridkv.methods import METHODS

    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Token-level prefix KV-cache reuse for hybrid LLMs, measured against full prefill.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser(
        "validate",
        help="measure every recovery method against full prefill on a prefix-hit workload",
        description=(
            "A cached prompt and a new prompt share exactly their first L tokens, then diverge. The new "
            "prompt hits the cache at L and each method resumes from there; its next-token distributions over "
            "the suffix are compared with full prefill of the same prompt (KL, top-1, greedy agreement), and its "
            "time to first token is measured beside full prefill's in the same run. Prints a table and writes "
            "OUT/results.json and OUT/report.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    validate.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"built-in model ({', '.join(TINY_MODELS)}) or a checkpoint directory"
    )
    validate.add_argument("--prefix-lengths", type=_int_list, default="1000,2048", help="matched prefix lengths L")
    validate.add_argument(
        "--suffix-length", type=int, default=64, help="new tokens after the match (fidelity positions)"
    )
    validate.add_argument(
        "--budgets", default="0.05,0.1", help="replay budgets: fractions of L in [0, 1], or token counts like 256tok"
    )
    validate.add_argument("--methods", default=",".join(METHODS), help=f"comma list of methods: {', '.join(METHODS)}")
    validate.add_argument(
        "--checkpoint-interval", type=int, default=384, help="store linear-state checkpoints every B tokens (0: none)"
    )
    validate.add_argument("--seed", type=int, default=0, help="seed for the tiny model's weights and the prompts")
    validate.add_argument("--repeats", type=int, default=3, help="timing repeats (TTFT is the median)")
    validate.add_argument("--greedy-tokens", type=int, default=16, help="G, tokens of greedy continuation compared")
    validate.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    validate.add_argument(
        "--store",
        default=None,
        help="put the cached prompt through this store and serve the hit from it: memory://, file:///DIR, "
        "redis://HOST:PORT, valkey://HOST:PORT, lmcache://… (default: keep it in this process)",
    )
    validate.add_argument("--cache-salt", default="", help="tenant salt: prompts of one salt never hit another's")
    validate.add_argument("--out", type=Path, default=Path("out/validate"), help="output directory")
    validate.add_argument("--no-progress", action="store_true", help="no progress bar")

    store = commands.add_parser(
        "store",
        help="inspect or empty a store",
        description="Entry count and bytes of a store, or remove every hybridkv entry from it.",
    )
    store.add_argument("action", choices=["stats", "clear"])
    store.add_argument("--store", required=True, help="store URL, as for validate --store")
    return parser


def _validate(args: argparse.Namespace) -> None:
    import torch

    from hybridkv.eval.validate import ValidateConfig, run_validate
    from hybridkv.methods import Budget
    from hybridkv.models import load_model
    from hybridkv.report.validate_report import format_table, write_outputs

    if args.threads:
        torch.set_num_threads(args.threads)
    config = ValidateConfig(
        model=args.model,
        prefix_lengths=args.prefix_lengths,
        suffix_length=args.suffix_length,
        budgets=[Budget.parse(part) for part in args.budgets.split(",") if part.strip()],
        methods=[part.strip() for part in args.methods.split(",") if part.strip()],
        checkpoint_interval=args.checkpoint_interval or None,
        seed=args.seed,
        repeats=args.repeats,
        greedy_tokens=args.greedy_tokens,
        store=args.store,
        cache_salt=args.cache_salt,
    )
    config.check()
    model = load_model(args.model, seed=args.seed)
    results = run_validate(model, config, show_progress=not args.no_progress)
    print(format_table(results["rows"]))
    if results["store"] is not None:
        events = ", ".join(f"{k} {v}" for k, v in sorted(results["store"]["events"].items())) or "none"
        print(f"\nstore {results['store']['url']}: {events}")
    json_path, md_path = write_outputs(results, args.out)
    print(f"\nwrote {json_path} and {md_path}")


def _store(args: argparse.Namespace) -> None:
    import json

    from hybridkv.store import StoreError, open_store

    store = open_store(args.store)
    try:
        if args.action == "stats":
            print(json.dumps({"url": args.store, **store.stats()}, indent=2))
        else:
            print(f"removed {store.clear()} entries from {args.store}")
    except StoreError as err:
        raise HybridKVError(str(err)) from err
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "validate":
            _validate(args)
        elif args.command == "store":
            _store(args)
    except HybridKVError as err:
        print(f"hybridkv: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
