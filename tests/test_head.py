"""Feature-level draft heads: strict speculative beam search with a head returns exactly what beam
search returns (random targets and heads, several K, N, gamma and batchings; a trained target and
a trained head through the CLI); the head's first round is the target's prefill alone; head
folders are checked (checksums, the target they were trained for); training on alignment data
lowers the loss and the head drafts better than the untrained one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.lab.coverage import level_coverage
from recspec.align.train import head_fit
from recspec.auto import width_choices
from recspec.decoding import beam_search
from recspec.decoding.draft_sources import ModelHeadPair
from recspec.decoding.speculative_beam import SpecConfig, speculative_beam_search
from recspec.errors import RecspecError
from recspec.models.head import DraftHead, HeadConfig, HeadDraft, load_head, save_head
from recspec.models.train import TrainConfig
from recspec.recommend import Recommender, run_decoder
from tests.test_align import alignment_data, cli_spec_and_beam, small_target  # noqa: F401  (fixtures)
from tests.test_beam import CONTROL, PAD, SETUPS, Setup
from tests.test_cli import lab, recspec
from tests.test_recommend_cli import small_data  # noqa: F401  (fixture)
from tests.test_speculative import small_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def random_head(setup: Setup, seed: int, scale: float = 1.0, context_heads: int = 0) -> HeadDraft:
    """An untrained head over ``setup``'s target (attending over the prompt's features with
    ``context_heads`` heads), its weights perturbed by ``scale`` so that it disagrees with the target."""
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig(hidden=setup.model.config.hidden_size, intermediate=48, layers=1,
                                levels=setup.trie.depth, context_heads=context_heads))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(scale * torch.randn_like(parameter) * 0.1)
    return HeadDraft(head.eval(), setup.model, torch.arange(CONTROL, setup.model.config.vocab_size))


@pytest.fixture(scope="module", params=sorted(SETUPS))
def setup(request) -> Setup:
    return SETUPS[request.param]()


@pytest.mark.parametrize("k", (1, 5, 10))
def test_strict_with_a_head_equals_beam_search(setup: Setup, k: int) -> None:
    reference = beam_search(setup.model, setup.prompts, setup.trie, k, PAD)
    longest = setup.trie.depth - 1
    for seed, n, gamma, batch in ((0, k, None, None), (1, 2 * k, 1, 3), (2, 4 * k, None, 1), (3, 3 * k, longest, 4)):
        head = random_head(setup, seed, context_heads=seed % 2 * 2)  # seeds 1 and 3 attend over the prompt
        result = speculative_beam_search(setup.model, head, setup.prompts, setup.trie, k, PAD,
                                         SpecConfig(draft_beams=n, gamma=gamma), batch_size=batch)
        assert torch.equal(result.topk.items, reference.items), (seed, n, gamma, batch)
        torch.testing.assert_close(result.topk.scores, reference.scores, atol=1e-4, rtol=0)
        assert torch.equal(result.topk.tokens, reference.tokens)
        stats = result.stats
        # the first round is the prefill alone (level 1 exact), then at least one drafted round
        assert (stats.target_calls >= 2).all() and torch.equal(stats.target_calls, stats.rounds)
        assert (stats.accepted_steps <= (stats.rounds - 1) * longest).all()


@pytest.mark.parametrize("k", (1, 5, 10))
def test_strict_with_a_model_then_a_head_equals_beam_search(setup: Setup, k: int) -> None:
    reference = beam_search(setup.model, setup.prompts, setup.trie, k, PAD)
    draft = small_llama(setup.model.config.vocab_size, seed=7)
    for seed, n, gamma, batch in ((5, k, None, None), (6, 2 * k, 1, 3), (7, 3 * k, None, 1)):
        pair = ModelHeadPair(draft, random_head(setup, seed, context_heads=seed % 2 * 2))  # 5 and 7 attend
        result = speculative_beam_search(setup.model, pair, setup.prompts, setup.trie, k, PAD,
                                         SpecConfig(draft_beams=n, gamma=gamma), batch_size=batch)
        assert torch.equal(result.topk.items, reference.items), (seed, n, gamma, batch)
        torch.testing.assert_close(result.topk.scores, reference.scores, atol=1e-4, rtol=0)
        assert torch.equal(result.stats.target_calls, result.stats.rounds)
    perfect = speculative_beam_search(setup.model, ModelHeadPair(setup.model, random_head(setup, 0)), setup.prompts,
                                      setup.trie, k, PAD, SpecConfig(draft_beams=k))
    assert (perfect.stats.target_calls == 1).all()  # the model drafts the first round, in the prompt's call


def test_an_attending_head_reads_each_users_own_prompt() -> None:
    """The attention reads the real prompt tokens only (what lies under the mask does not matter),
    what it reads changes the guess, and a batch drafts for each user from that user's prompt:
    the same drafts, so the same acceptance per user, whether users run alone or batched with
    prompts of other lengths."""
    head = DraftHead(HeadConfig(hidden=16, intermediate=32, layers=1, levels=3, context_heads=2))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    parent, embedded, level = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.zeros(2, 3, dtype=torch.int64)
    context, mask = torch.randn(2, 5, 16), torch.tensor([[True] * 5, [True, True, True, False, False]])
    guess = head(parent, embedded, level, (context, mask))
    masked = context.clone()
    masked[1, 3:] = 100.0
    torch.testing.assert_close(head(parent, embedded, level, (masked, mask)), guess)
    moved = context.clone()
    moved[1, 0] += 1.0
    assert not torch.allclose(head(parent, embedded, level, (moved, mask))[1], guess[1])
    torch.testing.assert_close(head(parent, embedded, level, (moved, mask))[0], guess[0])
    with pytest.raises(RuntimeError, match="attends over the prompt's features"):
        head(parent, embedded, level)
    with pytest.raises(RecspecError, match="do not divide"):
        HeadConfig(hidden=16, intermediate=32, layers=1, levels=3, context_heads=3).check()

    setup = SETUPS["L3"]()
    drafter = random_head(setup, 11, scale=0.2, context_heads=2)
    alone = speculative_beam_search(setup.model, drafter, setup.prompts, setup.trie, 3, PAD,
                                    SpecConfig(draft_beams=12, gamma=1), batch_size=1).stats
    batched = speculative_beam_search(setup.model, drafter, setup.prompts, setup.trie, 3, PAD,
                                      SpecConfig(draft_beams=12, gamma=1), batch_size=len(setup.prompts)).stats
    assert torch.equal(alone.accepted_steps, batched.accepted_steps) and int(alone.accepted_steps.sum()) > 0


def test_relaxed_with_a_head_returns_k_real_items() -> None:
    setup = SETUPS["L3"]()
    result = speculative_beam_search(setup.model, random_head(setup, 4), setup.prompts, setup.trie, 5, PAD,
                                     SpecConfig(verify="relaxed", seed=3))
    assert (result.topk.items >= 0).all() and all(len(set(row)) == 5 for row in result.topk.items.tolist())
    assert (result.topk.scores[:, :-1] >= result.topk.scores[:, 1:]).all()


def test_dsbd_refuses_a_head() -> None:
    setup = SETUPS["L3"]()
    for draft in (random_head(setup, 0), ModelHeadPair(setup.model, random_head(setup, 0))):
        with pytest.raises(RecspecError, match="dsbd drafts with a draft model"):
            run_decoder("dsbd", setup.model, draft, setup.prompts, setup.trie, 3, PAD)


def test_head_folder_is_checked(tmp_path: Path) -> None:
    head = DraftHead(HeadConfig(hidden=16, intermediate=32, layers=2, levels=3))
    fingerprint = {"target_weights_sha256": "a" * 64, "index_sha256": "b" * 64}
    save_head(tmp_path / "head", head, fingerprint, {"note": "test"})
    loaded = load_head(tmp_path / "head", fingerprint)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(RecspecError, match="trained for another target"):
        load_head(tmp_path / "head", {**fingerprint, "target_weights_sha256": "c" * 64})
    weights = tmp_path / "head" / "head.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RecspecError, match="head.safetensors"):
        load_head(tmp_path / "head", fingerprint)
    with pytest.raises(RecspecError, match="not a head folder"):
        (tmp_path / "bare").mkdir()
        (tmp_path / "bare" / "head.json").write_text("{}")
        load_head(tmp_path / "bare", fingerprint)


def test_features_are_kept_before_training_and_equal_those_computed_lazily(small_target,  # noqa: F811
                                                                            alignment_data: Path,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    """`head_fit` computes the target's features of every row before its budget starts; they are
    the ones the first epoch would have computed batch by batch."""
    from recspec.align.data import PARTS
    from recspec.align.head import HeadAlignmentTask, HeadStore
    from recspec.align.task import AlignmentTask
    from recspec.models.head import bind_head

    target_dir, _ = small_target
    recommender = Recommender.load(target_dir)

    def task(out: Path) -> HeadAlignmentTask:  # a head that attends: the prompt's features are kept too
        head = DraftHead(HeadConfig(hidden=recommender.model.config.hidden_size, intermediate=32, layers=1,
                                    levels=recommender.trie.depth, context_heads=2))
        bound = bind_head(head, recommender.model, recommender.tokenizer, recommender.index)
        base = AlignmentTask.load(alignment_data, recommender.encoder, recommender.trie, "sft", 0.5)
        return HeadAlignmentTask(base, bound, HeadStore(out, {}, {}))

    eager, lazy = task(tmp_path / "eager"), task(tmp_path / "lazy")
    eager.keep_features(torch.device("cpu"), None, batch_size=7, progress=False)
    assert set(eager.kept) == {(i, row) for i, part in enumerate(PARTS) for row in range(len(eager.data[part]))}
    for part in PARTS:
        batch = lazy.batch(np.arange(5), part)
        (nodes, (context, mask)), (lazy_nodes, lazy_context) = (eager.target_features(batch, None),
                                                                lazy.target_features(batch, None))
        torch.testing.assert_close(nodes, lazy_nodes, atol=1e-3, rtol=2e-3)
        torch.testing.assert_close((context, mask), lazy_context, atol=1e-3, rtol=2e-3)
        assert torch.equal(mask.sum(dim=1), batch["attention_mask"].sum(dim=1))  # every real prompt token
        last = context[torch.arange(len(context)), mask.sum(dim=1) - 1]  # the last prompt token is the root
        torch.testing.assert_close(last, nodes[:, 0], atol=1e-3, rtol=2e-3)
    assert len(lazy.kept) == 10


@pytest.mark.slow
def test_head_trains_and_drafts_exactly_through_the_cli(small_target, alignment_data: Path,  # noqa: F811
                                                          tmp_path: Path) -> None:
    target_dir, _ = small_target
    config = TrainConfig(epochs=3, batch_size=32, lr=0.003, warmup_steps=2, precision="fp32", patience=3)
    result = head_fit(alignment_data, target_dir, tmp_path / "head", "atspeed-s", config=config, eval_users=20,
                      eval_k=5, progress=False, context_heads=2)  # a head that attends over the prompt
    losses = [row["train_loss"] for row in result.history if "train_loss" in row]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert result.metric == "accepted_steps" and 0 < result.best_value <= 2
    saved = json.loads((tmp_path / "head" / "best" / "head.json").read_text())
    assert saved["config"]["context_heads"] == 2 and "shape" not in saved  # the config is the shape
    with pytest.raises(RecspecError, match="a head trained otherwise"):  # resumed with another shape: refused
        head_fit(alignment_data, target_dir, tmp_path / "head", "atspeed-s", config=config, eval_users=20,
                 eval_k=5, progress=False)

    recommender = Recommender.load(target_dir, draft_dir=tmp_path / "head")
    assert isinstance(recommender.draft, HeadDraft)
    examples = recommender.examples("test", users=40)
    beam = recommender.recommend(examples, 5, "beam")
    spec = recommender.recommend(examples, 5, "spec-strict", options=recommender_options(5))
    assert torch.equal(spec.topk.items, beam.topk.items)
    torch.testing.assert_close(spec.topk.scores, beam.topk.scores, atol=1e-4, rtol=0)

    prompts = recommender.encoder.prompts(examples)
    own = level_coverage(recommender, recommender.model, prompts, 5, 5)  # the target drafting for itself
    assert 1 in own and set(own) <= set(range(1, recommender.trie.depth))  # a perfect draft skips by its bonus
    assert all(hit == n for hit, n in own.values())
    head = level_coverage(recommender, recommender.draft, prompts, 5, 10)
    assert head and min(head) == 2 and all(0 <= hit <= n for hit, n in head.values())  # level 1: the prefill

    for batch in (1, 16):  # auto: whatever it picks, the items are beam search's
        auto = recommender.recommend(examples, 5, "auto", batch_size=batch)
        assert auto.choice.startswith("auto: ") and torch.equal(auto.topk.items, beam.topk.items), auto.choice
    folder = recommender.folder
    assert (folder / "acceptance-k5.json").is_file() and (folder / "calibration-cpu.json").is_file()
    assert (tmp_path / "head" / "best" / "calibration-cpu.json").is_file()
    plain = Recommender.load(target_dir).recommend(examples, 5, "auto", batch_size=4)  # tree-beam, root or not
    assert plain.choice.startswith("auto: tree-beam") and "(no draft loaded; tree-beam " in plain.choice
    assert torch.equal(plain.topk.items, beam.topk.items)

    spec_items, beam_items = cli_spec_and_beam(target_dir, str(tmp_path / "head"), tmp_path, 5)
    assert spec_items and spec_items == beam_items
    read = lambda path: [json.loads(line)["items"] for line in path.read_text().splitlines()]  # noqa: E731
    auto = recspec("recommend", "--target", str(target_dir), "--decoder", "auto", "--draft",
                   f"{target_dir}+{tmp_path / 'head'}", "--k", "5", "--batch-size", "1", "--out", str(tmp_path / "a.jsonl"))
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.startswith("auto: ") and read(tmp_path / "a.jsonl") == beam_items

    calibrate = recspec("calibrate", "--target", str(target_dir), "--draft", str(tmp_path / "head"), "--k", "2",
                        "--k", "5", "--repeats", "2", "--threads", "1")
    assert calibrate.returncode == 0, calibrate.stderr
    lines = calibrate.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["target", "draft, later rounds"] + [
        f"acceptance at K={k}, {part}" for k in (2, 5) for part in ("first round", "later rounds")]
    assert "nothing drafted" in lines[4] and "level 1: N=5" in lines[5]  # a head drafts from the second round on
    for k in (2, 5):  # kept for the widths `auto` asks for (at K = 2 the root's 5 children too): auto reuses them
        record = json.loads((folder / f"acceptance-k{k}.json").read_text())
        assert record["choices"] == list(width_choices(recommender.trie, k))
    bench = lab("auto", "--target", str(target_dir), "--draft", str(tmp_path / "head"), "--k", "5",
                "--batch-size", "2", "--users", "4", "--repeats", "1", "--out", str(tmp_path / "bench"))
    assert bench.returncode == 0, bench.stderr
    row = json.loads((tmp_path / "bench" / "auto.json").read_text())["rows"][0]
    assert row["same_as_beam"] and row["auto_vs_best"] > 0 and row["choice"].startswith("auto: ")
    compare = recspec("bench", "compare", "--target", str(target_dir), "--draft", str(tmp_path / "head"), "--k", "5",
                      "--users", "6", "--repeats", "2", "--out", str(tmp_path / "bench"))  # what `make demo` prints
    assert compare.returncode == 0, compare.stderr
    result = json.loads((tmp_path / "bench" / "compare.json").read_text())
    assert [r["decoder"] for r in result["rows"]] == ["beam", "tree-beam", "tree-beam+root", "spec-strict", "auto"]
    assert all(r["same_items"] and len(r["runs_s"]) == 2 and r["users_per_s"] > 0 for r in result["rows"])
    assert result["rows"][0]["speedup"] == 1.0 and result["auto_choice"].startswith("auto: ")
    assert "| auto |" in compare.stdout and "Fastest: " in compare.stdout
    for bad in ("fast", "beam+root"):
        unknown = recspec("bench", "compare", "--target", str(target_dir), "--decoder", "beam", "--decoder", bad,
                          "--out", str(tmp_path / "bench"))
        assert unknown.returncode == 2 and f"unknown: {bad}" in unknown.stderr
    coverage = lab("coverage", "--target", str(target_dir), "--draft", str(target_dir), "--k", "5",
                   "--factor", "1", "--users", "8", "--out", str(tmp_path / "bench"))
    assert coverage.returncode == 0, coverage.stderr
    rows = json.loads((tmp_path / "bench" / "coverage.json").read_text())["rows"]
    assert rows and all(r["coverage"] == 1.0 for r in rows)  # the target covers itself at N = K

    cli = recspec("align", "train", "--head", "--data", str(alignment_data), "--out", str(tmp_path / "cli"),
                  "--target", str(target_dir), "--epochs", "1", "--precision", "fp32", "--batch-size", "32",
                  "--eval-users", "10", "--eval-k", "5", "--head-attention", "4")
    assert cli.returncode == 0, cli.stderr
    assert json.loads((tmp_path / "cli" / "best" / "head.json").read_text())["config"]["context_heads"] == 4
    no_target = recspec("align", "train", "--head", "--data", str(alignment_data), "--out", str(tmp_path / "x"))
    assert no_target.returncode == 2 and "--head needs --target" in no_target.stderr
    no_head = recspec("align", "train", "--head-attention", "2", "--data", str(alignment_data), "--out",
                      str(tmp_path / "x"))
    assert no_head.returncode == 2 and "use it with --head" in no_head.stderr
    uneven = recspec("align", "train", "--head", "--head-attention", "3", "--data", str(alignment_data), "--out",
                     str(tmp_path / "uneven"), "--target", str(target_dir))
    assert uneven.returncode == 2 and "do not divide its width 128" in uneven.stderr
    assert not (tmp_path / "uneven").exists()  # refused before the folder is made
    dsbd = recspec("recommend", "--target", str(target_dir), "--decoder", "dsbd", "--draft", str(tmp_path / "head"),
                   "--k", "5", "--out", str(tmp_path / "dsbd.jsonl"))
    assert dsbd.returncode == 2 and "dsbd drafts with a draft model" in dsbd.stderr


def recommender_options(n: int):
    from recspec.recommend import DecodeOptions

    return DecodeOptions(draft_beams=n)


def test_level_prior_takes_level_two_apart(small_target, tmp_path: Path) -> None:  # noqa: F811
    """`python -m benchmarks.lab level-prior`: the target's level-1 beams and level-2 log-probs of a padded
    batch are those of plain unpadded forwards; a prior counted from one user is that user's own
    distribution, so it ranks all K target pairs first, as the target itself does; the command
    writes one row per draft and N and refuses more users than the data has, in one line."""
    from benchmarks.lab.level_prior import NodePrior, first_levels, level_two, ranked_hits
    from recspec.models.head import head_fingerprint
    from recspec.models.checkpoint import trained_model_dir
    from tests.test_align import forward_log_probs

    target_dir, _ = small_target
    recommender = Recommender.load(target_dir)
    prompts = recommender.encoder.prompts(recommender.examples("test", 6))
    k, levels = 4, first_levels(recommender.trie, torch.device("cpu"))
    with torch.no_grad():
        two = level_two(recommender, prompts, k, levels)
        for i, prompt in enumerate(prompts):
            root = forward_log_probs(recommender.model, prompt, [])
            torch.testing.assert_close(two.log_p1[i], root[two.x1[i]], atol=1e-4, rtol=0)
            assert two.log_p1[i].min() >= root[levels[0]].topk(k).values.min() - 1e-4  # the K best first tokens
            for beam in range(k):
                below = forward_log_probs(recommender.model, prompt, [int(two.x1[i, beam])])
                real = two.real[i, beam]
                torch.testing.assert_close(two.log_p2[i, beam][real], below[two.children[i, beam][real]],
                                           atol=1e-4, rtol=0)
        ns = [k, 2 * k]
        assert (ranked_hits(two, two.log_p2, k, ns) == k).all()  # the target drafting for itself
        for i in range(len(prompts)):
            one = level_two(recommender, prompts[i:i + 1], k, levels)
            prior = NodePrior(*levels[1].shape)
            prior.add(one)
            log_q, unseen = prior.log_q(one)
            assert unseen == 0 and (ranked_hits(one, log_q, k, ns) == k).all()
            assert NodePrior(*levels[1].shape).log_q(one)[1] == k  # an empty prior knows no beam

    head = DraftHead(HeadConfig(hidden=recommender.model.config.hidden_size, intermediate=32, layers=1,
                                levels=recommender.trie.depth))
    save_head(tmp_path / "head", head, head_fingerprint(trained_model_dir(target_dir), recommender.index), {})
    out = tmp_path / "results"
    run = lab("level-prior", "--target", str(target_dir), "--draft", str(tmp_path / "head"),
              "--k", str(k), "--users", "8", "--prior-users", "16", "--out", str(out))
    assert run.returncode == 0, run.stderr
    saved = json.loads((out / "level-prior.json").read_text())
    assert [(row["draft"], row["n"]) for row in saved["rows"]] == [
        (draft, n) for draft in ("head", "target prior", "uniform") for n in (4, 8, 16)]
    assert all(0 <= row["coverage"] <= row["recall"] <= 1 for row in saved["rows"])
    assert 1 <= saved["head_sibling_rank_mean"] and 0 < saved["head_mass_on_children"] <= 1
    run = lab("level-prior", "--target", str(target_dir), "--k", str(k), "--users", "8",
              "--prior-users", "16", "--out", str(out), "--name", "prior-alone")  # no head: the table alone
    assert run.returncode == 0, run.stderr
    alone = json.loads((out / "prior-alone.json").read_text())
    assert alone["rows"] == saved["rows"][3:] and alone["head"] is None  # the same table, the same users
    run = lab("level-prior", "--target", str(target_dir), "--draft", str(tmp_path / "head"),
              "--users", "8", "--prior-users", "100000", "--out", str(out))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == ("error: --users 8 and --prior-users 100000 need 100008 test "
                                                   "users; the data has 60")
