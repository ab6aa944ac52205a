"""Load a hybrid causal LM — a built-in tiny model or a local checkpoint directory.

Whatever the architecture, hybridkv talks to it through `HybridModel`: a backbone that returns
hidden states (the transformers implementation, untouched) and an LM head applied only to the
positions whose logits are wanted, so replayed tokens never pay for the vocabulary projection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hybridkv.errors import HybridKVError
from hybridkv.models.adapter import (
    describe_layers,
    new_cache,
    read_kv,
    read_states,
    write_kv,
    write_states,
)
from hybridkv.models.arch import architecture_for
from hybridkv.models.describe import ModelDescription, attention_flops_per_context_token, count_parameters
from hybridkv.models.kv import LinearState, LinearStates
from hybridkv.models.placement import Placement
from hybridkv.models.tiny import BUILTIN_MODELS, RANDOM_MODELS, TRAINED_MODELS


@dataclass
class HybridModel:
    name: str
    config: PreTrainedConfig  # the text decoder's config
    backbone: nn.Module  # input ids -> last hidden state, with a transformers cache
    lm_head: nn.Module
    description: ModelDescription
    # a model spread over several GPUs: where each decoder layer lives (its cache layer goes there)
    layer_devices: dict[int, torch.device] | None = None

    def new_cache(self) -> DynamicCache:
        return new_cache(self.config, self.device, self.layer_devices)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The config's end-of-sequence ids that lie inside the vocabulary."""
        eos = getattr(self.config, "eos_token_id", None)
        ids = eos if isinstance(eos, list | tuple) else [] if eos is None else [eos]
        return frozenset(i for i in ids if 0 <= i < self.config.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, cache: DynamicCache, start: int, logits_to_keep: int = 0
    ) -> torch.Tensor | None:
        """Run `tokens` (1-D, positions start, start+1, …) on top of `cache`, updating it in place.

        Returns the logits of the last `logits_to_keep` positions as float32 [n, vocab], or None.
        """
        positions = torch.arange(start, start + tokens.numel()).unsqueeze(0)
        logits = self.forward_batch(tokens.unsqueeze(0), cache, positions, None, logits_to_keep)
        return None if logits is None else logits[0]

    @torch.inference_mode()
    def forward_batch(
        self,
        tokens: torch.Tensor,
        cache: DynamicCache,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor | None:
        """Rows of `tokens` [B, T] at `positions` [B, T]; `attention_mask` [B, cached + T] marks padding.

        Returns float32 logits [B, logits_to_keep, vocab] on the CPU, or None. Inputs may be on
        the CPU; they move to the model's device here.
        """
        device = self.device
        hidden = self.backbone(
            input_ids=tokens.to(device),
            position_ids=positions.to(device),
            attention_mask=None if attention_mask is None else attention_mask.to(device),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        if logits_to_keep == 0:
            return None
        return self.lm_head(hidden[:, -logits_to_keep:]).float().cpu()

    @torch.inference_mode()
    def attention_weights(self, tokens: torch.Tensor, cache: DynamicCache, start: int) -> list[torch.Tensor]:
        """Run `tokens` (1-D, positions start, …) on top of `cache` and return every attention layer's
        attention weights [heads, len(tokens), cached + len(tokens)] (float32, CPU).

        transformers returns weights only from its eager attention, so the decoder is switched to it
        for this call and back afterwards (the numbers are the same; only the kernel differs)."""
        previous = self.backbone.config._attn_implementation
        self.backbone.set_attn_implementation("eager")
        try:
            positions = torch.arange(start, start + tokens.numel(), device=self.device).unsqueeze(0)
            outputs = self.backbone(
                input_ids=tokens.to(self.device).unsqueeze(0),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                output_attentions=True,
            )
        finally:
            self.backbone.set_attn_implementation(previous)
        return [weights[0].float().cpu() for weights in outputs.attentions if weights is not None]


def model_from_config(config: PreTrainedConfig) -> tuple[nn.Module, nn.Module]:
    """The library's model for `config`, initialised by the library under the current torch seed."""
    arch = architecture_for(config)
    if arch is not None and arch.decoder_and_head is not None:
        return arch.decoder_and_head(config)
    model = AutoModelForCausalLM.from_config(config)
    return model.get_decoder(), model.get_output_embeddings()


def _seeded_tiny(name: str, seed: int) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    config = RANDOM_MODELS[name]()
    torch.manual_seed(seed)
    return config, *model_from_config(config)


_LAYOUT_PREFIXES = ("model.", "lm_head.")


def architecture_name(model_type: str) -> str:
    """The class a config.json's `architectures` names for these weights: transformers' causal-LM
    class for the model type (what vLLM and `AutoModelForCausalLM` look up), else its bare model
    class (GLM-5.3-Flash's text decoder has no causal-LM class; its head is stored beside it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type)
    if name is None:
        raise HybridKVError(f"transformers has no model class for model type {model_type!r}")
    return name


def write_with_head(directory: Path, config: PreTrainedConfig, backbone: nn.Module, lm_head: nn.Module) -> None:
    """hybridkv's own checkpoint layout (what `hybridkv train` writes): a transformers config.json
    and one model.safetensors holding the backbone under `model.` and the LM head under `lm_head.`.
    It is how a bare `glm5_next_text` decoder is saved, since transformers has no causal-LM class for it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if not getattr(config, "architectures", None):
        config.architectures = [architecture_name(config.model_type)]
    config.save_pretrained(directory)
    tensors = {
        prefix + key: value.contiguous()
        for prefix, module in zip(_LAYOUT_PREFIXES, (backbone, lm_head), strict=True)
        for key, value in module.state_dict().items()
    }
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def read_with_head(directory: Path, backbone: nn.Module, lm_head: nn.Module, label: str) -> None:
    """Load `write_with_head`'s weights into modules built from its config; every tensor must fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise HybridKVError(
            f"{label}: a bare text-decoder checkpoint needs model.safetensors with model.* and lm_head.* tensors "
            "(the layout `hybridkv train` writes), or save the model's multimodal layout"
        )
    try:
        tensors = load_file(weights)
    except (OSError, ValueError, SafetensorError) as err:
        raise HybridKVError(f"{label}: unreadable weights in {directory} ({err})") from err
    for prefix, module in zip(_LAYOUT_PREFIXES, (backbone, lm_head), strict=True):
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0]
            raise HybridKVError(f"{label}: its weights do not match its config ({first})") from err


def _with_head(directory: Path, label: str) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    """A checkpoint in `write_with_head`'s layout."""
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as err:
        raise HybridKVError(f"{label}: unreadable config in {directory} ({err})") from err
    backbone, lm_head = model_from_config(config)
    read_with_head(directory, backbone, lm_head, label)
    return config, backbone, lm_head


def _from_directory(
    path: Path, dtype: torch.dtype, placement: Placement | None = None
) -> tuple[PreTrainedConfig, nn.Module, nn.Module]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HybridKVError(f"{path}: no config.json (expected a transformers checkpoint directory)")
    try:
        config_json = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HybridKVError(f"{config_file}: unreadable ({err})") from err
    if not isinstance(config_json, dict):
        raise HybridKVError(f"{config_file}: not a transformers config (expected a JSON object)")
    model_type = config_json.get("model_type")
    try:
        config = AutoConfig.from_pretrained(path)  # fails early and clearly on an unknown model_type
        arch = architecture_for(config)
        if arch is not None and arch.decoder_and_head is not None and model_type == config.get_text_config().model_type:
            # a text decoder transformers has no causal-LM class for (GLM-5.3-Flash's, which ships
            # inside a multimodal checkpoint): hybridkv's own layout, with its head beside it
            return _with_head(path, str(path))
        # Multimodal checkpoints (GLM-5.3-Flash, LFM2-VL, ...) load as image-text-to-text models
        # when transformers has no causal-LM class for them; hybridkv runs their text decoder only,
        # and the vision and audio towers are freed with the wrapper.
        multimodal = model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        spread = {} if placement is None or placement.device_map is None else {
            "device_map": placement.device_map, "max_memory": placement.max_memory
        }  # fmt: skip
        model = auto.from_pretrained(path, dtype=dtype, **spread)
    except HybridKVError:
        raise
    except (OSError, ValueError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HybridKVError(f"{path}: cannot load checkpoint ({first_line})") from err
    return model.config.get_text_config(), model.get_decoder(), model.get_output_embeddings()


def describe_modules(name: str, config: PreTrainedConfig, backbone: nn.Module, lm_head: nn.Module) -> ModelDescription:
    """What the model caches per layer, read off a probe forward of two tokens (`describe_layers`)."""
    device = lm_head.weight.device
    cache = new_cache(config, device)
    probe = torch.tensor([[1, 2]], device=device)
    try:
        with torch.inference_mode():
            backbone(input_ids=probe, past_key_values=cache, use_cache=True)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HybridKVError(
            f"model {name!r} ({config.model_type}) does not run on a transformers DynamicCache, which is what "
            f"hybridkv caches from ({first})"
        ) from err
    try:
        layers = describe_layers(cache, tokens_seen=probe.shape[1])
    except HybridKVError as err:
        raise HybridKVError(f"model {name!r} ({config.model_type}): {err}") from err
    total, active = count_parameters(backbone, lm_head, config)
    attention_count = sum(bool(spec.token_dims) for spec in layers)
    return ModelDescription(
        name=name,
        model_type=config.model_type,
        layers=layers,
        parameters=total,
        active_parameters=active,
        attention_flops_per_context_token=attention_flops_per_context_token(config, attention_count),
        max_attended_context=getattr(config, "index_topk", None),
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto`: the GPU when there is one, else the CPU; `cuda` without one is an error, not a silent CPU run."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise HybridKVError(f"--device {device}: no CUDA device is available here (use cpu or auto)")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise HybridKVError(f"--device {device!r}: not a device (cpu, cuda, cuda:N or auto)") from err


def load_model(
    name_or_dir: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | Placement = "cpu",
) -> HybridModel:
    """Load a built-in model by name (trained `tiny-*`, or seeded `random-*`), or a checkpoint directory.

    Weights are cast to `dtype` and moved to `device`, or placed as a `Placement` says (a
    checkpoint spread over several GPUs); recurrent states keep the dtype the model library gives
    them (float32 for the delta-rule kernels)."""
    placement = device if isinstance(device, Placement) else Placement(torch.device(device))
    if placement.device_map is not None and not Path(name_or_dir).is_dir():
        raise HybridKVError(f"{name_or_dir}: only a checkpoint directory can be spread over several GPUs")
    if name_or_dir in TRAINED_MODELS:
        config, backbone, lm_head = _with_head(TRAINED_MODELS[name_or_dir], name_or_dir)
        backbone, lm_head = backbone.to(dtype), lm_head.to(dtype)
    elif name_or_dir in RANDOM_MODELS:
        config, backbone, lm_head = _seeded_tiny(name_or_dir, seed)
        backbone, lm_head = backbone.to(dtype), lm_head.to(dtype)
    elif Path(name_or_dir).is_dir():
        config, backbone, lm_head = _from_directory(Path(name_or_dir), dtype, placement)
    else:
        known = ", ".join(BUILTIN_MODELS)
        raise HybridKVError(f"unknown model {name_or_dir!r}: not a directory and not one of {known}")
    return wrap_modules(name_or_dir, config, backbone, lm_head, placement)


def wrap_modules(
    name: str,
    config: PreTrainedConfig,
    backbone: nn.Module,
    lm_head: nn.Module,
    device: torch.device | str | Placement = "cpu",
) -> HybridModel:
    """A `HybridModel` from a transformers decoder and LM head already built (e.g. at a real model's
    size with random weights, straight on a GPU): described, checked as `load_model` checks.
    Modules already spread by a `Placement` stay where they are."""
    placement = device if isinstance(device, Placement) else Placement(torch.device(device))
    layer_devices = None
    if placement.device_map is None:
        backbone, lm_head = backbone.to(placement.device), lm_head.to(placement.device)
    else:
        layer_devices = {i: next(layer.parameters()).device for i, layer in enumerate(backbone.layers)}
    backbone, lm_head = backbone.eval(), lm_head.eval()
    description = describe_modules(name, config, backbone, lm_head)
    if not description.attention_layers:
        raise HybridKVError(f"model {name!r} ({config.model_type}) has no attention layers to cache")
    model = HybridModel(name, config, backbone, lm_head, description, layer_devices)
    tolerance = RESUME_TOLERANCE[model.dtype == torch.float32]
    # Checked before the layer kinds: a model whose recurrent state lives outside its cache
    # (RecurrentGemma keeps it on its modules) shows no linear layers, and that is not the reason.
    if (reason := why_not_resumable(model, tolerance=tolerance)) is not None:
        raise HybridKVError(f"model {name!r} ({config.model_type}) cannot be resumed exactly: {reason}")
    if not description.linear_layers:
        raise HybridKVError(
            f"model {name!r} ({config.model_type}) has no linear-attention or state-space layers; "
            "hybridkv is for hybrid models (a plain transformer's prefix cache needs no state recovery)"
        )
    return model


# Relative error allowed between one forward and a resumed one, for (16-bit, float32) models:
# float reassociation in the chunked kernels gives ~1e-6 in float32 and up to ~1e-2 in bfloat16;
# a state that restarts is off by far more (0.05-0.8 on random checkpoints of Jamba and Zamba).
RESUME_TOLERANCE = (5e-2, 1e-3)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-12))


def _errors(got: LinearStates, want: LinearStates) -> dict[tuple[int, str], float]:
    return {(i, name): _relative(got[i][name], t) for i, s in want.items() for name, t in s.tensors.items()}


@torch.inference_mode()
def why_not_resumable(model: HybridModel, tokens: int = 32, tolerance: float = 1e-3) -> str | None:
    """Why a prompt of this model cannot be resumed from its cache exactly, or None if it can.

    Every hybridkv method assumes two things, checked here on a 32-token probe split 30 + 2 (the
    second part a multi-token forward, short so that a wrong start state decays least):
    - continuing on the model's own cache equals one forward (linear states compared);
    - continuing on a fresh cache rebuilt from the pieces hybridkv moves (attention KV, linear
      states) equals one forward (logits compared): nothing the model needs lives elsewhere.
    Each error is weighed against what starting the 2 tokens from zero recurrent states would give: a
    faithful implementation is far closer to one forward than that, whatever the dtype's noise
    (`tolerance` is the noise allowed outright); one that ignores the state is as far.
    """
    probe = torch.arange(3, 3 + tokens) % model.config.vocab_size
    split_at = tokens - 2
    one, own = model.new_cache(), model.new_cache()
    whole = model.forward(probe, one, start=0, logits_to_keep=2)
    model.forward(probe[:split_at], own, start=0)
    kv, states = read_kv(model.description, own).clone(), read_states(model.description, own)
    model.forward(probe[split_at:], own, start=split_at)

    def resumed_from(start_states: LinearStates) -> tuple[torch.Tensor, LinearStates]:
        cache = model.new_cache()
        write_kv(cache, kv)
        write_states(cache, start_states)
        logits = model.forward(probe[split_at:], cache, start=split_at, logits_to_keep=2)
        return logits, read_states(model.description, cache)

    try:
        resumed, _ = resumed_from(states)
        # What an implementation that ignores the recurrent state would give (conv windows kept).
        restarted = {
            i: LinearState({n: t if n.startswith("conv") else torch.zeros_like(t) for n, t in state.tensors.items()})
            for i, state in states.items()
        }
        zero_logits, zero_end = resumed_from(restarted)
    except (IndexError, RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"a cache rebuilt from its attention KV and linear states fails ({type(err).__name__}: {first})"
    expected = read_states(model.description, one)
    drifts, restarts = _errors(read_states(model.description, own), expected), _errors(zero_end, expected)
    wrong = [key for key, drift in drifts.items() if drift > tolerance and drift > restarts[key] / 2]
    if wrong:
        key = max(wrong, key=drifts.get)
        return (
            f"after {tokens} tokens fed as {split_at} + 2, layer {key[0]}'s {key[1]} state differs from one "
            f"forward's by {drifts[key]:.1e} (relative; starting the 2 tokens from zero states: "
            f"{restarts[key]:.1e}): its transformers implementation does not start a multi-token forward from "
            "the cached state"
        )
    error, zero_error = _relative(resumed, whole), _relative(zero_logits, whole)
    if error > tolerance and error > zero_error / 2:
        return (
            f"a cache rebuilt from its attention KV and linear states gives logits {error:.1e} (relative) away "
            f"from one forward's (zero recurrent states: {zero_error:.1e}): the model keeps state outside its cache "
            "layers"
        )
    return None
