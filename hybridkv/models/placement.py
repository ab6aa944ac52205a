"""Where a checkpoint's weights go — one device, or spread over several GPUs — decided from the
memory arithmetic, which is shown before anything is loaded.

The arithmetic needs no weights: the checkpoint's safetensors headers give every tensor's shape
(the bytes follow from the load dtype), and the library's own modules on the meta device give
the cache per token and the linear states (`hybridkv.models.meta.cache_sizes`). A model that
fits one GPU with its cache loads there; one that does not is spread layer by layer over every
GPU by transformers' `device_map="auto"` (accelerate), each GPU keeping room for its share of
the cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.errors import HybridKVError

GIB = 1024**3
# Of a GPU's free memory, the share the weights and the cache may take: the rest is for
# activations of a long prefill and the allocator's fragmentation.
USABLE = 0.85


def checkpoint_parameters(directory: Path) -> int:
    """Elements of every tensor in a checkpoint's safetensors files, read from their headers only."""
    from safetensors import SafetensorError, safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HybridKVError(f"{directory}: no *.safetensors files to size the weights from")
    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                names = handle.keys()  # noqa: SIM118 (a safetensors handle is not iterable)
                total += sum(torch.Size(handle.get_slice(name).get_shape()).numel() for name in names)
        except (OSError, SafetensorError, json.JSONDecodeError) as err:
            raise HybridKVError(f"{file}: unreadable safetensors header ({err})") from err
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """What a run holds on its devices, in bytes."""

    weight_bytes: int
    kv_bytes_per_token: int  # every attention layer
    state_bytes: int  # one set of linear states (every linear layer)
    context_tokens: int  # the longest prompt the run holds at once

    @property
    def cache_bytes(self) -> int:
        """The running cache at the longest prompt, plus the captured prompt it resumes from."""
        return 2 * (self.kv_bytes_per_token * self.context_tokens + self.state_bytes)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    def lines(self) -> list[str]:
        kv = 2 * self.kv_bytes_per_token * self.context_tokens
        return [
            f"weights       {self.weight_bytes / GIB:9.2f} GiB",
            f"KV            {self.kv_bytes_per_token / 1024:9.1f} KiB/token x {self.context_tokens:,} tokens, "
            f"x2 (running cache and the cached prompt) = {kv / GIB:.2f} GiB",
            f"linear states {self.state_bytes / 2**20:9.1f} MiB per set, x2",
            f"total         {self.total_bytes / GIB:9.2f} GiB",
        ]


@dataclass(frozen=True)
class Placement:
    """One device (`device_map` None), or a spread: transformers' `device_map="auto"` within `max_memory`."""

    device: torch.device  # where inputs are handed in (the first GPU of a spread)
    device_map: str | None = None
    max_memory: dict[int, int] | None = None
    reason: str = ""


def choose_placement(plan: MemoryPlan, free: list[int]) -> Placement:
    """Place a model on GPUs with `free` bytes each (the CPU when there are none)."""
    if not free:
        return Placement(torch.device("cpu"), reason="no GPU: the CPU")
    usable = [int(f * USABLE) for f in free]
    best = max(range(len(free)), key=usable.__getitem__)
    if plan.total_bytes <= usable[best]:
        return Placement(
            torch.device(f"cuda:{best}"),
            reason=f"fits on cuda:{best} ({plan.total_bytes / GIB:.1f} of {usable[best] / GIB:.1f} GiB usable)",
        )
    if plan.total_bytes > sum(usable):
        raise HybridKVError(
            f"the model needs {plan.total_bytes / GIB:.1f} GiB with its cache and the {len(free)} GPU(s) have "
            f"{sum(usable) / GIB:.1f} GiB usable ({USABLE:.0%} of free); use fewer --context tokens or a smaller dtype"
        )
    # Each GPU keeps room for the cache of the layers it will hold, in proportion to its share.
    cache_share = plan.cache_bytes / sum(usable)
    max_memory = {index: int(room * (1 - cache_share)) for index, room in enumerate(usable)}
    return Placement(
        torch.device("cuda:0"),
        device_map="auto",
        max_memory=max_memory,
        reason=f"spread over {len(free)} GPUs ({plan.total_bytes / GIB:.1f} GiB, more than one holds)",
    )


def free_gpu_memory() -> list[int]:
    """Free bytes on each visible GPU (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count())]
