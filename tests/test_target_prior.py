"""The target prior (recspec.decoding.target_prior, `recspec align prior`): its weights are the
target's own conditionals summed over its exact beams (checked against plain, uncached forwards
and a beam search written out here), it drafts their mean per trie node, strict speculative search
with it returns what tree-beam returns on a trained target (through the command line and the API),
and its folder is checked (checksums, the target it was fitted for, what it may be combined with).
Exactness over 1,000 users of both data sets: tests/exactness.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recspec.decoding.target_prior import (PRIOR_WEIGHTS, TargetPrior, TargetPriorDraft, empty_weights, fit_prior,
                                           load_prior)
from recspec.errors import RecspecError
from recspec.recommend import DecodeOptions, Recommender, read_recs
from tests.test_cli import recspec

pytestmark = pytest.mark.usefixtures("one_thread")

K = 4


@pytest.fixture(scope="module")
def target(trained_models: Path) -> Recommender:
    return Recommender.load(trained_models / "target")


@pytest.fixture(scope="module")
def prior_dir(trained_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prior") / "prior"
    done = recspec("align", "prior", "--target", str(trained_models / "target"), "--out", str(out), "--users", "300",
                   "--k", "10", "--batch-size", "50")
    assert done.returncode == 0, done.stderr
    assert "fitted on 300 prompts" in done.stdout and f"wrote {out}" in done.stdout
    return out


def brute_force_weights(recommender: Recommender, prompts: list[torch.Tensor], k: int) -> torch.Tensor:
    """What :func:`fit_prior` adds, written out: per user a plain top-``k`` beam search by uncached
    forwards of the prompt and each prefix; every live beam adds the target's probability of each
    trie child of its node to that child."""
    trie, model = recommender.trie, recommender.model
    weights = torch.zeros(trie.num_nodes, dtype=torch.float64)
    for prompt in prompts:
        beams = [((), 0.0)]
        for _ in range(trie.depth):
            candidates = []
            for prefix, score in beams:
                ids = torch.cat((prompt, torch.tensor(prefix, dtype=torch.int64)))[None]
                with torch.no_grad():
                    log_p = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
                node = trie.walk(torch.tensor([prefix], dtype=torch.int64)) if prefix else torch.tensor([trie.root])
                tokens, real = trie.children(node)
                for token in tokens[0][real[0]].tolist():
                    child = int(trie.step(node, torch.tensor([token]))[0])
                    weights[child] += float(log_p[token].exp())
                    candidates.append(((*prefix, token), score + float(log_p[token])))
            beams = sorted(candidates, key=lambda pair: -pair[1])[:k]
    return weights


def test_fit_sums_the_targets_conditionals_over_its_beams(target: Recommender) -> None:
    """Batched, padded, cached tree-attention fitting equals the written-out search (users of
    different prompt lengths in one batch, and two batches adding to one table)."""
    prompts = target.encoder.prompts(target.examples("test", 6))
    fitted = fit_prior(target.model, prompts, target.trie, K, target.encoder.pad_id, batch_size=4)
    learnt = fitted - empty_weights(target.trie)
    expected = brute_force_weights(target, prompts, K)
    torch.testing.assert_close(learnt, expected, atol=2e-5, rtol=1e-4)
    assert float(expected.sum()) > 0.9 * 6 * (1 + K * (target.trie.depth - 1))  # most mass lies on the trie


def test_the_draft_is_the_mean_conditional_and_uniform_where_nothing_was_fitted(target: Recommender) -> None:
    """A child's q is its share of its siblings' weight: uniform before any fit, the weights'
    proportions once fitted (the pseudo-count moves them by less than 1e-3)."""
    trie = target.trie
    empty = TargetPriorDraft(TargetPrior(empty_weights(trie).float(), trie))
    weights = empty_weights(trie)
    tokens = trie.first_tokens()
    children = trie.step(torch.full_like(tokens, trie.root), tokens)
    weights[children[:3]] += torch.tensor([3.0, 1.0, 0.0], dtype=torch.float64)
    fitted = TargetPriorDraft(TargetPrior(weights.float(), trie))
    for draft, expect in ((empty, None), (fitted, weights[children] / weights[children].sum())):
        log_q = draft_log_q(draft, trie.root)
        shares = log_q[tokens].exp()
        if expect is None:
            torch.testing.assert_close(shares, torch.full_like(shares, 1 / len(tokens)))
        else:
            torch.testing.assert_close(shares.double(), expect, atol=1e-6, rtol=1e-5)
        assert float(shares.sum()) == pytest.approx(1.0, abs=1e-5)


def draft_log_q(draft: TargetPriorDraft, node: int) -> torch.Tensor:
    """The draft's ``log q`` over the vocabulary at trie ``node``, ``[V]``."""
    from types import SimpleNamespace

    levels = [SimpleNamespace(nodes=torch.tensor([[node]]))]
    return draft.log_probs(levels, None)[0, 0]


