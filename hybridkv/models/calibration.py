"""A model's forgetting horizon, as `hybridkv calibrate` (`hybridkv.eval.calibrate`) records it
beside the checkpoint: how many tokens back its linear layers still remember. An engine that cannot
read a prompt's own gates (the vLLM connector, "replay_horizon": "calibrated") replays that many
tokens of a hit instead of adaptive-replay's per-prompt length."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridkv.errors import HybridKVError

CALIBRATION_FILE = "hybridkv-calibration.json"


@dataclass(frozen=True)
class Calibration:
    model: str
    tolerance: float  # bound on the zeroed state's surviving share
    quantile: float  # of the shortest tails over end positions
    tokens: int  # per sample prompt
    samples: int
    text: str  # what the prompts were: "essay text" or "random token ids"
    horizon: int | None  # tokens to replay: the slowest layer's; None if some layer never forgets within `tokens`
    layers: list[int | None]  # per linear layer, in the model's order

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> Calibration:
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except FileNotFoundError:
            raise HybridKVError(f"{path}: no calibration; run hybridkv calibrate --model {path.parent}") from None
        except (json.JSONDecodeError, TypeError) as err:
            raise HybridKVError(f"{path}: not a hybridkv calibration ({err})") from None


def calibrated_horizon(model_dir: Path) -> int | None:
    """The horizon recorded beside a checkpoint (None: some layer remembers past the sample)."""
    path = model_dir / CALIBRATION_FILE
    horizon = Calibration.read(path).horizon
    if horizon is not None and (not isinstance(horizon, int) or horizon < 0):
        raise HybridKVError(f"{path}: horizon {horizon!r} is not a token count")
    return horizon
