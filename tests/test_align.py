"""Draft alignment: the losses against values computed by hand, the alignment data against plain
forwards of the target, the training task against plain forwards of the draft, and the commands
end to end on a small data set."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from recspec.align import losses
from recspec.align.data import DataConfig, generate_alignment_data as generate
from recspec.align.task import METHODS, AlignmentTask
from recspec.align.train import align_fit
from recspec.errors import RecspecError
from recspec.fit import fit
from recspec.accel.policy import streams_weights
from recspec.accel.small_rows import SmallRowForward
from recspec.models.train import TrainConfig, answer_loss
from recspec.recommend import Recommender
from tests.test_cli import lab, recspec
from tests.test_recommend_cli import small_data  # noqa: F401  (fixture)

LOG = math.log


def log_tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


# ------------------------------------------------------------------------------- losses


def test_rec_and_seq_kd_by_hand() -> None:
    assert float(losses.rec_loss(log_tensor([[0.5, 0.25]])[0])) == pytest.approx((LOG(2) + LOG(4)) / 2)
    assert float(losses.seq_kd(log_tensor([[0.5, 0.5], [0.25, 1.0]]))) == pytest.approx((2 * LOG(2) + LOG(4)) / 4)


def test_word_kd_and_tvd_kd_by_hand_with_the_invalid_mass_lumped() -> None:
    p, q = log_tensor([[0.6, 0.3, 1.0]]), log_tensor([[0.5, 0.4, 1.0]])
    real = torch.tensor([[True, True, False]])  # the third column is padding: ignored
    kl = 0.6 * LOG(0.6 / 0.5) + 0.3 * LOG(0.3 / 0.4) + 0.1 * LOG(0.1 / 0.1)
    assert float(losses.word_kd(p, q, real)[0]) == pytest.approx(kl, abs=1e-9)
    assert float(losses.tvd_kd(p, q, real)[0]) == pytest.approx(0.5 * (0.1 + 0.1 + 0.0), abs=1e-9)
    q_rest = log_tensor([[0.6, 0.3, 1.0]]) - LOG(2)  # same valid shape, half the mass: the rest counts
    kl_rest = 0.6 * LOG(2) + 0.3 * LOG(2) + 0.1 * LOG(0.1 / 0.55)
    assert float(losses.word_kd(p, q_rest, real)[0]) == pytest.approx(kl_rest, abs=1e-9)


def test_atspeed_s_by_hand() -> None:
    p, q = log_tensor([[0.5, 0.3, 0.1]]), log_tensor([[0.2, 0.6, 0.1]])
    real = torch.ones(1, 3, dtype=torch.bool)
    p_kth = torch.tensor([LOG(0.25)], dtype=torch.float64)
    rkld, density = losses.atspeed_s_terms(p, q, real, p_kth, k=2)  # V_c = the draft's top 2: tokens 1, 0
    assert float(rkld[0]) == pytest.approx(0.6 * LOG(0.6 / 0.3) + 0.2 * LOG(0.2 / 0.5))
    assert float(density[0]) == pytest.approx(-(0.6 * LOG(0.6 / 0.25) + 0.2 * LOG(0.2 / 0.25)))
    assert float(rkld[0] + density[0]) == pytest.approx(0.6 * LOG(0.25 / 0.3) + 0.2 * LOG(0.25 / 0.5))


def test_atspeed_r_by_hand() -> None:
    p, q = log_tensor([[0.5, 0.3, 0.1]]), log_tensor([[0.2, 0.6, 0.1]])
    real = torch.ones(1, 3, dtype=torch.bool)
    # support: the target's top 2 (tokens 0, 1); p' = (.625, .375), q' = (.25, .75)
    assert float(losses.atspeed_r(p, q, real, k=2)[0]) == pytest.approx(0.375)
    assert float(losses.atspeed_r(p, q, real, k=3)[0]) == pytest.approx(
        0.5 * (abs(0.5 / 0.9 - 0.2 / 0.9) + abs(0.3 / 0.9 - 0.6 / 0.9) + 0.0))


def test_zero_when_the_distributions_agree_and_invalid_tokens_excluded() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    real = torch.rand(6, 9, generator=generator) > 0.3
    real[:, 0] = True
    p = torch.log_softmax(logits, -1).masked_fill(~real, -torch.inf)
    zeros = torch.zeros(6, dtype=torch.float64)
    torch.testing.assert_close(losses.word_kd(p, p, real), zeros)
    torch.testing.assert_close(losses.tvd_kd(p, p, real), zeros)
    torch.testing.assert_close(losses.atspeed_r(p, p, real, 3), zeros)
    torch.testing.assert_close(losses.atspeed_s_terms(p, p, real, p[:, 0], 3)[0], zeros)
    # whatever a padded (invalid) slot holds, the constrained losses do not see it
    noisy = p.clone()
    noisy[~real] = 5.0
    torch.testing.assert_close(losses.atspeed_r(noisy, noisy, real, 3), zeros)
    torch.testing.assert_close(losses.atspeed_s_terms(noisy, noisy, real, p[:, 0], 3)[0], zeros)
    torch.testing.assert_close(losses.word_kd(p, p, real), losses.word_kd(p, noisy.masked_fill(~real, -torch.inf),
                                                                          real))


def test_gradients_are_finite_with_padding() -> None:
    generator = torch.Generator().manual_seed(1)
    real = torch.rand(5, 7, generator=generator) > 0.4
    real[:, 0] = True
    p = torch.log_softmax(torch.randn(5, 7, generator=generator), -1).masked_fill(~real, -torch.inf)
    for fn in (lambda q: losses.word_kd(p, q, real), lambda q: losses.tvd_kd(p, q, real),
               lambda q: losses.atspeed_r(p, q, real, 3), lambda q: sum(losses.atspeed_s_terms(p, q, real, p[:, 0], 3))):
        logits = torch.randn(5, 7, generator=generator, requires_grad=True)
        q = torch.log_softmax(logits, -1).masked_fill(~real, -torch.inf)
        fn(q).sum().backward()
        assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


# ------------------------------------------------------------------ data, task, training


@pytest.fixture(scope="module")
def small_target(small_data, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811
    data, ids = small_data
    out = tmp_path_factory.mktemp("align") / "target"
    config = TrainConfig(epochs=2, batch_size=32, lr=0.01, warmup_steps=5, precision="fp32")
    fit(str(data), out, "draft-tiny", ids=ids, split_kind="loo", config=config, progress=False)
    return out, data


@pytest.fixture(scope="module")
def alignment_data(small_target, tmp_path_factory) -> Path:
    target, _ = small_target
    out = tmp_path_factory.mktemp("align") / "data"
    generate(target, out, DataConfig(k=5, valid_prompts=20, shard_size=64, batch_size=16), progress=False)
    return out


def forward_log_probs(model, prompt: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.cat((prompt, torch.tensor(prefix, dtype=torch.int64)))
        return torch.log_softmax(model(input_ids=ids[None]).logits[0, -1].float(), -1)


def test_alignment_data_is_what_the_target_says(small_target, alignment_data: Path) -> None:
    target_dir, _ = small_target
    manifest = json.loads((alignment_data / "manifest.json").read_text())
    assert manifest["complete"] and manifest["k"] == 5 and len(manifest["shards"]["train"]) >= 4
    recommender = Recommender.load(target_dir)
    # a small target keeps transformers' products (its calls are bound by per-operator overhead)
    assert not streams_weights(recommender.model) and not isinstance(recommender.model.lm_head.forward,
                                                                     SmallRowForward)
    task = AlignmentTask.load(alignment_data, recommender.encoder, recommender.trie, "sft", 0.5)
    train = task.data["train"]
    from recspec.decoding import tree_beam_search

    for row in range(0, len(train), 37):
        example = int(train.example[row])
        prompt = recommender.encoder.prompts(task.examples["train"], np.array([example]))[0]
        best = tree_beam_search(recommender.model, [prompt], recommender.trie, 5, recommender.encoder.pad_id)
        assert train.seq_tokens[row].tolist() == best.tokens[0].tolist()
        nodes = train.nodes[train.node_offsets[row]:train.node_offsets[row + 1]]
        for i, node in enumerate(nodes.tolist()):
            prefix = []
            walk = torch.tensor([node])
            while int(walk) != recommender.trie.root:
                prefix.insert(0, int(recommender.trie.last_token(walk)))
                walk = recommender.trie.parent(walk)
            children, real = recommender.trie.children(torch.tensor([node]))
            expected = forward_log_probs(recommender.model, prompt, prefix)[children[0][real[0]]]
            start = train.value_offsets[train.node_offsets[row] + i]
            stored = torch.from_numpy(train.values[start:start + len(expected)].astype(np.float32))
            torch.testing.assert_close(stored, expected, atol=2e-2, rtol=1e-3)


@pytest.fixture(scope="module")
def mixing_draft(small_target, tmp_path_factory) -> Path:
    """A second draft-tiny on the same data, seeded differently and trained for one epoch."""
    target_dir, data = small_target
    out = tmp_path_factory.mktemp("align") / "mixing-draft"
    config = TrainConfig(epochs=1, batch_size=32, lr=0.01, warmup_steps=5, precision="fp32", seed=1)
    fit(str(data), out, "draft-tiny", ids=target_dir / "item_index.json", split_kind="loo", config=config,
        progress=False)
    return out


def test_mixed_beam_search_scores_the_mixture_and_ends_in_each_model(small_target, mixing_draft: Path) -> None:
    """lambda = 1 / 0 is the target's / the draft's own beam search; in between, every returned
    sequence is scored by the mixture of the two models' plain forwards, best first."""
    from recspec.align.mixed import mixed_beam_search
    from recspec.decoding.beam_search import tree_beam_search
    from recspec.decoding.prompts import left_pad

    target_dir, _ = small_target
    recommender = Recommender.load(target_dir, draft_dir=mixing_draft)
    target, draft, trie, pad = recommender.model, recommender.draft, recommender.trie, recommender.encoder.pad_id
    prompts = recommender.encoder.prompts(recommender.examples("test"), np.arange(16))
    padded = left_pad(prompts, pad, target.device)
    with torch.inference_mode():
        for model, lam in ((target, 1.0), (draft, 0.0)):
            alone = tree_beam_search(model, prompts, trie, 5, pad)
            mixed = mixed_beam_search(target, draft, padded, trie, 5, lam)
            assert torch.equal(mixed.tokens, alone.tokens)
            torch.testing.assert_close(mixed.scores, alone.scores)
        mixed = mixed_beam_search(target, draft, padded, trie, 5, 0.3)
    assert bool((mixed.scores[:, :-1] >= mixed.scores[:, 1:]).all())
    target_top = tree_beam_search(target, prompts, trie, 5, pad).tokens
    assert int((mixed.tokens != target_top).any(dim=2).any(dim=1).sum()) >= 8  # the draft does move them
    for user in range(0, 16, 5):
        for beam in range(5):
            tokens = mixed.tokens[user, beam].tolist()
            expected = sum(float(torch.logaddexp(forward_log_probs(target, prompts[user], tokens[:t])[tokens[t]]
                                                 + LOG(0.3),
                                                 forward_log_probs(draft, prompts[user], tokens[:t])[tokens[t]]
                                                 + LOG(0.7)))
                           for t in range(trie.depth))
            assert float(mixed.scores[user, beam]) == pytest.approx(expected, abs=1e-4)


