"""transformers' Mamba-2 time-step floor, given back to vLLM's Nemotron-H prefill (a vLLM general plugin).

transformers' Nemotron-H mixer clamps each step size Δt = softplus(dt + dt_bias) at the config's
`time_step_min` in its chunked prefill scan. vLLM 0.32 does not: `MambaMixer2.conv_ssm_forward`
(vllm/model_executor/layers/mamba/mamba_mixer2.py) passes `dt_limit=(0.0, inf)` to the scan for
every model, and `models/nemotron_h.py` hands it no time-step setting. A model trained in
transformers learned the clamped function, and uses the floor: tiny-nemotron-h's long-memory heads
sit 5-10× below it on every token. Without it vLLM's logits part from transformers' from the first
Mamba-2 layer's scan on (float32: mean max |Δlogit| 0.93 against 1e-5 with the floor), served full
prefills run on past the answer (5 of 60 RULER answers), and a state rebuilt from zeros refills
3-10× more slowly, so zero-state tails run on where transformers' end (39 of 60 against 1).
Evidence and a reproduction against plain vLLM: results/vllm-nemotron-h-divergence/.

vLLM loads this in every process it starts (the `vllm.general_plugins` entry point in
pyproject.toml), so the floor holds for vLLM alone as for the connector; `VLLM_PLUGINS` (a comma
list of plugin names, vLLM's own switch) leaves it out when it does not name `hybridkv_mamba_floor`.
Only where vLLM passes no limit of its own is the floor put in, and only for Nemotron-H configs,
the family the difference was measured on; decoding is left as both libraries have it (neither
clamps its one-token step).
"""

from __future__ import annotations

import math
import threading

NO_LIMIT = (0.0, math.inf)
_active = threading.local()  # the floor of the mixer whose forward is running


def transformers_floor(hf_config) -> float:
    """The smallest Δt transformers' prefill allows for this config (0.0: none)."""
    if getattr(hf_config, "model_type", None) != "nemotron_h":
        return 0.0
    return float(getattr(hf_config, "time_step_min", 0.0) or 0.0)


def register() -> None:
    """Wrap vLLM's Mamba-2 mixer: each one built records its model's floor, and its prefill scan
    receives it in place of vLLM's (0, inf). Idempotent."""
    from vllm.logger import init_logger
    from vllm.model_executor.layers.mamba import mamba_mixer2

    logger = init_logger("vllm.hybridkv.mamba_floor")  # under vllm.: vLLM configures only its own loggers

    if getattr(mamba_mixer2, "hybridkv_time_step_floor", False):
        return
    mixer, scan = mamba_mixer2.MambaMixer2, mamba_mixer2.mamba_chunk_scan_combined_varlen
    build, forward = mixer.__init__, mixer.conv_ssm_forward

    def build_with_floor(self, *args, **kwargs) -> None:
        from vllm.config import get_current_vllm_config

        build(self, *args, **kwargs)
        model_config = get_current_vllm_config().model_config
        self.time_step_floor = transformers_floor(model_config.hf_config) if model_config is not None else 0.0
        if self.time_step_floor and not getattr(mixer, "hybridkv_floor_logged", False):
            mixer.hybridkv_floor_logged = True
            logger.info("hybridkv: Mamba-2 prefill clamps dt at time_step_min=%g", self.time_step_floor)

    def forward_with_floor(self, *args, **kwargs):
        _active.floor = getattr(self, "time_step_floor", 0.0)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _active.floor = 0.0

    def scan_with_floor(*args, dt_limit=NO_LIMIT, **kwargs):
        floor = getattr(_active, "floor", 0.0)
        if floor > 0 and tuple(dt_limit) == NO_LIMIT:
            dt_limit = (floor, math.inf)
        return scan(*args, dt_limit=dt_limit, **kwargs)

    mixer.__init__, mixer.conv_ssm_forward = build_with_floor, forward_with_floor
    mamba_mixer2.mamba_chunk_scan_combined_varlen = scan_with_floor
    mamba_mixer2.hybridkv_time_step_floor = True
