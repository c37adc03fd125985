"""Exactness on trained Amazon Beauty models (the rules and the users checked: tests/exactness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recspec.recommend import Recommender
from tests.exactness import reference_or_trained
from tests.exactness import (beams, test_beam_decoders_equal_hf, test_strict_speculative_equals_beam,  # noqa: F401
                               test_strict_speculative_with_the_item_draft_equals_beam,  # noqa: F401
                               test_strict_speculative_with_a_target_prior_equals_beam,  # noqa: F401
                               test_exact_sampling_follows_beam_sampling)  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model(beauty_dir: Path, tmp_path_factory) -> Recommender:
    recommender = reference_or_trained("beauty", tmp_path_factory.mktemp("trained"), dataset_spec=str(beauty_dir))
    assert len(recommender.examples("test")) == 3553
    return recommender

