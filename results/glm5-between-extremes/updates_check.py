"""Held-out `updates` examples (hybridkv/train/data.py; a record set 2-4 times, the latest asked):
full prefill against zero-state (the context's true attention KV, every linear state zeroed at the
question) and tail-replay at 2/5/10/20%, on the examples full prefill solves.
Usage: python updates_check.py MODEL LENGTH SAMPLES."""

import sys

import torch

from hybridkv.cache import CachedMatch, assemble_cache, capture_prompt, zero_states
from hybridkv.eval.decode import greedy_continue
from hybridkv.methods import METHODS, Budget, execute
from hybridkv.models import load_model
from hybridkv.train import data

BUDGETS = ("0.02", "0.05", "0.1", "0.2")
QUESTION = "\nWhat is the current special magic"

torch.set_num_threads(1)
model = load_model(sys.argv[1], seed=0, dtype=torch.float32, device=torch.device("cpu"))
length, samples = int(sys.argv[2]), int(sys.argv[3])
tok = data.TOKENIZER


def answer(cache, logits, at: int) -> str:
    return tok.decode(greedy_continue(model, cache, logits[-1], at, 24, model.eos_ids)).split(".")[0].strip()


solved = zero_kept = 0
kept = {b: 0 for b in BUDGETS}
inside = {b: 0 for b in BUDGETS}  # solved examples whose latest setting lies in the replayed tail
for index in range(samples):
    example = data.example(7, "eval", 0, index, length, data.task_table(("updates:1",)))
    start, end = example.answers[-1]
    text = tok.decode(example.tokens[:start])
    context = tok.encode(text[: text.rindex(QUESTION)])
    question = example.tokens[len(context) : start]
    gold = tok.decode(example.tokens[start:end]).strip().removesuffix(".")
    prompt = torch.tensor(context + question)
    full = execute(model, prompt, None, METHODS["full"].recipe(None, None))
    if answer(full.cache, full.logits, len(prompt)) != gold:
        continue
    solved += 1
    cached = capture_prompt(model, torch.tensor(context), len(context))
    cache = assemble_cache(model, cached.attention, zero_states(model))
    zero_kept += answer(cache, model.forward(torch.tensor(question), cache, len(context), 1), len(prompt)) == gold
    distance = len(context) - len(tok.encode(text[: text.rindex(f" {gold}.")]))
    hit = CachedMatch(cached, len(context))
    for budget in BUDGETS:
        recipe = METHODS["tail-replay"].recipe(hit, Budget.parse(budget))
        outcome = execute(model, prompt, hit, recipe)
        kept[budget] += answer(outcome.cache, outcome.logits, len(prompt)) == gold
        inside[budget] += distance <= len(context) - recipe.state_position
print(f"{sys.argv[1]} updates at {length}: full solves {solved}/{samples}; zero-state keeps {zero_kept}/{solved}")
for budget in BUDGETS:
    print(f"  tail-replay {budget}: keeps {kept[budget]}/{solved} (latest setting inside the tail in {inside[budget]})")
