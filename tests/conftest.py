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
LONGEST_FIRST = ("test_cluster", "test_exactness_movielens", "test_serve_ray", "test_core_install", "test_text_head",
                 "test_exactness_beauty", "test_tree_sample", "test_serve", "test_llm_preset", "test_knowledge_decode",
                 "test_text_head_chain")


#: Fixtures that need fetched assets (MovieLens, SmolLM2) or the Beauty data: the tests that use
#: them are ``slow``, so that ``make test-fast`` (``-m "not slow"``) runs without any of them.
ASSET_FIXTURES = {"ml100k", "smollm2_dir", "trained_models", "beauty_dir", "beauty"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests using :data:`ASSET_FIXTURES` marked ``slow``; the longest files first
    (:data:`LONGEST_FIRST`), then the other files marked ``slow``, then
    the rest, each file's tests in their order: under ``make test`` (``-n auto --dist loadfile
    --no-loadscope-reorder``) each file goes to one worker in this order, so no long file is left
    for last to run alone for minutes while the other worker idles (xdist's own reordering, by
    the number of tests in a file, did exactly that)."""
    for item in items:  # a test that needs an asset needs it whether or not its file says so
        if ASSET_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
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


@pytest.fixture(scope="session")
def trained_models(ml100k, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft-tiny target and a weaker draft-tiny draft, trained on MovieLens-100K (leave-one-out)
    over identifiers made from the item number (three levels of 16), in ``target/`` and ``draft/``:
    trained once per test run for every module and xdist worker that uses them (in the run's
    common temporary folder, under a file lock). Modules take their own copy (``tests.test_serve.models``)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if shared.name.startswith("popen-gw") else shared  # xdist: the workers' common parent
    root = shared / "serve-models"
    with FileLock(str(shared / "serve-models.lock")):
        if not (root / "done").is_file():
            train_models(ml100k, root)
            (root / "done").touch()
    return root


def train_models(ml100k, root: Path) -> None:
    """The two models of :func:`trained_models`, trained into ``root`` (replaced if half-made)."""
    import shutil

    import numpy as np

    from recspec.fit import fit
    from recspec.itemids.index import ItemIndex
    from recspec.models.train import TrainConfig

    shutil.rmtree(root, ignore_errors=True)
    n = len(ml100k.item_ids)
    codes = np.stack([np.arange(n) // 256, (np.arange(n) // 16) % 16, np.arange(n) % 16], axis=1)
    ItemIndex.from_codes(ml100k.item_ids, codes).save(root / "ids" / "item_index.json")
    for name, examples, seed in (("target", 6000, 0), ("draft", 1500, 1)):
        config = TrainConfig(epochs=1, batch_size=128, lr=3e-3, warmup_steps=10, max_train_examples=examples,
                             seed=seed, precision="fp32")
        fit("ml-100k", root / name, "draft-tiny", ids=root / "ids", split_kind="loo", config=config,
            valid_users=32, progress=False)
