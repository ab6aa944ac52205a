"""Position-independent methods as pairs, `ATTENTION+LINEAR` (e.g. `epic+linearkv`), one executor."""

from __future__ import annotations

from hybridkv.errors import HybridKVError
from hybridkv.methods.chunked.base import AttentionPolicy, ChunkOutcome, LinearPolicy, execute_chunks
from hybridkv.methods.chunked.cacheblend import CacheBlend
from hybridkv.methods.chunked.compose import Compose
from hybridkv.methods.chunked.epic import Epic
from hybridkv.methods.chunked.linearkv import LinearKV
from hybridkv.methods.chunked.naive import Naive
from hybridkv.methods.chunked.position_corrected import PositionCorrected
from hybridkv.methods.chunked.prophet import Prophet
from hybridkv.methods.chunked.zero import Zero

ATTENTION: dict[str, AttentionPolicy] = {
    policy.name: policy for policy in (Naive(), PositionCorrected(), Epic(), CacheBlend(), Prophet())
}
LINEAR: dict[str, LinearPolicy] = {
    policy.name: policy for policy in (Zero(), LinearKV(), LinearKV(relevant=True), Compose())
}
PAIRS = [f"{a}+{b}" for a in ATTENTION for b in LINEAR]


def parse_pair(name: str) -> tuple[AttentionPolicy, LinearPolicy]:
    """`ATTENTION+LINEAR` -> the two policies, or a one-line error naming the known ones."""
    attention, plus, linear = name.partition("+")
    if not plus or attention not in ATTENTION or linear not in LINEAR:
        raise HybridKVError(
            f"unknown position-independent method {name!r}: ATTENTION+LINEAR with ATTENTION one of "
            f"{', '.join(ATTENTION)} and LINEAR one of {', '.join(LINEAR)}"
        )
    return ATTENTION[attention], LINEAR[linear]


__all__ = ["ATTENTION", "LINEAR", "PAIRS", "ChunkOutcome", "execute_chunks", "parse_pair"]