def test_target_mixed_data_keeps_the_target_scores_and_order(small_target, mixing_draft: Path,
                                                             tmp_path: Path) -> None:
    target_dir, _ = small_target
    config = DataConfig(k=5, max_prompts=48, valid_prompts=8, shard_size=64, batch_size=16, mix_lambda=0.3)
    manifest = generate(target_dir, tmp_path / "mixed", config, progress=False, mix_draft=mixing_draft)
    assert manifest["complete"] and manifest["mix_draft"] == str(mixing_draft.resolve())
    recommender = Recommender.load(target_dir)
    task = AlignmentTask.load(tmp_path / "mixed", recommender.encoder, recommender.trie, "atspeed-s", 0.5)
    train = task.data["train"]
    assert (np.diff(train.seq_scores, axis=1) <= 0).all()  # best first under the target: the last is y_K
    for row in range(0, len(train), 7):
        prompt = recommender.encoder.prompts(task.examples["train"], np.array([int(train.example[row])]))[0]
        for beam in range(5):
            tokens = train.seq_tokens[row, beam].tolist()
            expected = sum(float(forward_log_probs(recommender.model, prompt, tokens[:t])[tokens[t]])
                           for t in range(len(tokens)))
            assert float(train.seq_scores[row, beam]) == pytest.approx(expected, abs=1e-3)
    for bad, message in ((dict(mix_draft=None), "need both a mixing draft"),
                         (dict(mix_draft=mixing_draft, config=DataConfig(k=5)), "need both a mixing draft")):
        with pytest.raises(RecspecError, match=message):
            generate(target_dir, tmp_path / "bad", **{"config": config, "progress": False, **bad})
    with pytest.raises(RecspecError, match="mix_lambda"):
        DataConfig(mix_lambda=1.5)


