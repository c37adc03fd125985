"""The text draft head (:mod:`recspec.models.text_head`) on the real SmolLM2 and MovieLens: its
folder and refusals, head distillation (features cached and checked, exact resume, the validation
acceptance against a brute-force computation through the decoding path), and greedy speculative
knowledge generation with a head: the greedy tokens, untrained or briefly trained, full or
reduced vocabulary, the head's cache always that of the accepted text."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.lab.curve import run as write_curves
from recspec.align.distill import CHECKPOINT, corpus_split, sample_corpus, validation_cut
from recspec.align.head import HeadStore
from recspec.align.text_head import (ACCEPTANCE, ACCEPTANCE_2, FEATURES, HeadDistillConfig, TextHeadTask,
                                     corpus_features, distill_head, draft_vocabulary)
from recspec.decoding.scorer import score_tree_features
from recspec.decoding.tree import ancestor_matrix
from recspec.errors import RecspecError
from recspec.fileio import record_checksums, write_json_atomic
from recspec.decoding.text_rounds import Draft, DraftTree, Sessions, generate_texts, speculative_generate
from recspec.knowledge.decode import HybridDrafter, RetrievalDrafter, eos_ids
from recspec.decoding.cost import CallCost
from recspec.decoding.head_trees import HeadDrafter, HeadTreeConfig, HeadTrees, node_budget, select
from recspec.decoding.prompts import left_pad
from recspec.knowledge.prompts import item_prompt_ids, user_prompt_ids
from recspec.knowledge.retrieval import RetrievalConfig
from recspec.knowledge.stream import stream_split
from recspec.models.head import load_head, save_head
from recspec.accel.fused import FusedProjections
from recspec.accel.int8 import Int8Forward, int8_serves
from recspec.models.text_head import (TEXT_HEAD, TextHeadDraft, layer_features, load_text_head, new_text_head,
                                      text_head_fingerprint)
from recspec.statefile import load_state
from recspec.hub import returned_cache
from tests.test_cli import recspec
from tests.test_speculative import small_llama

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 16
CONFIG = HeadDistillConfig(prompts=16, max_new_tokens=6, epochs=1, batch_size=7, lr=1e-3, warmup_steps=1,
                           vocab=256, noise=0.05, ahead_weight=0.5)


@pytest.fixture(scope="module")
def lm(smollm2_dir):
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    model, tokenizer = load_causal_lm(smollm2_dir), load_tokenizer(smollm2_dir)
    return model, tokenizer, eos_ids(model, tokenizer)


@pytest.fixture(scope="module")
def runs(smollm2_dir, ml100k, tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """A head distilled in two calls (stopped by the time budget after one step, then resumed) and
    the same run uninterrupted (its corpus and features copied, not recomputed)."""
    resumed, whole = tmp_path_factory.mktemp("resumed"), tmp_path_factory.mktemp("whole")
    first = distill_head(str(smollm2_dir), resumed, CONFIG, max_minutes=1e-6, progress=False)
    assert first["stopped"] == "time budget"
    result = distill_head(str(smollm2_dir), resumed, CONFIG, progress=False)
    for name in ("corpus.jsonl", f"{FEATURES}.safetensors", f"{FEATURES}.json"):
        shutil.copy(resumed / name, whole / name)
    distill_head(str(smollm2_dir), whole, CONFIG, progress=False)
    return resumed, whole, result["history"]


def greedy_prompts(tokenizer, ml100k) -> list[list[int]]:
    """Three new-part item prompts and one user prompt, as the knowledge job builds them."""
    split = stream_split(ml100k)
    items = [item_prompt_ids(tokenizer, ml100k, int(i), 1024) for i in split.new_items[:3]]
    return items + [user_prompt_ids(tokenizer, ml100k, 0, split.new[0], 10, 1024)]


@pytest.fixture(scope="module")
def greedy(lm, ml100k) -> tuple[list[list[int]], list[list[int]]]:
    model, tokenizer, eos = lm
    prompts = greedy_prompts(tokenizer, ml100k)
    return prompts, [speculative_generate(model, p, MAX_NEW, eos).tokens for p in prompts]


class KeptTrees(HeadTrees):
    """A batch of one's head trees that keep the head's cache as the request leaves the batch:
    ``final``, its keys and values ``[1, kv, T, d]`` and the inputs read."""

    final: tuple[torch.Tensor, torch.Tensor, int]

    def select(self, rows: torch.Tensor) -> None:
        if len(rows) == 0:
            keys, values = self.cache.past
            assert self.cache.text is not None and bool(self.cache.text.visible.all())
            self.final = keys, values, int(self.cache.text.count[0])
        super().select(rows)


class RecordedTrees(KeptTrees):
    """A batch's head trees that keep every tree they drafted (in ``drawn``)."""

    drawn: list[DraftTree]

    def trees(self, budgets, chosen_rows=None):
        tokens, parents, sizes, depths = super().trees(budgets, chosen_rows)
        self.drawn += [DraftTree(row[:size], up[:size])
                       for row, up, size in zip(tokens.tolist(), parents.tolist(), sizes.tolist())]
        return tokens, parents, sizes, depths


class Recorded(HeadDrafter):
    """A head drafter that keeps its batches and the trees they drafted."""

    batches: list[HeadTrees]
    trees: list[DraftTree]

    def batch(self, prompts):
        trees = RecordedTrees(self.head, self.config, self.cost)
        self.batches, self.trees = [*getattr(self, "batches", []), trees], getattr(self, "trees", [])
        trees.drawn = self.trees
        return trees


