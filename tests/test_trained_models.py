"""The trained built-in models ship inside the package, load by name with no download, fit the
size limit, and read their context: full prefill answers the arena's own RULER needles."""

from __future__ import annotations

import json

import pytest

from hybridkv.eval.contract import ArenaConfig, get_arena_method
from hybridkv.eval.workloads import ruler
from hybridkv.models import DEFAULT_MODEL, TRAINED_MODELS
from hybridkv.models.loader import architecture_name
from hybridkv.models.tokenizer import load_tokenizer

NAMES = list(TRAINED_MODELS)
MAX_BYTES = 20 * 2**20


def test_the_default_model_is_a_shipped_trained_model():
    assert DEFAULT_MODEL in TRAINED_MODELS


@pytest.mark.parametrize("name", NAMES)
def test_shipped_weights_fit_and_say_how_they_were_made(name):
    directory = TRAINED_MODELS[name]
    assert (directory / "model.safetensors").stat().st_size <= MAX_BYTES
    card = json.loads((directory / "training.json").read_text())
    shape = card["train_config"]["model"]
    # a second checkpoint of a trained shape (for cross-checkpoint reuse) is named <shape>-<tag>
    assert card["steps"] > 0 and (name == shape or name.startswith(f"{shape}-"))
    # the class that loads it, which vLLM and AutoModelForCausalLM look up (vLLM starts a pooling
    # model for a config without one)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [architecture_name(config["model_type"])]


@pytest.mark.parametrize("name", NAMES)
def test_full_prefill_finds_the_arena_needles_and_stops_at_its_answer(models, name):
    model = models[name]
    tokenizer = load_tokenizer(name)
    method = get_arena_method("full", None)
    config = ArenaConfig(max_new_tokens=32)
    method.setup(model, config)
    right = stopped = 0
    samples = ruler.generate("niah_single_1", 1024, 10, tokenizer, seed=3)
    for sample in samples:
        built = method.build_cache(tokenizer.encode(sample.context))
        answer = method.answer(tokenizer.encode(sample.question), [built.handle], config)
        prediction = tokenizer.decode(answer.tokens)
        right += ruler.score(sample.task, prediction, sample.golds, sample.meta) == 1.0
        # The trained models end their answer: far fewer tokens than the budget.
        stopped += len(answer.tokens) < 20 and answer.tokens[-1] in model.eos_ids
    assert right >= 8, f"{name}: {right}/10 needles found at 1K tokens"
    assert stopped >= 8, f"{name}: {stopped}/10 answers ended with EOS within 20 tokens"
