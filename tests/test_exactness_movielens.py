"""Exactness on trained MovieLens-100K models (leave-one-out) (the rules and the users checked:
tests/exactness.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recspec.itemids.collisions import collision_groups
from recspec.itemids.index import ItemIndex
from recspec.recommend import Recommender
from tests.exactness import MODELS, reference_or_trained
from tests.exactness import (beams, test_beam_decoders_equal_hf, test_strict_speculative_equals_beam,  # noqa: F401
                               test_strict_speculative_with_the_item_draft_equals_beam,  # noqa: F401
                               test_strict_speculative_with_a_target_prior_equals_beam,  # noqa: F401
                               test_exact_sampling_follows_beam_sampling)  # noqa: F401
from tests.test_cli import recspec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def built_ids(ml100k, smollm2_dir: Path, tmp_path_factory) -> Path:
    """MovieLens identifiers built by ``recspec ids build`` from the embeddings of SmolLM2 cut to
    its first 2 layers, given as ``--embedder`` (a model folder): the command's whole path on the
    real items at 2/30 of the default embedder's pass (the full pass would take a sixth of CI's
    test time on its worker); built once for this module's check and its models."""
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm
    from recspec.models.layer_draft import keep_first_layers

    root = tmp_path_factory.mktemp("built")
    model = load_causal_lm(smollm2_dir)
    keep_first_layers(model, 2)
    model.save_pretrained(root / "smollm2-2")
    load_tokenizer(smollm2_dir).save_pretrained(root / "smollm2-2")
    result = recspec("ids", "build", "--dataset", "ml-100k", "--out", str(root / "ids"), "--embedder",
                     str(root / "smollm2-2"))
    assert result.returncode == 0, result.stderr
    return root / "ids"


@pytest.fixture(scope="module")
def model(built_ids: Path, tmp_path_factory) -> Recommender:
    root = tmp_path_factory.mktemp("trained")
    ids = MODELS / "ml-ids" if (MODELS / "ml-ids" / "item_index.json").is_file() else built_ids
    recommender = reference_or_trained("ml", root, dataset_spec="ml-100k", ids=ids, split_kind="loo")
    assert len(recommender.examples("test")) == 943
    return recommender


def test_ids_build_on_movielens(ml100k, built_ids: Path) -> None:
    index = ItemIndex.load(built_ids / "item_index.json")
    stats = json.loads((built_ids / "stats.json").read_text())
    assert len(index) == 1682 and index.length == 3
    assert index.item_keys == ml100k.item_ids
    assert collision_groups(index.codes) == [] and stats["collisions_after"]["rate"] == 0
    assert stats["collisions_before"]["rate"] > 0 and stats["codebook_sizes"] == [32, 32, 32]
    # the output folder is refused a second time, and nothing is half-written
    again = recspec("ids", "build", "--dataset", "ml-100k", "--out", str(built_ids))
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert sorted(p.name for p in built_ids.parent.iterdir()) == ["ids", "smollm2-2"]
    # every MovieLens item has an identifier; the trie accepts them all
    trie = index.trie()
    assert (trie.items(trie.walk(torch.as_tensor(index.codes))) == torch.arange(1682)).all()