class OracleTrees(KeptTrees):
    """Head trees replaced by ``oracle``'s after the head has read the text (see
    :class:`OracleDrafter`)."""

    oracle: OracleDrafter

    def propose(self, texts, budgets, score) -> Draft:
        self.catch_up(texts)
        text, oracle = texts[0], self.oracle
        done = len(text) - len(oracle.prompt)
        right = oracle.reference[done:done + min(3, budgets[0])]
        pairs = [((token + 1) % 49152, token) if oracle.right_second else (token, (token + 1) % 49152)
                 for token in right]
        parents = [-1, -1][:2 * len(right)] + [2 * (i - 1) + oracle.right_second
                                                for i in range(1, len(right)) for _ in range(2)]
        sessions = Sessions([])
        sessions.device = self.head.ids.device
        return sessions.draft(texts, [DraftTree([token for pair in pairs for token in pair], parents)])


class OracleDrafter(HeadDrafter):
    """A head drafter whose trees hold ``reference`` (the text after ``prompt``): up to 3 levels,
    each the right token and a wrong sibling (the right one second with ``right_second``), the
    next level under the right one; the head still reads the target's features every round."""

    def __init__(self, head: TextHeadDraft, prompt: list[int], reference: list[int], right_second: bool = False):
        super().__init__(head)
        self.prompt, self.reference, self.right_second = prompt, reference, right_second
        self.last: HeadTrees | None = None

    def batch(self, prompts):
        trees = OracleTrees(self.head, self.config, self.cost)
        trees.oracle = self
        self.last = trees
        return trees


def cached(trees: HeadTrees) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A finished batch of one's head cache (:class:`KeptTrees`)."""
    assert isinstance(trees, KeptTrees)
    return trees.final


def teacher_cache(model, head: TextHeadDraft, text: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's keys and values over ``text`` fed in one call with the target's own features."""
    return teacher_inputs(model, head, text)[1:]


def teacher_inputs(model, head: TextHeadDraft, text: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's guesses ``[1, n, H]``, keys and values ``[1, kv, n, d]`` over ``text`` (its ``n =
    len(text) - 1`` inputs) fed in one call with the target's own features."""
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([text]), output_hidden_states=True).hidden_states
        features = head.read(layer_features(model, states, head.fused_layers))
        count = len(text) - 1
        return head.step(features[:, :-1], torch.tensor([text[1:]]), torch.arange(count)[None],
                         torch.ones(count, count, dtype=torch.bool).tril()[None])


def test_hidden_states_are_what_the_output_layer_reads(lm) -> None:
    """transformers 5's ``hidden_states[-1]`` of a Llama is after the final norm: the output layer
    maps the features a tree call returns onto its logits."""
    model, _, _ = lm
    with torch.inference_mode():
        cache = returned_cache(model(input_ids=torch.arange(100, 140)[None], use_cache=True))
        parents = torch.tensor([[-1, 0, 0, 1]])
        logits, features = score_tree_features(model, cache, torch.tensor([[5, 6, 7, 8]]), ancestor_matrix(parents),
                                               torch.ones(1, 40, dtype=torch.bool), torch.tensor([40]))
        torch.testing.assert_close(features @ model.lm_head.weight.T, logits, rtol=1e-5, atol=1e-4)


def test_folder_round_trip_and_refusals(lm, smollm2_dir, tmp_path: Path) -> None:
    model, _, _ = lm
    head = new_text_head(model, torch.tensor([7, 3, 3, 2]), seed=1)
    assert head.vocab_ids.tolist() == [2, 3, 7]
    fingerprint = text_head_fingerprint(smollm2_dir)
    save_head(tmp_path / "run" / "best", head, fingerprint, {"note": "test"}, TEXT_HEAD)
    assert sorted(p.name for p in (tmp_path / "run" / "best").iterdir()) == ["checksums.json", "head.safetensors",
                                                                           "text_head.json"]
    loaded = load_text_head(tmp_path / "run", smollm2_dir)  # a training folder: its best/
    assert head.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    folder = tmp_path / "run" / "best"
    with pytest.raises(RecspecError, match="trained for another target"):
        load_head(folder, {"target_weights_sha256": "0" * 64}, kind=TEXT_HEAD)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = other / "text_head.json"
    write_json_atomic(config, {"format": "recspec-head/1", "config": {}})
    record_checksums(other)
    with pytest.raises(RecspecError, match="not a recspec-text-head/1 head"):
        load_text_head(other, smollm2_dir)
    weights = folder / "head.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RecspecError, match="head.safetensors: damaged"):
        load_text_head(folder, smollm2_dir)


def test_draft_vocabulary_takes_the_most_frequent_response_tokens() -> None:
    pairs = [([1, 2, 3], [5, 5, 6, 9]), ([4], [6, 5, 8, 8])]  # 5: 3, 6: 2, 8: 2, 9: 1; prompts never count
    assert draft_vocabulary(pairs, 2, [0]).tolist() == [0, 5, 6]  # 6 and 8 tie: the smaller id
    assert draft_vocabulary(pairs, 99, [9]).tolist() == [5, 6, 8, 9]
    with pytest.raises(RecspecError, match="vocab=-1, noise=nan"):
        HeadDistillConfig(vocab=-1, noise=float("nan"))


def test_resume_is_exact_and_the_log_complete(runs) -> None:
    resumed, whole, history = runs
    assert [row["epoch"] for row in history] == [0, 1, 1] and history[1]["partial"]
    assert all(0 < row[ACCEPTANCE] <= 1 and 0 < row[ACCEPTANCE_2] <= 1 for row in history)
    left, right = (load_state(folder, CHECKPOINT, "")["weights"] for folder in (resumed, whole))
    assert left.keys() == right.keys()
    assert all(torch.equal(left[k], right[k]) for k in left), "resumed weights differ from the uninterrupted run's"
    with pytest.raises(RecspecError, match="other settings"):
        distill_head("smollm2", resumed, HeadDistillConfig(prompts=16, max_new_tokens=6), progress=False)