def test_task_batch_draft_forward_and_sft_equal_plain_training(small_target, alignment_data: Path) -> None:
    target_dir, _ = small_target
    recommender = Recommender.load(target_dir)
    model = recommender.model
    task = AlignmentTask.load(alignment_data, recommender.encoder, recommender.trie, "sft", 0.5)
    rows = np.arange(0, 12)
    batch = task.batch(rows)
    draft = task.draft_log_probs(model, batch, None).detach()
    train = task.data["train"]
    for b, row in enumerate(rows):  # the tree forward gives, at each node, a plain forward's values
        prompt = recommender.encoder.prompts(task.examples["train"], np.array([train.example[row]]))[0]
        for t in range(recommender.trie.depth):
            node = int(batch["gt_nodes"][b, t])
            expected = forward_log_probs(model, prompt, train.gt_tokens[row, :t].tolist())
            children, real = batch["children"][b, node], batch["real"][b, node]
            torch.testing.assert_close(draft[b, node][real], expected[children[real]], atol=1e-4, rtol=0)
    # SFT on alignment data is exactly next-item training on the same examples
    plain = recommender.encoder.training_batch(task.examples["train"], train.example[rows])
    with torch.no_grad():
        assert float(task.loss(model, batch, None)) == pytest.approx(float(answer_loss(model, plain, None)[0]),
                                                                      abs=1e-5)
        for method in METHODS:
            task.method = method
            assert math.isfinite(float(task.loss(model, batch, None))), method


