"""hybridkv train: its speed-ups equal the library's code, its data stays clear of the arena's
evaluation samples, and a resumed run is the run it would have been."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next

from hybridkv.errors import HybridKVError
from hybridkv.eval.workloads import agent_reports, rag, ruler, updates
from hybridkv.models import load_model
from hybridkv.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from hybridkv.train import data
from hybridkv.train.indexer import attention_by_pool, index_scores
from hybridkv.train.kernels import chunk_kda_solve, fast_linear_kernels
from hybridkv.train.loop import TrainConfig, export, parse_schedule, train


def _kda_inputs(length: int, seed: int, heads: int = 2, dim: int = 16, gate_bound: float = 5.0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float()

    q, k, v = (randn(2, length, heads, dim).requires_grad_() for _ in range(3))
    # KDA's gate: log-decays in [-gate_bound, 0), per channel (GLM-5.3-Flash's safe gate: 5).
    g = (-gate_bound * torch.rand(2, length, heads, dim, generator=generator)).requires_grad_()
    beta = torch.rand(2, length, heads, generator=generator).requires_grad_()
    state = randn(2, heads, dim, dim)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("length", "gate_bound"), [(1, 5.0), (37, 5.0), (64, 5.0), (130, 5.0), (130, 40.0)])
def test_triangular_solve_kda_equals_the_library_chunk_kda(length, gate_bound):
    """Outputs, final state and every input gradient, to float32 tolerance (fp32 sums regrouped).
    A bounded gate takes the factored pairwise decays; a steep one (40 per token, hundreds per
    chunk) the elementwise form."""
    reference = modeling_glm5_next.chunk_kimi_delta_attention
    results = []
    for fn in (reference, chunk_kda_solve):
        q, k, v, g, beta, state = _kda_inputs(length, seed=length, gate_bound=gate_bound)
        out, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)  # fmt: skip
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        ((out * weights).sum() + final.square().sum()).backward()
        results.append((out.detach(), final.detach(), [x.grad for x in (q, k, v, g, beta)]))
    (out_ref, final_ref, grads_ref), (out, final, grads) = results
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_fast_kernels_patch_only_inside_the_block_and_keep_the_model_output(models):
    model = models["random-glm5-next"]
    tokens = torch.randint(3, 500, (1, 150), generator=torch.Generator().manual_seed(1))
    library = modeling_glm5_next.chunk_kimi_delta_attention
    with torch.no_grad():
        want = model.backbone(input_ids=tokens, use_cache=False).last_hidden_state
        with fast_linear_kernels():
            assert modeling_glm5_next.chunk_kimi_delta_attention is chunk_kda_solve
            got = model.backbone(input_ids=tokens, use_cache=False).last_hidden_state
    assert modeling_glm5_next.chunk_kimi_delta_attention is library
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _first_attention(model):
    return next(layer.self_attn for layer in model.backbone.layers if hasattr(layer.self_attn, "indexer"))


def _layer_input(model, tokens: torch.Tensor, attention) -> torch.Tensor:
    seen = {}

    def record(module, args, kwargs) -> None:
        seen.setdefault("hidden", kwargs["hidden_states"])

    handle = attention.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model.backbone(input_ids=tokens, use_cache=False)
    handle.remove()
    return seen["hidden"]


def test_indexer_scores_rank_pools_as_the_library_selects_them(models):
    """Every pool the library's indexer keeps scores at least as high (ours) as every complete
    visible pool it drops: the same ranking, ties aside."""
    model = models["random-glm5-next"]
    attention = _first_attention(model)
    pool, keep = attention.indexer.index_kpool, attention.indexer.index_topk // attention.indexer.index_kpool
    length = 40 * pool + 5
    tokens = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(2))
    hidden = _layer_input(model, tokens, attention)
    queries = torch.tensor([keep * pool + 20, 30 * pool + 3, length - 1])
    with torch.no_grad():
        selected = attention.indexer(hidden, attention.q_a_layernorm(attention.q_a_proj(hidden)),
                                     torch.ones(1, length, dtype=torch.bool), None)  # fmt: skip
        scores, _ = index_scores(attention, hidden, queries)
    for row, query in enumerate(queries.tolist()):
        complete = (query + 1) // pool
        chosen = {int(i) // pool for i in selected[0, query] if 0 <= i < complete * pool}
        assert len(chosen) == keep
        dropped = set(range(complete)) - chosen
        ours = scores[0, row]
        assert min(ours[list(chosen)]) >= max(ours[list(dropped)]) - 1e-5


def test_attention_target_is_the_library_attention_summed_by_pool(models):
    model = models["random-glm5-next"]
    attention = _first_attention(model)
    pool = attention.indexer.index_kpool
    length = 12 * pool  # within index_topk: the library's attention is dense
    tokens = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(3))
    hidden = _layer_input(model, tokens, attention)
    queries = torch.tensor([2 * pool, 7 * pool + 9, length - 1])
    recorded = {}

    def record(module, args, output) -> None:
        recorded.setdefault("attn", output[1])

    handle = attention.register_forward_hook(record)
    saved = model.backbone.config._attn_implementation
    model.backbone.config._attn_implementation = "eager"  # eager returns the attention probabilities
    try:
        with torch.no_grad():
            attention(hidden_states=hidden, attention_mask=torch.ones(1, length, dtype=torch.bool))
    finally:
        model.backbone.config._attn_implementation = saved
        handle.remove()
    probs = recorded["attn"][0, :, queries].sum(0)  # [Q, length]
    want = probs.reshape(len(queries), length // pool, pool).sum(-1)
    got = attention_by_pool(attention, hidden, queries, pool)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_examples_are_exact_length_deterministic_and_end_with_their_answer():
    tokenizer = ByteTokenizer()
    seen_tasks = set()
    for index in range(40):
        length = (512, 1024, 2048)[index % 3]
        example = data.example(0, "train", 7, index, length)
        again = data.example(0, "train", 7, index, length)
        assert example == again
        assert len(example.tokens) == length
        seen_tasks.add(example.task.split("_")[0])
        if example.task != "natural":
            assert example.tokens[-1] == data.EOS and example.answers[-1][1] == length
            answers = [tokenizer.decode(example.tokens[start:end]) for start, end in example.answers]
            assert answers[-1].endswith("\n") and all(a.strip() for a in answers)
            ends = [0] + [end for _, end in example.answers]
            assert all(a < b for a, b in zip(ends, ends[1:], strict=False))  # in order, not overlapping
    assert {"niah", "recall", "vt", "natural"} <= seen_tasks
    assert data.example(0, "train", 7, 0, 1024) != data.example(1, "train", 7, 0, 1024)


def test_no_arena_needle_key_or_answer_occurs_in_the_training_stream():
    arena_words = set().union(ruler.ADJECTIVES, ruler.NOUNS, ruler.VERBS, ruler.ADVERBS, ruler.PREPOSITIONS)
    assert not arena_words & set(data.key_words())
    tokenizer = ByteTokenizer()
    probes: set[str] = set()
    for task in ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_3",
                 "niah_multivalue", "niah_multiquery", "vt"):  # fmt: skip
        for sample in ruler.generate(task, 1024, 8, tokenizer, seed=0):
            for needle in sample.meta.get("needles", []):
                probes |= {needle["key"], needle["text"]}
            for chain in sample.meta.get("chains", []):
                probes |= {link["text"].strip() for link in chain}
            probes |= {gold for gold in sample.golds if len(gold) >= 7}
    # rag's passage titles and agent-reports' regions, with their answers: the documents task's shape
    for sample in [
        *rag.generate("rag", 4096, 8, tokenizer),
        *agent_reports.generate("agent-reports", 4096, 8, tokenizer),
    ]:
        probes |= {line.split("\n")[0].split(" on ")[-1].removeprefix("Passage: ") for line in sample.chunks[1:]}
        probes |= set(sample.golds)
    # updates: its records' keys and settings (the training stream's `updates` task draws its own)
    for sample in [s for task in updates.TASKS for s in updates.generate(task, 1024, 8, tokenizer)]:
        probes |= {part for setting in sample.meta["settings"] for part in (setting["key"], setting["text"])}
    assert len(probes) > 150
    everything = data.task_table(tuple(f"{name}:1" for name in data.TASKS))
    stream = "\n".join(
        tokenizer.decode(data.example(0, "train", step, index, 2048, table).tokens) for step in range(0, 4000, 40)
        for index in range(4) for table in (None, everything)
    )  # fmt: skip
    leaked = sorted(p for p in probes if p in stream)
    assert not leaked, f"arena needles in the training stream: {leaked[:5]}"


def test_task_weights_are_read_and_bad_ones_refused_in_one_line():
    assert data.task_table(()) is None
    table = data.task_table(("documents:0.5", "niah"))
    assert {name: share for name, (share, _) in table.items()} == {"documents": 0.5, "niah": data.TASKS["niah"][0]}
    drawn = {data.example(0, "train", 3, index, 1024, table).task.split("_")[0] for index in range(30)}
    assert drawn == {"documents", "niah"}
    for specs, message in ((("documents",), "positive weight"), (("nope:1",), "unknown training task"),
                           (("niah:x",), "not a number")):  # fmt: skip
        with pytest.raises(HybridKVError, match=message):
            data.task_table(specs)


def test_bad_schedule_is_refused_in_one_line():
    assert parse_schedule("512:3,1024:2") == ((512, 3), (1024, 2))
    for text in ("", "512", "512:0", "a:b", "16:4"):
        with pytest.raises(HybridKVError, match="--schedule"):
            parse_schedule(text)


def _tiny_run(run_dir, stop_at=None):
    return TrainConfig(model="tiny-glm5-next", run_dir=run_dir, schedule=((512, 4),), tokens_per_step=1024,
                       eval_every=1000, save_every=1, eval_lengths=(512,), eval_samples=1, warmup=2,
                       stop_at=stop_at)  # fmt: skip


def test_a_resumed_run_equals_the_uninterrupted_one_and_exports_a_loadable_model(tmp_path):
    straight = tmp_path / "straight"
    train(_tiny_run(straight))
    split = tmp_path / "split"
    train(_tiny_run(split, stop_at=2))  # a stretch that ends at step 2, as a killed run's last save
    assert json.loads((split / "checkpoint" / "state.json").read_text())["step"] == 2
    train(_tiny_run(split))
    a = load_model_from_run(straight)
    b = load_model_from_run(split)
    for (name, x), (_, y) in zip(a.items(), b.items(), strict=True):
        assert torch.equal(x, y), name
    lines = [json.loads(line) for line in (straight / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "lm" in r] == [0, 1, 2, 3]
    assert (straight / "loss.png").stat().st_size > 0

    target = export(straight, "tiny-test", root=tmp_path / "weights")
    assert isinstance(load_tokenizer(str(target)), HFTokenizer)  # the tokenizer.json it ships
    model = load_model(str(target))
    assert model.config.model_type == "glm5_next_text"
    # its config names the class (transformers has no causal-LM class for GLM-5.3-Flash's decoder)
    assert json.loads((target / "config.json").read_text())["architectures"] == ["Glm5NextTextModel"]
    card = json.loads((target / "training.json").read_text())
    assert card["steps"] == 4 and card["tokens"] == 4 * 1024
    tokens = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(4))
    logits = model.forward(tokens, model.new_cache(), start=0, logits_to_keep=1)
    assert torch.isfinite(logits).all()


def test_a_fresh_run_can_start_from_shipped_weights(tmp_path):
    """--init loads a model directory's weights in place of the library's initialisation: at a zero
    learning rate the run ends with exactly those weights, not its own seed's; exported over that
    same directory, its card still holds the history of the weights it started from."""
    from hybridkv.models.loader import write_with_head
    from hybridkv.train.shapes import build

    torch.manual_seed(123)
    config, backbone, lm_head = build("tiny-glm5-next")
    init = tmp_path / "tiny-test"
    write_with_head(init, config, backbone, lm_head)
    history = {"steps": 7, "train_config": {"model": "tiny-glm5-next", "run_dir": "earlier"}}
    (init / "training.json").write_text(json.dumps(history))
    run = dataclasses.replace(_tiny_run(tmp_path / "run"), lr=0.0, min_lr=0.0, init=init)
    train(run)
    start = load_weights_file(init / "model.safetensors")
    for (name, x), (_, y) in zip(start.items(), load_model_from_run(tmp_path / "run").items(), strict=True):
        assert torch.equal(x, y), name
    card = json.loads((export(tmp_path / "run", "tiny-test", root=tmp_path) / "training.json").read_text())
    assert card["steps"] == 4 and card["init_training"] == history
    with pytest.raises(HybridKVError, match="model.safetensors"):
        train(dataclasses.replace(run, run_dir=tmp_path / "other", init=tmp_path / "missing"))


def test_a_shape_override_trains_exports_and_loads_as_that_shape(tmp_path):
    """--shape replaces config fields of the trained shape; the exported model loads with them (a
    wider MLA placed between the KDA layers here), and a field the config lacks is refused before
    the run directory is written."""
    shape = {"kv_lora_rank": 96, "layer_types": ["linear_attention", "indexed_attention"] * 2}
    run = dataclasses.replace(_tiny_run(tmp_path / "run"), schedule=((512, 1),), shape=shape)
    train(run)
    model = load_model(str(export(tmp_path / "run", "tiny-test", root=tmp_path / "weights")))
    assert model.config.kv_lora_rank == 96 and model.config.layer_types == shape["layer_types"]
    assert model.description.linear_layers == [0, 2] and model.description.attention_layers == [1, 3]
    # The run's own checkpoint loads as it is, with the byte tokenizer it was trained on (no export).
    checkpoint = tmp_path / "run" / "checkpoint"
    assert isinstance(load_tokenizer(str(checkpoint)), ByteTokenizer)
    assert load_model(str(checkpoint)).config.layer_types == shape["layer_types"]
    with pytest.raises(HybridKVError, match="no config field kv_lora_rnk"):
        train(dataclasses.replace(run, run_dir=tmp_path / "bad", shape={"kv_lora_rnk": 96}))
    assert not (tmp_path / "bad").exists()
    # Resumed without its --shape, the run is refused and its record is left as it was.
    recorded = (tmp_path / "run" / "train_config.json").read_text()
    with pytest.raises(HybridKVError, match="resume it with the same"):
        train(dataclasses.replace(run, shape={}, schedule=((512, 2),)))
    assert (tmp_path / "run" / "train_config.json").read_text() == recorded


def load_weights_file(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(sorted(load_file(path).items()))


def load_model_from_run(run_dir) -> dict[str, torch.Tensor]:
    return load_weights_file(run_dir / "checkpoint" / "model.safetensors")


def test_only_glm5_attention_layers_get_an_indexer_loss():
    from hybridkv.train.indexer import IndexerRecorder
    from hybridkv.train.shapes import TRAINABLE, build

    for name in TRAINABLE:
        _, backbone, _ = build(name)
        recorder = IndexerRecorder(backbone)
        expected = sum(
            getattr(getattr(layer, "self_attn", None), "indexer", None) is not None for layer in backbone.layers
        )
        assert len(recorder.handles) == expected and (expected > 0) == (name == "tiny-glm5-next")
        recorder.close()


def test_two_documents_ask_as_agent_reports_asks_and_answer_from_two_documents():
    """The training task for two-source questions uses the arena's own question template, and its
    answer restates the second title before that title's fact, both facts stated in the documents."""
    tokenizer = ByteTokenizer()
    pattern = re.compile(
        r"Question: What is the surveyed population of (.+), and the surveyed population of (.+)\?\n"
        r"Answer: The surveyed population of (.+) is (\d+), and the surveyed population of (.+) is (\d+)\.\n$"
    )
    seen = 0
    for index in range(400):
        example = data.example(0, "train", 0, index, 2048, data.task_table(("two-documents:1",)))
        text = tokenizer.decode(example.tokens)
        found = pattern.search(text)
        if not found:
            continue
        first, second, again, v1, restated, v2 = found.groups()
        assert (again, restated) == (first, second) and first != second
        question = agent_reports._QUESTION.format(first=first, second=second)
        assert text[: found.start(4) - 1].endswith(question)
        for title, value in ((first, v1), (second, v2)):
            assert f"the surveyed population of {title} is {value}.".lower() in text[: found.start()].lower()
        start, end = example.answers[0]
        assert tokenizer.decode(example.tokens[start:end]).startswith(f" {v1}, and the surveyed population")
        seen += 1
    assert seen >= 3


def test_updates_ask_for_the_last_setting_of_a_record_set_more_than_once():
    tokenizer = ByteTokenizer()
    question = re.compile(
        r"\nWhat is the current special magic (\w+) for (\S+)\? The current special magic \w+ for \S+ is$"
    )
    for index in range(30):
        example = data.example(0, "train", 1, index, 1024, data.task_table(("updates:1",)))
        start, end = example.answers[0]
        prompt = tokenizer.decode(example.tokens[:start])
        noun, key = question.search(prompt).groups()
        settings = re.findall(rf"The special magic {noun} for {re.escape(key)} is set to (\S+)\.", prompt)
        assert len(settings) >= 2 and len(set(settings)) == len(settings)
        assert tokenizer.decode(example.tokens[start:end]) == f" {settings[-1]}.\n"