def trained_task(runs, lm, smollm2_dir, config: HeadDistillConfig) -> tuple[TextHeadTask, list]:
    """The head of the resumed run bound to SmolLM2, as a :class:`TextHeadTask` over its corpus with
    ``config``, and the corpus's validation pairs."""
    resumed, _, _ = runs
    model, tokenizer, _ = lm
    train, valid = corpus_split(model, tokenizer, resumed, CONFIG, False)
    pairs = train + valid
    fingerprint = text_head_fingerprint(smollm2_dir)
    corpus = corpus_features(model, pairs, resumed, CONFIG.batch_size, tokenizer.pad_token_id, fingerprint, False)
    bound = TextHeadDraft(load_text_head(resumed, smollm2_dir), model)
    valid_rows = torch.arange(len(train), len(pairs)).numpy()
    task = TextHeadTask(bound, pairs, corpus, torch.arange(len(train)).numpy(), valid_rows, config,
                        tokenizer.pad_token_id, HeadStore(resumed, fingerprint, {}, TEXT_HEAD))
    return task, valid


def test_tv_term_is_the_acceptance_shortfall(runs, lm, smollm2_dir) -> None:
    """``tv_weight`` adds ``tv_weight * (p(D) - sum min(p, q))`` to the loss: over the validation
    rows, the loss with the term minus the loss without it is the logged ``valid_vocab_mass``
    minus ``valid_acceptance``, and the term's gradient reaches the head."""
    plain, with_tv = (replace(CONFIG, noise=0.0, ahead_weight=0.0, tv_weight=w) for w in (0.0, 3.0))
    task = trained_task(runs, lm, smollm2_dir, plain)[0]
    tv_task = TextHeadTask(task.bound, task.pairs, task.corpus, task.train, task.valid, with_tv, task.pad_token_id,
                           task.head_store)
    bound = task.bound
    assert len(task.valid) <= CONFIG.batch_size  # one validation batch: its means are the logged ones
    scores = task.validation_scores(bound.head)
    batch = task.pair_rows(task.valid)
    losses = [each.loss(bound.head, batch, None) for each in (task, tv_task)]
    shortfall = scores["valid_vocab_mass"] - scores[ACCEPTANCE]
    assert 0 < shortfall < 1
    assert float((losses[1] - losses[0]).detach()) == pytest.approx(3.0 * shortfall, rel=1e-4, abs=1e-5)
    weight = bound.head.mlp.down.weight
    grads = [torch.autograd.grad(loss, weight)[0] for loss in losses]
    assert not torch.allclose(grads[0], grads[1])


def test_runs_recorded_before_an_option_existed_resume(runs, smollm2_dir, tmp_path: Path) -> None:
    """A run whose settings predate ``tv_weight`` and ``samples`` resumes with the values it trained
    with (0, one sample a prompt) and refuses any other."""
    import json

    _, whole, _ = runs
    shutil.copytree(whole, tmp_path / "run", dirs_exist_ok=True)
    settings = json.loads((tmp_path / "run" / "distill.json").read_text())
    del settings["tv_weight"], settings["samples"]
    write_json_atomic(tmp_path / "run" / "distill.json", settings)
    assert distill_head(str(smollm2_dir), tmp_path / "run", CONFIG, progress=False)["stopped"] == "epochs"
    with pytest.raises(RecspecError, match="other settings"):
        distill_head(str(smollm2_dir), tmp_path / "run", replace(CONFIG, tv_weight=1.0), progress=False)


def test_validation_cut_keeps_a_prompts_samples_on_one_side() -> None:
    """The validation share starts at a prompt's first sample; a corpus of one prompt is still cut."""
    pairs = [([prompt], [prompt, sample]) for prompt in range(10) for sample in range(3)]
    cut = validation_cut(pairs, 0.125)  # 30 pairs: the last 4 would start inside prompt 8
    assert cut == 27 and pairs[cut - 1][0] != pairs[cut][0]
    assert validation_cut([([p], [p]) for p in range(8)], 0.125) == 7
    assert validation_cut([([0], [1]), ([0], [2]), ([0], [3])], 0.3) == 2


def test_samples_per_prompt_follow_each_other_and_differ(lm, ml100k, tmp_path: Path) -> None:
    """``samples = 2``: every prompt twice in a row, sampled apart, and read back on the next call
    (a small random model over SmolLM2's tokenizer and chat prompts)."""
    _, tokenizer, _ = lm
    model = small_llama(len(tokenizer), seed=3, width=16)
    pairs = sample_corpus(model, tokenizer, tmp_path / "corpus.jsonl", 16, 3, seed=0, progress=False, samples=2)
    prompts = [prompt for prompt, _ in pairs]
    assert len(pairs) == 32 and prompts[0::2] == prompts[1::2] and len({tuple(p) for p in prompts}) == 16
    assert sum(first[1] != second[1] for first, second in zip(pairs[0::2], pairs[1::2])) >= 12
    assert sample_corpus(model, tokenizer, tmp_path / "corpus.jsonl", 16, 3, seed=0, progress=False,
                         samples=2) == pairs


