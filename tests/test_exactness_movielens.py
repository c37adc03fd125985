"""Exactness on trained MovieLens-100K models (leave-one-out) (the rules and the users checked:
tests/exactness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recspec.recommend import Recommender
from tests.exactness import MODELS, reference_or_trained
from tests.exactness import beams, test_beam_decoders_equal_hf, test_strict_speculative_equals_beam  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model(ml100k, smollm2_dir: Path, tmp_path_factory) -> Recommender:
    root = tmp_path_factory.mktemp("trained")
    ids = MODELS / "ml-ids"
    if not (ids / "item_index.json").is_file():
        from recspec.itemids.build import build_identifiers, write_identifiers

        index, stats = build_identifiers(ml100k, progress=False)
        write_identifiers(root / "ml-ids", index, stats)
        ids = root / "ml-ids"
    recommender = reference_or_trained("ml", root, dataset_spec="ml-100k", ids=ids, split_kind="loo")
    assert len(recommender.examples("test")) == 943
    return recommender

