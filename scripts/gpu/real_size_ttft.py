"""TTFT of every method at the real sizes of the Tail-Replay paper's models, with random weights.

Timing needs the shapes, not trained weights, so nothing is downloaded: each model is built
from its config straight on the device in the chosen dtype (`hybridkv.models.loader.wrap_modules`),
then `hybridkv ttft`'s runner measures every method beside full prefill (medians over repeats).

    Qwen3.5-4B       qwen3_5_text: hidden 2560, 32 layers (3 Gated DeltaNet : 1 gated attention),
                     16 query / 4 KV heads of 256, vocab 248,320 (its model card); the MLP width
                     (9,216) and linear heads (16 key / 32 value heads of 128, transformers'
                     defaults) are our assumption
    OLMo-Hybrid-7B   olmo_hybrid: transformers' OlmoHybridConfig defaults, documented as
                     allenai/Olmo-Hybrid-7B's configuration

It also records which fast kernels transformers could use (flash-linear-attention,
causal-conv1d, mamba-ssm): without them the linear layers run the PyTorch reference code.
`--tiny` shrinks both models 16x in width and 8x in depth (a CPU smoke test of this script).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, OlmoHybridConfig, Qwen3_5TextConfig

from hybridkv.eval.ttft import TTFT_METHODS, run_ttft, table
from hybridkv.eval.validate import ValidateConfig
from hybridkv.methods import Budget
from hybridkv.models.loader import DTYPES, resolve_device, wrap_modules

KERNELS = {"flash-linear-attention": "fla", "causal-conv1d": "causal_conv1d", "mamba-ssm": "mamba_ssm"}


def qwen3_5_4b(tiny: bool) -> Qwen3_5TextConfig:
    width, depth = (16, 8) if tiny else (1, 1)
    return Qwen3_5TextConfig(
        hidden_size=2560 // width,
        intermediate_size=9216 // width,
        num_hidden_layers=32 // depth,
        num_attention_heads=16 // min(width, 4),
        num_key_value_heads=4 // min(width, 4),
        head_dim=256 // width * 4 if tiny else 256,
        linear_num_key_heads=16 // min(width, 4),
        linear_num_value_heads=32 // min(width, 4),
        linear_key_head_dim=128 // width * 4 if tiny else 128,
        linear_value_head_dim=128 // width * 4 if tiny else 128,
        vocab_size=248320 // (64 if tiny else 1),
        max_position_embeddings=262144,
    )


def olmo_hybrid_7b(tiny: bool) -> OlmoHybridConfig:
    if not tiny:
        return OlmoHybridConfig(max_position_embeddings=65536)
    return OlmoHybridConfig(
        hidden_size=240, intermediate_size=688, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6,
        linear_num_key_heads=6, linear_num_value_heads=6, linear_key_head_dim=24, linear_value_head_dim=48,
        vocab_size=100352 // 64, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=65536,
    )  # fmt: skip


MODELS = {"qwen3.5-4b": qwen3_5_4b, "olmo-hybrid-7b": olmo_hybrid_7b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--prefix-lengths", default="8192,16384,32768")
    parser.add_argument("--budgets", default="0.02,0.05,0.1")
    parser.add_argument("--suffix-length", type=int, default=16)
    parser.add_argument("--checkpoint-interval", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="shrunken models: a smoke test of this script")
    parser.add_argument("--out", type=Path, default=Path("results/gpu-ttft"))
    args = parser.parse_args()
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "kernels_installed": {name: importlib.util.find_spec(module) is not None for name, module in KERNELS.items()},
        "tiny": args.tiny,
    }
    (args.out / "environment.json").write_text(json.dumps(environment, indent=2))
    print(json.dumps(environment))
    for name in args.models.split(","):
        started = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            full = AutoModelForCausalLM.from_config(MODELS[name](args.tiny), dtype=dtype)
        text, decoder, head = full.config.get_text_config(), full.get_decoder(), full.get_output_embeddings()
        model = wrap_modules(name, text, decoder, head, device)
        built = time.perf_counter() - started
        print(f"{name}: {model.description.parameters / 1e9:.2f}B parameters, built and checked in {built:.0f} s")
        config = ValidateConfig(
            model=name,
            prefix_lengths=[int(n) for n in args.prefix_lengths.split(",")],
            suffix_length=args.suffix_length,
            budgets=[Budget.parse(b) for b in args.budgets.split(",")],
            methods=TTFT_METHODS,
            checkpoint_interval=args.checkpoint_interval,
            repeats=args.repeats,
            greedy_tokens=1,
        )
        config.check(model)
        summary = run_ttft(model, config, args.out / name, show_progress=True)
        print(table(summary["rows"]))
        del model, full
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