def test_data_resumes_and_refuses_to_mix(small_target, alignment_data: Path, tmp_path: Path) -> None:
    target_dir, _ = small_target
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(alignment_data, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    last = manifest["shards"]["train"].pop()
    manifest["complete"] = False
    (copy / last["file"]).unlink()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    again = generate(target_dir, copy, DataConfig(k=5, valid_prompts=20, shard_size=64, batch_size=16),
                     progress=False)
    assert again["shards"]["train"][-1]["sha256"] == last["sha256"]  # regenerated exactly
    with pytest.raises(RecspecError, match="another target, data set or setting"):
        generate(target_dir, copy, DataConfig(k=4, valid_prompts=20, shard_size=64, batch_size=16), progress=False)
    recommender = Recommender.load(target_dir)
    shard = copy / again["shards"]["train"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(RecspecError, match=f"{shard.name}: missing, truncated or altered"):
        AlignmentTask.load(copy, recommender.encoder, recommender.trie, "sft", 0.5)
    with pytest.raises(RecspecError, match=r"alpha must lie in \[0, 1\]"):
        AlignmentTask.load(alignment_data, recommender.encoder, recommender.trie, "sft", 1.5)
    with pytest.raises(RecspecError, match="unknown alignment method"):
        AlignmentTask.load(alignment_data, recommender.encoder, recommender.trie, "distill", 0.5)


def cli_spec_and_beam(target_dir: Path, draft: str, out_dir: Path, draft_beams: int) -> tuple[list, list]:
    """The items of `recspec recommend` with spec-strict (``draft``) and with beam, K = 5."""
    read = lambda path: [json.loads(line)["items"] for line in path.read_text().splitlines()]  # noqa: E731
    for decoder, extra in (("spec-strict", ["--draft", draft, "--draft-beams", str(draft_beams)]), ("beam", [])):
        run = recspec("recommend", "--target", str(target_dir), "--decoder", decoder, "--k", "5", *extra,
                      "--out", str(out_dir / f"{decoder}.jsonl"), "--overwrite")
        assert run.returncode == 0, run.stderr
    return read(out_dir / "spec-strict.jsonl"), read(out_dir / "beam.jsonl")


def test_align_train_every_method_then_speculative(small_target, alignment_data: Path, tmp_path: Path) -> None:
    target_dir, data = small_target
    config = TrainConfig(epochs=1, batch_size=32, lr=0.01, warmup_steps=2, precision="fp32")
    for method in METHODS:
        result = align_fit(alignment_data, tmp_path / method, method, 0.5, target_dir=target_dir, config=config,
                           eval_users=20, eval_k=5, progress=False)
        assert result.metric == "accepted_steps" and 0 <= result.best_value <= 2
        assert math.isfinite(result.history[0]["train_loss"])
    spec, beam = cli_spec_and_beam(target_dir, str(tmp_path / "atspeed-s"), tmp_path, 10)
    assert spec and spec == beam
    cli = recspec("align", "train", "--data", str(alignment_data), "--out", str(tmp_path / "cli"), "--method",
                  "atspeed-r", "--epochs", "1", "--precision", "fp32", "--batch-size", "32")
    assert cli.returncode == 0, cli.stderr
    bad = recspec("align", "train", "--data", str(alignment_data), "--out", str(tmp_path / "bad"), "--alpha", "2")
    assert bad.returncode == 2 and "alpha must lie in [0, 1]" in bad.stderr


def test_bench_align_with_heads_ranks_every_method_of_both_kinds(small_target, alignment_data: Path,
                                                                    tmp_path: Path) -> None:
    """`bench align --heads`: a draft and a head per method, trained once (a second call reuses
    them), every strict row returning beam search's items, AS@K over the batched users, the
    ranking against the paper's, each draft's validation curve, and the result files."""
    from benchmarks.lab.align import KINDS, VERIFICATIONS, run, train_drafts
    from recspec.models.head import is_head_dir

    target_dir, _ = small_target
    work, out = tmp_path / "work", tmp_path / "results"
    out.mkdir()
    run(out, target_dir, alignment_data, work, ks=(5,), users=3, repeats=1, alphas=(0.1,), train_minutes=1.0,
        epochs=1, quality_users=12, heads=True, as_users=24, name="align-test", head_minutes=2.0)
    result = json.loads((out / "align-test.json").read_text())
    rows = result["rows"]
    assert len(rows) == len(KINDS) * len(METHODS) * len(VERIFICATIONS)
    assert {(r["kind"], r["method"], r["verify"]) for r in rows} == {
        (kind, method, verify) for kind in KINDS for method in METHODS for verify in VERIFICATIONS}
    for row in rows:
        assert row["k"] == 5 and len(row["runs_s"]) == 1 and row["ws"] > 0 and 0 <= row["as"] <= 2 and 1 <= row["calls"] <= 3
        assert row["same_items_as_beam"] is (True if row["verify"] == "strict" else None)
    assert len(result["ranking"]) == len(KINDS) * len(VERIFICATIONS)
    for entry in result["ranking"]:
        assert sorted(entry["order"]) == sorted(METHODS)
        cells = {r["method"]: r["as"] for r in rows
                 if (r["kind"], r["verify"], r["k"]) == (entry["kind"], entry["verify"], entry["k"])}
        assert [cells[m] for m in entry["order"]] == sorted(cells.values(), reverse=True)
    assert sorted(result["validation"]) == sorted([*METHODS, *(f"head-{m}" for m in METHODS)])
    assert all(len(curve) == 1 for curve in result["validation"].values())
    assert [r["alpha"] for r in result["alpha_curve"]] == [0.1, 0.5]
    assert result["patience"] == 2 and "patience 2 epochs" in (out / "align-test.md").read_text()
    assert result["train_minutes"] == 1.0 and result["head_minutes"] == 2.0
    assert "1.0 min each (heads 2.0 min)" in (out / "align-test.md").read_text()
    assert (out / "align-test.md").read_text().count("| strict | head |") == len(METHODS)
    assert (out / "align-test_as.png").stat().st_size > 0
    drafts = train_drafts(work, alignment_data, target_dir, KINDS, 0.5, TrainConfig(epochs=1))
    assert all(is_head_dir(folder) == (kind == "head") for (kind, _), folder in drafts.items())
    stamps = {folder: (folder / "finished").stat().st_mtime_ns for folder in drafts.values()}
    again = train_drafts(work, alignment_data, target_dir, KINDS, 0.5, TrainConfig(epochs=1))
    assert again == drafts and all((f / "finished").stat().st_mtime_ns == t for f, t in stamps.items())
    bad = lab("align", "--target", str(target_dir), "--data", str(alignment_data), "--as-users", "0")
    assert bad.returncode == 2 and "--as-users must be at least 1" in bad.stderr
    bad = lab("align", "--target", str(target_dir), "--data", str(alignment_data), "--patience", "0")
    assert bad.returncode == 2 and "--patience must be at least 1" in bad.stderr