def test_strict_search_with_the_prior_returns_tree_beams_items(target: Recommender, trained_models: Path,
                                                              prior_dir: Path, tmp_path: Path) -> None:
    """Through the API (widths, gammas, batches of 1 and 16) and the command line: the same items
    and scores as tree-beam, with levels accepted. The first round drafts from the root: drafted
    wider than the root has children, level 1 is all of them (no dead node fed) and always
    accepted, so the first two levels cost one target call."""
    recommender = target.with_draft(prior_dir)
    assert isinstance(recommender.draft, TargetPrior) and recommender.draft_names == [str(prior_dir)]
    examples = recommender.examples("test", 48)
    reference = recommender.recommend(examples, 10, "tree-beam", 16).topk
    for n, gamma, batch in ((10, None, 1), (20, 1, 16), (40, None, 16)):
        decoded = recommender.recommend(examples, 10, "spec-strict", batch, DecodeOptions(draft_beams=n, gamma=gamma))
        assert torch.equal(decoded.topk.items, reference.items), (n, gamma, batch)
        torch.testing.assert_close(decoded.topk.scores, reference.scores, atol=1e-4, rtol=0)
        if n == 40:
            assert float(decoded.stats.accepted_steps.sum()) > 0
    trie = recommender.trie
    fanout = len(trie.first_tokens())

    def root_only(first: bool, remaining: int) -> tuple[int, ...]:  # the root's children, nothing later
        return (fanout + 5,) if first else ()

    decoded = recommender.recommend(examples, 10, "spec-strict", 16, DecodeOptions(planner=root_only))
    assert torch.equal(decoded.topk.items, reference.items)
    stats = decoded.stats
    assert bool((stats.accepted_steps == 1).all()) and bool((stats.target_calls == trie.depth - 1).all())
    assert bool((stats.tree_nodes == fanout + 10 * (trie.depth - 2)).all())
    relaxed = recommender.recommend(examples, 5, "spec-relaxed", 16).topk
    assert (relaxed.items >= 0).all() and all(len(set(row)) == 5 for row in relaxed.items.tolist())
    out = tmp_path / "recs.jsonl"
    done = recspec("recommend", "--target", str(trained_models / "target"), "--out", str(out), "--decoder",
                   "spec-strict", "--draft", str(prior_dir), "--users", "48", "--k", "10", "--draft-beams", "20")
    assert done.returncode == 0, done.stderr
    keys = recommender.index.item_keys
    assert [row["items"] for row in read_recs(out)] == [[keys[i] for i in row] for row in reference.items.tolist()]


def test_the_root_draft_takes_level_one_with_the_prompt(target: Recommender, trained_models: Path,
                                                        tmp_path: Path) -> None:
    """``--draft root``, the unfitted prior: it drafts every node's children alike, and drafted as
    wide as the root's children its first round feeds all of them with the prompt, so the first
    two beam steps cost one target call; tree-beam's items through the API (batches of 1 and 16),
    ``auto`` and the command line; dsbd refuses it."""
    recommender = target.with_draft("root")
    assert isinstance(recommender.draft, TargetPrior) and recommender.draft_names == ["root"]
    assert Recommender.load(trained_models / "target", draft_dir="root").draft_names == ["root"]
    trie = recommender.trie
    tokens = trie.first_tokens()
    fanout = len(tokens)
    shares = draft_log_q(TargetPriorDraft(recommender.draft), trie.root)[tokens].exp()
    torch.testing.assert_close(shares, torch.full_like(shares, 1 / fanout))

    def root_only(first: bool, remaining: int) -> tuple[int, ...]:
        return (fanout,) if first else ()

    examples = recommender.examples("test", 40)
    reference = recommender.recommend(examples, 10, "tree-beam", 16).topk
    for batch in (1, 16):
        decoded = recommender.recommend(examples, 10, "spec-strict", batch, DecodeOptions(planner=root_only))
        assert torch.equal(decoded.topk.items, reference.items), batch
        torch.testing.assert_close(decoded.topk.scores, reference.scores, atol=1e-4, rtol=0)
        assert bool((decoded.stats.target_calls == trie.depth - 1).all())
    auto = recommender.recommend(examples, 10, "auto", 8)
    assert auto.choice.startswith("auto: ") and torch.equal(auto.topk.items, reference.items), auto.choice
    with pytest.raises(RecspecError, match="dsbd"):
        recommender.recommend(examples, 5, "dsbd")
    out = tmp_path / "recs.jsonl"
    done = recspec("recommend", "--target", str(trained_models / "target"), "--out", str(out), "--decoder", "auto",
                   "--draft", "root", "--users", "40", "--k", "10", "--batch-size", "8")
    assert done.returncode == 0 and done.stdout.startswith("auto: "), done.stderr
    keys = recommender.index.item_keys
    assert [row["items"] for row in read_recs(out)] == [[keys[i] for i in row] for row in reference.items.tolist()]


def test_prior_folders_are_checked(target: Recommender, trained_models: Path, prior_dir: Path,
                                   tmp_path: Path) -> None:
    """A prior loads only for the target it was fitted on, with its checksums intact, alone; dsbd
    refuses it; bad options are refused before any work."""
    import shutil

    fingerprint = {"target_weights_sha256": "0" * 64}
    with pytest.raises(RecspecError, match="fitted for another target"):
        load_prior(prior_dir, fingerprint, target.trie)
    with pytest.raises(RecspecError, match="fitted for another target"):
        Recommender.load(trained_models / "draft", draft_dir=prior_dir)
    with pytest.raises(RecspecError, match="drafts alone"):
        target.with_draft(f"{trained_models / 'draft'}+{prior_dir}")
    with pytest.raises(RecspecError, match="dsbd"):
        target.with_draft(prior_dir).recommend(target.examples("test", 2), 5, "dsbd")
    damaged = tmp_path / "damaged"
    shutil.copytree(prior_dir, damaged)
    data = bytearray((damaged / PRIOR_WEIGHTS).read_bytes())
    data[-1] ^= 1
    (damaged / PRIOR_WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(RecspecError, match=PRIOR_WEIGHTS):
        target.with_draft(damaged)
    for args, message in ((("--users", "0"), "--users must be at least 1"),
                          (("--out", str(prior_dir / PRIOR_WEIGHTS)), "is a file")):
        options = {"--target": str(trained_models / "target"), "--out": str(tmp_path / "new"), **dict([args])}
        done = recspec("align", "prior", *[part for pair in options.items() for part in pair])
        assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not (tmp_path / "new").exists()
