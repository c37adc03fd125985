"""Shared fixtures: the real data sets (Beauty from ../shared, MovieLens and SmolLM2 from the asset cache)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

BEAUTY_DIR = Path(os.environ.get("RECSPEC_BEAUTY_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"
                                 / "amazon-beauty"))


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker gets its share of the cores, for torch here and for the ``recspec``
    sub-processes the tests start (``OMP_NUM_THREADS``): torch's default of one thread per core
    in every worker oversubscribes the machine, and spinning OpenMP threads then slow every
    worker several times over."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


#: The longest test files, longest first (per-file durations of `make test` on a 2-core CPU: about
#: 360 s down to 60 s each); they start first, the other files fill in after them.
LONGEST_FIRST = ("test_cluster", "test_exactness_movielens", "test_serve_ray", "test_text_head",
                 "test_exactness_beauty", "test_tree_sample", "test_serve", "test_llm_preset", "test_knowledge_decode",
                 "test_text_head_chain")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (:data:`LONGEST_FIRST`), then the other files marked ``slow``, then
    the rest, each file's tests in their order: under ``make test`` (``-n auto --dist loadfile
    --no-loadscope-reorder``) each file goes to one worker in this order, so no long file is left
    for last to run alone for minutes while the other worker idles (xdist's own reordering, by
    the number of tests in a file, did exactly that)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> tuple[int, bool]:
        return rank.get(item.path.stem, len(rank)), item.get_closest_marker("slow") is None

    items.sort(key=order)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny
    models run as fast on one, and far less hurt by other processes on a small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def beauty_dir() -> Path:
    if not (BEAUTY_DIR / "sequential_train.txt").is_file():
        pytest.skip(f"the Amazon Beauty data is not at {BEAUTY_DIR} (set RECSPEC_BEAUTY_DIR); CI always has it")
    return BEAUTY_DIR


@pytest.fixture(scope="session")
def beauty(beauty_dir):
    from recspec.data import load_dataset

    return load_dataset(beauty_dir)


def _require_asset(name: str) -> Path:
    from recspec.assets import require
    from recspec.errors import RecspecError

    try:
        return require(name)
    except RecspecError as err:
        pytest.skip(f"{err} (make test fetches it)")


@pytest.fixture(scope="session")
def ml100k():
    from recspec.data import load_dataset

    _require_asset("ml-100k")
    return load_dataset("ml-100k")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return _require_asset("smollm2")
