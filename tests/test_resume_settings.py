"""A resumed training continues only the run it was started as: `fit`, `align train` and a head
refuse a checkpoint trained with another preset, split, history cap, item identifiers or alignment
method, name what differs, and leave the folder as it was; the same settings resume (a head's
folder too: its checkpoint is a state pair, not a ``checkpoint/`` folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recspec.align.train import align_fit, head_fit
from recspec.errors import RecspecError
from recspec.fit import fit
from recspec.itemids.index import ItemIndex
from recspec.models.train import TrainConfig
from tests.test_align import alignment_data, small_target  # noqa: F401  (fixtures)
from tests.test_recommend_cli import small_data  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = TrainConfig(epochs=1, batch_size=32, lr=0.01, warmup_steps=1, precision="fp32")


def recorded(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.json"))}


def test_fit_refuses_to_resume_a_run_trained_otherwise(small_data, tmp_path: Path) -> None:  # noqa: F811
    data, ids = small_data
    out = tmp_path / "run"
    fit(str(data), out, "draft-tiny", ids=ids, split_kind="loo", config=TINY, valid_users=8, progress=False)
    before = recorded(out)
    assert {"run.json", "item_index.json"} <= before.keys()
    index = ItemIndex.load(ids / "item_index.json")
    swapped = tmp_path / "swapped"  # the same items, two of them with each other's identifiers
    ItemIndex(index.item_keys, [index.identifiers[1], index.identifiers[0], *index.identifiers[2:]]).save(
        swapped / "item_index.json")
    cases = [({"preset": "target-mini"}, "preset: 'draft-tiny' -> 'target-mini'"),
             ({"split_kind": "time"}, "split: 'loo' -> 'time'"),
             ({"max_history": 5}, "max_history: 20 -> 5"),
             ({"ids": swapped}, "item_index.json: other item identifiers")]
    for change, shown in cases:
        arguments = {"preset": "draft-tiny", "ids": ids, "split_kind": "loo", **change}
        preset = arguments.pop("preset")
        with pytest.raises(RecspecError, match="holds a run trained otherwise") as refused:
            fit(str(data), out, preset, config=TINY, valid_users=8, progress=False, **arguments)
        assert shown in str(refused.value)
        assert recorded(out) == before, f"{change}: the refused resume rewrote the run's records"
    again = fit(str(data), out, "draft-tiny", ids=ids, split_kind="loo", config=TINY, valid_users=8, progress=False)
    assert again.stopped == "epochs" and recorded(out) == before


def test_drafts_and_heads_refuse_to_resume_another_alignment(small_target, alignment_data: Path,  # noqa: F811
                                                            tmp_path: Path) -> None:
    target_dir, _ = small_target
    align_fit(alignment_data, tmp_path / "draft", "sft", config=TINY, progress=False)
    before = recorded(tmp_path / "draft")
    with pytest.raises(RecspecError, match="holds a run trained otherwise.*'method': 'sft'.*'method': 'seqkd'"):
        align_fit(alignment_data, tmp_path / "draft", "seqkd", config=TINY, progress=False)
    assert recorded(tmp_path / "draft") == before
    assert align_fit(alignment_data, tmp_path / "draft", "sft", config=TINY, progress=False).stopped == "epochs"

    options = {"config": TINY, "eval_users": 4, "eval_k": 3, "eval_beams": 6, "progress": False}
    head_fit(alignment_data, target_dir, tmp_path / "head", "sft", **options)
    before = recorded(tmp_path / "head")
    with pytest.raises(RecspecError, match="a head trained otherwise.*'alpha': 0.5.*'alpha': 0.3"):
        head_fit(alignment_data, target_dir, tmp_path / "head", "atspeed-s", alpha=0.3, **options)
    assert recorded(tmp_path / "head") == before
    assert head_fit(alignment_data, target_dir, tmp_path / "head", "sft", **options).stopped == "epochs"
