"""On trained models, for every test user of Amazon Beauty and MovieLens-100K (leave-one-out):
`beam` and `tree-beam` return what `hf` returns (K in {1, 5, 10, 20}), and strict speculative
beam search returns what `beam` returns (K in {1, 3, 5, 10, 20}, several N and gamma).

The models: the reference models of ``scripts/train_models.sh`` when ``$RECSPEC_MODELS`` (default
``runs/models``) holds them (``target-small`` and ``draft-tiny``, 20 minutes of training at most
each), else two ``draft-tiny`` trained here on the real training data, the target on 60,000
examples and the draft on 20,000 with another seed (a minute or two each), so CI checks trained
models too. Trained models, unlike random ones, leave identifier tokens they never saw nearly
indistinguishable, so near-ties occur: a user passes when the three decoders return

* the same items in the same order with scores within 1e-4; or
* the same items with scores within 1e-4 position by position, the order differing only among
  scores that close (the tie rule, README); or
* different items at the edge of the top-K where our beam search's own margin (the smallest gap
  between a kept and a dropped candidate at any step, ``TopK.margin``) is below ``TIE_GAP``: a
  comparison that float32 noise (HF batches ``B * K`` rows, we do not) can decide either way.

Anything else fails. At least 99% of users must match in the first, strict sense.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from recspec.decoding import TopK, beam_search, hf_beam_search, tree_beam_search
from recspec.decoding.speculative import SpecConfig, speculative_beam_search
from recspec.models.fit import fit
from recspec.models.train import TrainConfig
from recspec.recommend import Recommender

KS = (1, 5, 10, 20)
SPEC_KS = (1, 3, 5, 10, 20)
SCORE_ATOL = 1e-4
TIE_GAP = 1e-5
MODELS = Path(os.environ.get("RECSPEC_MODELS", Path(__file__).resolve().parents[1] / "runs" / "models"))
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def reference_or_trained(name: str, tmp_root: Path, **fit_args) -> Recommender:
    """The reference ``{name}-target`` / ``{name}-draft`` pair if present, else two draft-tiny
    models trained here (see the module doc)."""
    target, draft = MODELS / f"{name}-target", MODELS / f"{name}-draft"
    if (target / "best" / "model.safetensors").is_file() and (draft / "best" / "model.safetensors").is_file():
        return Recommender.load(target, draft_dir=draft)
    target, draft = tmp_root / f"{name}-target", tmp_root / f"{name}-draft"
    for out, examples, seed in ((target, 60_000, 0), (draft, 20_000, 1)):
        config = TrainConfig(epochs=1, batch_size=256, lr=3e-3, warmup_steps=50, threads=2,
                             max_train_examples=examples, seed=seed)
        fit(out_dir=out, preset="draft-tiny", config=config, valid_users=64, progress=False, **fit_args)
    return Recommender.load(target, draft_dir=draft)


@pytest.fixture(scope="module")
def beauty_model(beauty_dir: Path, tmp_path_factory) -> Recommender:
    return reference_or_trained("beauty", tmp_path_factory.mktemp("trained"), dataset_spec=str(beauty_dir))


@pytest.fixture(scope="module")
def movielens_model(ml100k, smollm2_dir: Path, tmp_path_factory) -> Recommender:
    root = tmp_path_factory.mktemp("trained")
    ids = MODELS / "ml-ids"
    if not (ids / "item_index.json").is_file():
        from recspec.itemids.build import build_identifiers, write_identifiers

        index, stats = build_identifiers(ml100k, progress=False)
        write_identifiers(root / "ml-ids", index, stats)
        ids = root / "ml-ids"
    return reference_or_trained("ml", root, dataset_spec="ml-100k", ids=ids, split_kind="loo")


def classify(ours: TopK, ref: TopK, margin: torch.Tensor) -> dict[str, list[int]]:
    """Users of ``ours`` vs ``ref`` by kind of agreement (see the module doc; ``margin``: our beam
    search's, ``[B]``); ``"differ"`` lists the users that no rule explains."""
    same_order = (ours.items == ref.items).all(1)
    close = ((ours.scores - ref.scores).abs() <= SCORE_ATOL).all(1)
    same_set = (ours.items.sort(1).values == ref.items.sort(1).values).all(1)
    near_tie = margin < TIE_GAP
    kinds = {
        "exact": same_order & close,
        "reordered ties": ~same_order & same_set & close,
        "edge near-tie": ~(same_set & close) & near_tie,
    }
    kinds["differ"] = ~(kinds["exact"] | kinds["reordered ties"] | kinds["edge near-tie"])
    return {kind: mask.nonzero().flatten().tolist() for kind, mask in kinds.items()}


def assert_agree(name: str, ours: TopK, reference: TopK, margin: torch.Tensor, users) -> None:
    kinds = classify(ours, reference, margin)
    shown = [int(users[i]) for i in kinds["differ"][:5]]
    assert not kinds["differ"], (f"{name}: {len(kinds['differ'])} of {len(users)} users differ beyond near-ties, "
                                 f"e.g. dataset users {shown}")
    assert len(kinds["exact"]) >= 0.99 * len(users), (name, {kind: len(v) for kind, v in kinds.items()})


def check_beam_decoders(recommender: Recommender) -> None:
    examples = recommender.examples("test")
    args = (recommender.model, recommender.encoder.prompts(examples), recommender.trie)
    pad = recommender.encoder.pad_id
    for k in KS:
        reference = hf_beam_search(*args, k, pad, batch_size=128)
        for decode in (beam_search, tree_beam_search):
            ours = decode(*args, k, pad, batch_size=256)
            assert_agree(f"{decode.__name__} vs hf, K={k}", ours, reference, ours.margin, examples.users)


def check_strict_speculative(recommender: Recommender) -> None:
    examples = recommender.examples("test")
    args = (recommender.model, recommender.draft, recommender.encoder.prompts(examples), recommender.trie)
    pad = recommender.encoder.pad_id
    for i, k in enumerate(SPEC_KS):  # the default N and gamma, and a narrow one-level draft, in turn
        n, gamma = ((max(40, k), None), (2 * k, 1))[i % 2]
        reference = beam_search(recommender.model, args[2], recommender.trie, k, pad, batch_size=256)
        result = speculative_beam_search(*args, k, pad, SpecConfig(draft_beams=n, gamma=gamma), batch_size=64)
        assert_agree(f"spec-strict N={n} gamma={gamma} vs beam, K={k}", result.topk, reference,
                     reference.margin, examples.users)


def test_beauty_every_test_user(beauty_model: Recommender) -> None:
    assert len(beauty_model.examples("test")) == 3553
    check_beam_decoders(beauty_model)
    check_strict_speculative(beauty_model)


def test_movielens_every_test_user(movielens_model: Recommender) -> None:
    assert len(movielens_model.examples("test")) == 943
    check_beam_decoders(movielens_model)
    check_strict_speculative(movielens_model)