def test_bench_curve_reads_the_real_logs(runs, tmp_path: Path) -> None:
    """`python -m benchmarks.lab curve` over the two runs' real logs: CPU-minutes are the training and
    evaluation seconds so far times the threads (a partial epoch's training not counted twice), the partial epoch is labelled, the best
    value respects the budget, and bad input is refused before anything is written."""
    import json

    resumed, whole, history = runs
    markdown = write_curves(tmp_path, [resumed, whole], ["resumed", "whole"], [2, 1], ACCEPTANCE,
                            [ACCEPTANCE_2, "train_loss"], budget=1e9, target=0.6, name="c")
    saved = json.loads((tmp_path / "c.json").read_text())
    curve = saved["runs"][0]["curve"]
    # epoch 1's full row counts its whole training, the partial evaluation's seconds included
    training = [row.get("train_seconds", 0.0) for row in history]
    assert training[2] > training[1] > 0
    evaluating = [sum(row["eval_seconds"] for row in history[:i + 1]) for i in range(3)]
    assert [p["cpu_minutes"] for p in curve] == pytest.approx([2 * (t + e) / 60 for t, e in zip(training, evaluating)])
    assert [p["label"] for p in curve] == ["0", f"1 ({history[1]['batches']}/{history[1]['of_batches']})", "1"]
    assert saved["runs"][0]["best"][ACCEPTANCE] == max(row[ACCEPTANCE] for row in history)
    assert "| resumed |" in markdown and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    first = curve[0]["cpu_minutes"]
    named = write_curves(tmp_path, [resumed], ["r"], [2], ACCEPTANCE, [], budget=first, target=None, name="d",
                         unit="H100-minutes")
    assert json.loads((tmp_path / "d.json").read_text())["runs"][0]["best"]["label"] == "0"
    assert "against H100-minutes" in named and "CPU-minutes" not in named
    with pytest.raises(RecspecError, match="logs no 'recall'"):
        write_curves(tmp_path, [resumed], ["r"], [2], "recall", [], budget=60, target=None, name="e")
    with pytest.raises(RecspecError, match="missing"):
        write_curves(tmp_path, [tmp_path], ["r"], [2], ACCEPTANCE, [], budget=60, target=None, name="e")
    with pytest.raises(RecspecError, match="one --label"):
        write_curves(tmp_path, [resumed, whole], ["r"], [2], ACCEPTANCE, [], budget=60, target=None, name="e")
    assert not (tmp_path / "e.json").exists()


def test_fused_input_starts_as_the_plain_head_and_reads_its_layers(runs, lm, smollm2_dir, tmp_path: Path) -> None:
    """A head with fused layers (EAGLE-3's input): the features pass keeps those layers' outputs
    normalised by the final norm, as a forward of each text alone gives them; a cache made without
    them is refused for it; untrained, the fused head's loss is the plain head's of the same seed
    (W_fuse starts as [0, 0, I]), and its gradient reaches the layers' blocks of W_fuse; its folder
    keeps the layers and binds to the target."""
    resumed, _, _ = runs
    model, tokenizer, _ = lm
    layers, hidden = (4, 14), model.config.hidden_size
    shutil.copy(resumed / "corpus.jsonl", tmp_path / "corpus.jsonl")
    train, valid = corpus_split(model, tokenizer, tmp_path, CONFIG, False)
    pairs = train + valid
    fingerprint = text_head_fingerprint(smollm2_dir)
    corpus = corpus_features(model, pairs, tmp_path, 7, tokenizer.pad_token_id, fingerprint, False, layers)
    assert corpus.layers.shape == (len(corpus.features), 2 * hidden)
    for i in (0, len(pairs) - 1):
        text = torch.tensor([pairs[i][0] + pairs[i][1]])
        with torch.inference_mode():
            states = model(input_ids=text, output_hidden_states=True).hidden_states
        alone = layer_features(model, states, layers)[0]
        rows = slice(int(corpus.starts[i]), int(corpus.starts[i + 1]))
        torch.testing.assert_close(corpus.layers[rows], alone[:, :2 * hidden], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(corpus.features[rows], alone[:, 2 * hidden:], rtol=1e-4, atol=1e-4)
    with pytest.raises(RecspecError, match=r"features made for fused layers \[\] \(this run reads \[4, 14\]\)"):
        corpus_features(None, pairs, resumed, 7, tokenizer.pad_token_id, fingerprint, False, layers)

    ids = torch.arange(300)
    plain, fused = new_text_head(model, ids, 5), new_text_head(model, ids, 5, layers)
    config = replace(CONFIG, noise=0.0)
    tasks = [TextHeadTask(TextHeadDraft(head, model), pairs, data, torch.arange(len(train)).numpy(),
                          torch.arange(len(train), len(pairs)).numpy(), config, tokenizer.pad_token_id,
                          HeadStore(tmp_path, fingerprint, {}, TEXT_HEAD))
             for head, data in ((plain, replace(corpus, layers=torch.empty(0))), (fused, corpus))]
    losses = [task.loss(task.bound.head, task.batch(torch.arange(4).numpy()), None) for task in tasks]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    gradient = torch.autograd.grad(losses[1], fused.fuse.weight)[0]
    assert gradient[:, :2 * hidden].abs().sum() > 0  # training can move the fused layers' blocks

    save_head(tmp_path / "head", fused, fingerprint, {}, TEXT_HEAD)
    loaded = load_text_head(tmp_path / "head", smollm2_dir)
    assert loaded.config.fused_layers == layers and loaded.config == fused.config
    wide = torch.randn(3, 3 * hidden)
    torch.testing.assert_close(TextHeadDraft(loaded, model).head.read(wide), wide[:, 2 * hidden:])
    with pytest.raises(RecspecError, match=r"fused layers must lie in \[1, 29\]"):
        new_text_head(model, ids, 5, (4, 30))


def test_distill_device_and_samples_are_checked_before_any_work(tmp_path: Path) -> None:
    """``--device`` belongs to ``--head``, CUDA is refused where there is none, ``--samples`` must be
    positive: each one line, nothing written."""
    out = tmp_path / "run"
    for args, message in ((["--device", "cuda"], "--device: options of --head"),
                          (["--head", "--samples", "0"], "samples=0"),
                          *([(["--head", "--device", "cuda"], "CUDA is not available")]
                            if not torch.cuda.is_available() else [])):
        result = recspec("distill", "--out", str(out), *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert not out.exists()


def test_bad_fused_layers_are_refused_and_leave_the_run_folder_usable(smollm2_dir, tmp_path: Path) -> None:
    """A layer the target lacks is refused before anything is sampled or recorded (so the corrected
    command can use the same --out); a malformed --fused-layers is one error line."""
    with pytest.raises(RecspecError, match=r"fused layers must lie in \[1, 29\]"):
        distill_head(str(smollm2_dir), tmp_path / "run", replace(CONFIG, fused_layers=(4, 30)), progress=False)
    assert not (tmp_path / "run" / "distill.json").exists() and not (tmp_path / "run" / "corpus.jsonl").exists()
    result = recspec("distill", "--head", "--target", str(smollm2_dir), "--out", str(tmp_path / "cli"),
                     "--fused-layers", "4,x")
    assert result.returncode == 2 and "error: --fused-layers '4,x': give layer numbers" in result.stderr


def test_features_cache_is_checked(runs, lm, tmp_path: Path) -> None:
    resumed, _, _ = runs
    model, tokenizer, _ = lm
    pairs = [pair for part in corpus_split(model, tokenizer, resumed, CONFIG, False) for pair in part]
    fingerprint = load_state(resumed, FEATURES, "")["made_from"]["target"]
    for name in (f"{FEATURES}.safetensors", f"{FEATURES}.json"):
        shutil.copy(resumed / name, tmp_path / name)
    with pytest.raises(RecspecError, match="another corpus or target"):
        corpus_features(None, pairs[1:], tmp_path, 7, 2, fingerprint, False)
    data = bytearray((tmp_path / f"{FEATURES}.safetensors").read_bytes())
    data[-7] ^= 0xFF
    (tmp_path / f"{FEATURES}.safetensors").write_bytes(bytes(data))
    with pytest.raises(RecspecError, match=r"features\.safetensors: damaged"):
        corpus_features(None, pairs, tmp_path, 7, 2, fingerprint, False)


def test_features_pass_resumes_from_its_parts(runs, lm, tmp_path: Path, monkeypatch) -> None:
    """An interrupted features pass keeps its finished parts; the next call computes only the rest,
    and the whole equals the uninterrupted pass's (the same batches), its parts then removed."""
    from recspec.align import text_head

    resumed, _, _ = runs
    model, tokenizer, _ = lm
    pairs = [pair for part in corpus_split(model, tokenizer, resumed, CONFIG, False) for pair in part]
    whole = load_state(resumed, FEATURES, "")
    monkeypatch.setattr(text_head, "PART_BATCHES", 1)
    compute, calls = text_head.compute_features, []

    def interrupted(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return compute(*args, **kwargs)

    monkeypatch.setattr(text_head, "compute_features", interrupted)
    args = (CONFIG.batch_size, tokenizer.pad_token_id, whole["made_from"]["target"], False)
    with pytest.raises(KeyboardInterrupt):
        corpus_features(model, pairs, tmp_path, *args)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{FEATURES}-part-00000.json",
                                                          f"{FEATURES}-part-00000.safetensors"]
    with pytest.raises(RecspecError, match="another corpus or target"):
        corpus_features(model, pairs[1:], tmp_path, *args)
    calls.clear()
    monkeypatch.setattr(text_head, "compute_features", lambda *a, **k: calls.append(a[1]) or compute(*a, **k))
    corpus = corpus_features(model, pairs, tmp_path, *args)
    size = CONFIG.batch_size
    assert calls == [pairs[start:start + size] for start in range(size, len(pairs), size)]  # part 0 read back
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{FEATURES}.json", f"{FEATURES}.safetensors"]
    for key, value in whole["corpus"].items():
        assert torch.equal(getattr(corpus, key), value), key


def test_validation_acceptance_is_the_decoding_paths(runs, lm, smollm2_dir) -> None:
    """``valid_acceptance`` (one step ahead) and ``valid_acceptance_2`` (two) of the batched
    training path equal ``sum min(p, q)`` computed the slow way: the target's full forward for p,
    the head fed one input at a time over its own cache as decoding feeds it for q."""
    model = lm[0]
    task, valid = trained_task(runs, lm, smollm2_dir, CONFIG)
    bound = task.bound
    scores = task.validation_scores(bound.head)
    one, two = [], []
    with torch.inference_mode():
        for prompt, response in valid:
            text = prompt + response
            out = model(input_ids=torch.tensor([text]), output_hidden_states=True)
            p = torch.softmax(out.logits[0].float(), dim=-1)[:, bound.ids]  # [L, D]
            features = out.hidden_states[-1][0]
            keys = values = torch.zeros(1, bound.head.config.kv_heads, 0, bound.head.config.head_dim)
            guesses = []
            for i in range(len(text) - 1):  # one input at a time, as a session reads
                visible = torch.ones(1, 1, i + 1, dtype=torch.bool)
                scored = len(prompt) - 2 <= i <= len(text) - 3  # its next token but one is a response token
                if scored:  # two steps ahead: (h_{i-1}, x_{i+1}) over the true inputs < i
                    second, _, _ = bound.step(guesses[-1][None, None], torch.tensor([[text[i + 1]]]),
                                              torch.tensor([[i]]), visible, (keys, values))
                    two.append(torch.minimum(p[i + 1], torch.softmax(bound.logits(second[0, 0]), -1)).sum())
                guess, k, v = bound.step(features[i][None, None], torch.tensor([[text[i + 1]]]), torch.tensor([[i]]),
                                         visible, (keys, values))
                keys, values = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
                guesses.append(guess[0, 0])
                if scored:
                    one.append(torch.minimum(p[i + 1], torch.softmax(bound.logits(guess[0, 0]), -1)).sum())
    assert scores[ACCEPTANCE] == pytest.approx(float(torch.stack(one).mean()), abs=1e-4)
    assert scores[ACCEPTANCE_2] == pytest.approx(float(torch.stack(two).mean()), abs=1e-4)


def fused_head(model, seed: int):
    """An untrained head reading SmolLM2's layers 4 and 14 beside its top feature, its W_fuse
    random (so that every block of what the target returns for it matters)."""
    head = new_text_head(model, None, seed=seed, fused_layers=(4, 14))
    with torch.no_grad():
        head.fuse.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    return head


@pytest.mark.parametrize("which", ["untrained", "trained", "fused", "trained-int8"])
def test_greedy_with_a_head_is_greedy_decoding(which, runs, lm, greedy, smollm2_dir) -> None:
    """Token for token the greedy text, with an untrained head over the whole vocabulary, with
    the briefly trained one over its reduced vocabulary (its logits in float32 or int8) and with a
    head reading fused layers; the drafts stay in the head's vocabulary and are trees within the
    budget; the head's cache ends as the teacher-forced one."""
    model, _, eos = lm
    prompts, references = greedy
    head = {"untrained": lambda: new_text_head(model, None, seed=3), "fused": lambda: fused_head(model, 3),
            "trained": lambda: load_text_head(runs[0], smollm2_dir),
            "trained-int8": lambda: load_text_head(runs[0], smollm2_dir)}[which]()
    bound = TextHeadDraft(head.eval(), model, int8=which.endswith("int8"))
    config = HeadTreeConfig(width=3, depth=4, nodes=10)
    # in int8 the float noise of another row count can move an activation across a rounding step
    tolerance = 1e-2 if bound.int8 else 1e-4
    drafter = Recorded(bound, config)
    for prompt, reference in zip(prompts, references):
        generation = speculative_generate(model, prompt, MAX_NEW, eos, drafter)
        assert generation.tokens == reference
        own_keys, own_values, length = cached(drafter.batches[-1])
        keys, values = teacher_cache(model, bound, prompt + generation.tokens[:-1])
        assert len(prompt) <= length <= keys.shape[2] and own_keys.shape[2] == length
        torch.testing.assert_close(own_keys, keys[:, :, :length], rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(own_values, values[:, :, :length], rtol=tolerance, atol=tolerance)
    allowed = set(bound.ids.tolist())
    assert sum(map(len, drafter.trees)) > 0
    for tree in drafter.trees:
        assert len(tree) <= config.nodes and set(tree.tokens) <= allowed
        assert all(parent < i for i, parent in enumerate(tree.parents)) and tree.longest_branch() <= config.depth
    if which.startswith("trained"):
        assert len(allowed) < 300


def test_a_whole_vocabulary_head_shares_the_targets_packed_output_layer(lm) -> None:
    """A head over the whole vocabulary computes its logits with the target's own packed output
    layer (one packed copy of its 28M weights, not two); a draft vocabulary gets its own pack."""
    model, _, _ = lm
    bound = TextHeadDraft(new_text_head(model, None, seed=4).eval(), model)
    assert bound.pack is model.lm_head.forward.pack
    guessed = torch.randn(4, model.config.hidden_size)
    with torch.inference_mode():
        target_logits = model.lm_head(guessed)
        packed = bound.pack.packed
        torch.testing.assert_close(bound.logits(guessed), target_logits, rtol=1e-5, atol=1e-4)
    assert packed is not None and bound.pack.packed is packed  # not packed again
    small = TextHeadDraft(new_text_head(model, torch.arange(100), seed=4).eval(), model)
    assert small.pack is not model.lm_head.forward.pack


@pytest.mark.skipif(not int8_serves("cpu"), reason="no int8 engine, or its 8-bit products are wrong on this CPU")
def test_an_int8_binding_computes_the_decoder_layer_in_int8_on_its_own_copy(runs, lm, greedy,
                                                                            smollm2_dir) -> None:
    """With ``int8`` the head's attention and MLP products are int8 (its input projections stay
    float32) on a copy of the head: the head module and a float32 binding of it are unchanged. The
    int8 head's next features stay close to the float32 ones (its attention and MLP outputs made
    large, so that they matter), and its one-step-ahead draft over a teacher-forced text agrees
    with the float32 draft's most likely token nearly everywhere."""
    model, _, _ = lm
    head = load_text_head(runs[0], smollm2_dir).eval()
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for linear in (head.o, head.mlp.down):
            linear.weight.normal_(0.0, 0.05, generator=generator)
    fp32 = TextHeadDraft(head, model)
    text = torch.tensor(greedy[0][0] + greedy[1][0])
    with torch.inference_mode():
        states = model(text[None], output_hidden_states=True).hidden_states
        features = fp32.read(layer_features(model, states, fp32.fused_layers))
    count = len(text) - 1
    inputs = (features[:, :-1], text[None, 1:], torch.arange(count)[None],
              torch.ones(count, count, dtype=torch.bool).tril()[None])
    with torch.inference_mode():
        before = fp32.step(*inputs)[0]
        int8 = TextHeadDraft(head, model, int8=True)
        after, guessed = fp32.step(*inputs)[0], int8.step(*inputs)[0]
        agree = (int8.logits(guessed).argmax(-1) == fp32.logits(before).argmax(-1)).float().mean()
    assert int8.int8 and int8.head is not head and fp32.head is head
    fused = int8.head.q, int8.head.k, int8.head.v, int8.head.mlp.gate, int8.head.mlp.up  # int8 groups of siblings
    assert all(isinstance(linear.forward.func, FusedProjections) and linear.forward.func.int8
               and isinstance(linear.forward.func.own[linear.forward.args[0]], Int8Forward) for linear in fused)
    assert all(isinstance(linear.forward, Int8Forward) for linear in (int8.head.o, int8.head.mlp.down))
    assert not isinstance(int8.head.fc.forward, Int8Forward)
    assert not any(isinstance(linear.forward, Int8Forward) for linear in head.decoder_linears())
    assert torch.equal(before, after)
    error = (guessed - before).norm(dim=-1) / before.norm(dim=-1)
    assert float(error.max()) < 0.1 and float(agree) > 0.9
    assert not TextHeadDraft(head, model, int8=False).int8


def test_accepted_drafts_keep_the_head_cache_in_step(lm, greedy) -> None:
    """Drafts that are mostly right (the greedy continuation with a wrong sibling at every level):
    several tokens accepted per call, the text still greedy, and the head's cache exactly the
    teacher-forced one over the accepted text (features of rejected drafts never enter it)."""
    model, _, eos = lm
    prompts, references = greedy
    prompt, reference = prompts[0], references[0]
    bound = TextHeadDraft(new_text_head(model, None, seed=4).eval(), model)
    drafter = OracleDrafter(bound, prompt=prompt, reference=reference)
    generation = speculative_generate(model, prompt, MAX_NEW, eos, drafter)
    assert generation.tokens == reference and generation.calls < MAX_NEW // 2
    assert drafter.last is not None
    own_keys, own_values, length = cached(drafter.last)
    keys, values = teacher_cache(model, bound, prompt + generation.tokens[:-1])
    torch.testing.assert_close(own_keys, keys[:, :, :length], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(own_values, values[:, :, :length], rtol=1e-4, atol=1e-4)


def test_select_keeps_the_most_probable_nodes_as_a_tree() -> None:
    # candidates: two roots, their children, a grandchild; scores never above the parent's
    scores = torch.tensor([-0.1, -0.5, -0.3, -0.1, -2.0, -0.2])
    parents = torch.tensor([-1, -1, 0, 0, 1, 3])
    tree = chosen(scores, torch.arange(10, 16), parents, 4)
    assert tree.tokens == [10, 13, 15, 12] and tree.parents == [-1, 0, 1, 0]
    # a batch: each row its own tree, a row with fewer candidates (-inf) filled after its own
    levels = torch.tensor([[1, 1, 2, 2, 2, 3], [1, 1, 2, 2, 2, 3]])
    tokens, ups, sizes, depths = select(torch.stack((scores, scores.masked_fill(torch.arange(6) > 1, -torch.inf))),
                                        torch.arange(10, 16).expand(2, -1), parents.expand(2, -1), levels, 4)
    assert tokens.tolist() == [[10, 13, 15, 12], [10, 11, 0, 0]] and ups.tolist() == [[-1, 0, 1, 0], [-1, -1, -1, -1]]
    assert sizes.tolist() == [4, 2] and depths.tolist() == [3, 1]


def chosen(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, nodes: int,
           cost: CallCost | None = None) -> DraftTree:
    """:func:`select` of one row's candidates (all on level 1: levels do not change the choice)."""
    picked, ups, sizes, _ = select(scores[None], tokens[None], parents[None], torch.ones_like(tokens)[None], nodes,
                                   cost)
    return DraftTree(picked[0, :int(sizes[0])].tolist(), ups[0, :int(sizes[0])].tolist())


def test_node_budget_maximises_expected_tokens_per_second() -> None:
    """The budget is the exhaustive argmax of (1 + sum of the first n path probabilities) / C(n)
    over random rankings and costs; cheap nodes keep the whole ranking, dear ones the first few;
    with a cost, select keeps a prefix of its unsized tree."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        count = int(torch.randint(1, 40, (1,), generator=generator))
        log_scores = torch.sort(torch.rand(count, generator=generator).log() * 3, descending=True).values
        cost = CallCost(float(torch.rand(1, generator=generator)) * 0.1, float(torch.rand(1, generator=generator)) * 0.01)
        rates = [(1 + float(log_scores[:n].exp().sum())) / cost.call_s(n + 1) for n in range(1, count + 1)]
        assert node_budget(log_scores, cost) == max(range(count), key=lambda i: (rates[i], -i)) + 1
    ranked = torch.log(torch.tensor([0.9, 0.8, 0.5, 0.3, 0.1, 0.05, 0.01]))
    assert node_budget(ranked, CallCost(0.07, 1e-6)) == 7  # a CPU-bound LLM call: every node pays
    assert node_budget(ranked, CallCost(0.001, 0.01)) == 1  # nodes dearer than the call itself
    scores = torch.tensor([-0.1, -0.5, -0.3, -0.1, -2.0, -0.2])
    parents = torch.tensor([-1, -1, 0, 0, 1, 3])
    whole = chosen(scores, torch.arange(10, 16), parents, 6)
    for cost in (CallCost(0.05, 0.001), CallCost(0.01, 0.004), CallCost(0.001, 0.01)):
        sized = chosen(scores, torch.arange(10, 16), parents, 6, cost)
        n = node_budget(torch.sort(scores, descending=True).values, cost)
        assert sized.tokens == whole.tokens[:n] and sized.parents == whole.parents[:n]


def test_padded_calls_verify_their_free_nodes() -> None:
    """Where the target computes 10..15 rows as 16, a budget of 9..14 nodes is filled up to 15 with
    the next-ranked candidates (a prefix of the ranking, so a tree); other budgets are kept."""
    generator = torch.Generator().manual_seed(1)
    grown = 0
    for _ in range(200):
        count = int(torch.randint(1, 30, (1,), generator=generator))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, count)])
        steps, scores = -torch.rand(count, generator=generator) * 2, torch.zeros(count)
        for i in range(count):  # each path's log-probability: the parent's plus a negative step
            scores[i] = steps[i] + (scores[parents[i]] if parents[i] >= 0 else 0)
        fixed = float(torch.rand(1, generator=generator)) * 0.1
        plain = CallCost(fixed, float(torch.rand(1, generator=generator)) * 0.005)
        padded = replace(plain, padded=True)
        whole = chosen(scores, torch.arange(count), parents, 15)
        budget = len(chosen(scores, torch.arange(count), parents, 15, plain).tokens)
        filled = chosen(scores, torch.arange(count), parents, 15, padded)
        expected = min(15, count) if 9 <= budget <= 14 else budget
        assert len(filled.tokens) == expected
        assert filled.tokens == whole.tokens[:expected] and filled.parents == whole.parents[:expected]
        grown += expected > budget
    assert grown >= 20


def test_round_seconds_times_the_heads_drafting(lm) -> None:
    """The head's part of a round is timed positive, and more for a deeper, wider tree."""
    model = lm[0]
    bound = TextHeadDraft(new_text_head(model, torch.arange(0, 2000), seed=5).eval(), model)
    small = HeadDrafter(bound, HeadTreeConfig(width=1, depth=1, nodes=1)).round_seconds(64, repeats=5)
    large = HeadDrafter(bound, HeadTreeConfig(width=8, depth=8, nodes=64)).round_seconds(64, repeats=5)
    assert 0 < small < large


def test_pruned_growth_is_full_growth(runs, lm, greedy, smollm2_dir) -> None:
    """After every position of the greedy texts, with and without a cost model, the tree grown with
    pruning is the tree grown level by level in full, and pruning saves head calls."""
    model, _, _ = lm
    prompts, references = greedy
    bound = TextHeadDraft(load_text_head(runs[0], smollm2_dir).eval(), model)
    calls = {True: 0, False: 0}
    step = bound.step

    def counted(*args, **kwargs):
        calls[counting] += 1
        return step(*args, **kwargs)

    bound.step = counted  # type: ignore[method-assign]
    config, trees = HeadTreeConfig(width=4, depth=5, nodes=16), 0
    for cost in (None, CallCost(0.09, 0.003), CallCost(0.01, 0.004)):
        for prompt, reference in zip(prompts, references):
            text = prompt + reference
            with torch.inference_mode():
                features = model(input_ids=torch.tensor([text]), output_hidden_states=True).hidden_states[-1][0]
                for cut in range(len(prompt), len(text), 2):
                    grown = HeadTrees(bound, replace(config, prune=False), cost)
                    grown.start(left_pad([torch.tensor(text[:cut])], 0, features.device), features[None, :cut])
                    counting = True
                    grown.catch_up([text[:cut + 1]])
                    full = grown.trees([config.depth])
                    counting = False
                    grown.config = config
                    pruned = grown.trees([config.depth])
                    assert all(torch.equal(a, b) for a, b in zip(pruned, full))
                    trees += 1
    assert trees >= 90
    assert calls[False] < calls[True] - trees  # the full growth's count includes each read


def test_gated_hybrid_reads_skipped_rounds_later(runs, lm, greedy, smollm2_dir) -> None:
    """A hybrid whose head drafts only where retrieval (here the prompt's own branches) proposes
    less than 2 tokens deep: the greedy text, rounds both with and without the head, and the
    head's cache, read in arrears after skipped rounds, still the teacher-forced one."""
    model, _, eos = lm
    prompts, references = greedy
    bound = TextHeadDraft(load_text_head(runs[0], smollm2_dir).eval(), model)
    head = Recorded(bound, HeadTreeConfig(width=3, depth=4, nodes=10, gate=2))
    hybrid = HybridDrafter(RetrievalDrafter(None, RetrievalConfig()), head)
    calls = proposals = 0
    for prompt, reference in zip(prompts, references):
        generation = speculative_generate(model, prompt, MAX_NEW, eos, hybrid)
        assert generation.tokens == reference
        own_keys, own_values, length = cached(head.batches[-1])
        keys, values = teacher_cache(model, bound, prompt + generation.tokens[:-1])
        torch.testing.assert_close(own_keys, keys[:, :, :length], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(own_values, values[:, :, :length], rtol=1e-4, atol=1e-4)
        calls += generation.calls - 1
    proposals = len(head.trees)
    assert 0 < proposals < calls


def test_a_batch_of_head_and_hybrid_trees_is_each_request_alone(runs, lm, greedy, smollm2_dir) -> None:
    """Four requests decoded together, the head drafting every row's tree in the same calls (cost-
    sized and pruned; beside retrieval, gated), write each request's greedy text with the calls,
    accepted and drafted nodes of that request decoded alone."""
    model, _, eos = lm
    prompts, references = greedy
    bound = TextHeadDraft(load_text_head(runs[0], smollm2_dir).eval(), model)
    head = HeadDrafter(bound, HeadTreeConfig(width=3, depth=4, nodes=10), CallCost(0.05, 0.002))
    for drafter in (head, HybridDrafter(RetrievalDrafter(None, RetrievalConfig()), head)):
        alone = [speculative_generate(model, prompt, MAX_NEW, eos, drafter) for prompt in prompts]
        together = generate_texts(model, prompts, MAX_NEW, eos, drafter.batch(prompts))
        assert [g.tokens for g in together] == [g.tokens for g in alone] == references
        assert [(g.calls, g.accepted, g.drafted) for g in together] == [(g.calls, g.accepted, g.drafted) for g in alone]
        assert sum(g.accepted for g in together) > 0
