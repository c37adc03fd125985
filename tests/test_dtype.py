"""16-bit models end to end (recspec.precision): ``--dtype`` / ``--draft-dtype`` refused in one line
where they cannot work, before any weight is read; ``auto`` is float32 on a CPU; a bfloat16 target
and draft load and decode on the CPU (transformers' forward: accel stays float32-only); and strict
speculative search returns exactly what ``tree-beam`` returns in bfloat16 wherever the target's
scores are not tied within the dtype's rounding (:func:`recspec.precision.tie_bound`), on trained
models over many users."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import recspec
from benchmarks.agreement16 import identifier_logit_magnitude
from recspec.accel.policy import accelerate, call_shape, unfit
from recspec.accel.lean_forward import LeanOutput, forward_of
from recspec.errors import RecspecError
from recspec.models.checkpoint import load_trained, trained_model_dir
from recspec.precision import check_name, resolve_dtype, resolve_pair, saved_dtype, text_precisions, tie_bound, ulp
from recspec.recommend import Recommender, folder_precisions

pytestmark = pytest.mark.usefixtures("one_thread")

#: Test users of the strict = tree-beam check (MovieLens has 943), and its K values.
USERS = 400
SPEC_KS = (1, 5, 10)
K = 10


def test_names_and_refusals_before_any_work(trained_models, tmp_path) -> None:
    target, draft = trained_models / "target", trained_models / "draft"
    with pytest.raises(RecspecError, match=r"--dtype 'bf16': choose auto, float32, bfloat16, float16"):
        check_name("bf16")
    with pytest.raises(RecspecError, match=r"--draft-dtype float32: the draft \(items\) runs in the target's dtype "
                                           r"\(bfloat16\); only a draft model takes --draft-dtype"):
        Recommender.load(target, draft_dir="items", dtype="bfloat16", draft_dtype="float32")
    with pytest.raises(RecspecError, match="no draft model is loaded"):
        Recommender.load(target, dtype="float32", draft_dtype="bfloat16")
    with pytest.raises(RecspecError, match=r"the draft \(the target's layers\) runs in the target's dtype"):
        text_precisions("float32", "bfloat16", "cpu", target / "best", drafted=True)
    # the same dtype as the target's, or a draft model in its own, is fine
    assert resolve_pair("bfloat16", "bfloat16", "cpu", target, tied="items").draft.dtype == torch.bfloat16
    pair = resolve_pair("bfloat16", "float32", "cpu", target, draft)
    assert (pair.target.dtype, pair.draft.dtype) == (torch.bfloat16, torch.float32)
    # the command line: one line, status 2, nothing written
    out = tmp_path / "recs.jsonl"
    for options, message in ((["--dtype", "half"], "error: --dtype 'half': choose auto, float32, bfloat16, float16"),
                             (["--draft", "items", "--decoder", "spec-strict", "--draft-dtype", "float16"],
                              "error: --draft-dtype float16: the draft (items) runs in the target's dtype (float32)")):
        command = ["recommend", "--target", str(target), "--out", str(out), "--users", "2", "--device", "cpu"]
        run = subprocess.run([sys.executable, "-m", "recspec.cli", *command, *options], capture_output=True, text=True)
        assert run.returncode == 2 and run.stderr.strip().startswith(message), run.stderr
        assert not out.exists()


def test_auto_is_float32_on_a_cpu_and_reads_the_saved_dtype(trained_models, tmp_path) -> None:
    target = trained_models / "target"
    assert saved_dtype(target, trained_model_dir) == torch.float32  # a training folder: its best/ is read
    chosen = resolve_dtype("auto", "cpu", target)
    assert chosen.dtype == torch.float32 and "float32-only" in chosen.note and not chosen.shown
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    assert saved_dtype(tmp_path) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", tmp_path).dtype == torch.float32  # the CPU keeps float32 whatever was saved
    assert resolve_dtype("bfloat16", "cpu", tmp_path).dtype == torch.bfloat16
    # on CUDA, auto keeps the saved dtype (float32 here; no GPU is needed to resolve it)
    chosen = resolve_dtype("auto", "cuda", target, checked=trained_model_dir)
    assert chosen.dtype == torch.float32 and "the dtype it was saved in" in chosen.note and chosen.shown


def test_a_tampered_config_is_refused_before_its_dtype_is_used(trained_models, tmp_path) -> None:
    """``auto`` on CUDA reads the saved dtype from a model folder its loader has checked: a
    config.json edited after its checksums were recorded is refused, never read for its dtype
    (the CPU does not read it here at all; its load refuses it)."""
    target = tmp_path / "target"
    shutil.copytree(trained_models / "target", target)
    config = target / "best" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "dtype": "bfloat16"}))
    damaged = r"config\.json: damaged \(its sha256 differs from checksums\.json\)"
    with pytest.raises(RecspecError, match=damaged):
        saved_dtype(target, trained_model_dir)
    with pytest.raises(RecspecError, match=damaged):
        resolve_dtype("auto", "cuda", target, checked=trained_model_dir)
    with pytest.raises(RecspecError, match=damaged):
        folder_precisions("auto", None, "cuda", target, [], [], None)
    assert folder_precisions("auto", None, "cpu", target, [], [], None).target.dtype == torch.float32
    with pytest.raises(RecspecError, match=damaged):
        Recommender.load(target, folder_only=True)


def test_accel_stays_float32_only(trained_models) -> None:
    """A bfloat16 model gets none of accel's speed-ups (transformers' own forward, no padded rows),
    where the same model in float32 gets the lean forward; a float32 model accelerated and then
    cast to bfloat16 falls back to transformers' forward (what a bfloat16 load computes, up to
    rounding: the cast model keeps accel's packed attention)."""
    full, _ = load_trained(trained_models / "target")
    half, _ = load_trained(trained_models / "target", dtype=torch.bfloat16)
    assert unfit(None, full) is None and forward_of(full) is not full
    assert half.dtype == torch.bfloat16 and unfit(None, half) == "its parameters are not all float32"
    assert forward_of(half) is half and call_shape(half).padded is False
    assert accelerate(half, "cpu") is half and forward_of(half) is half  # asked again: still nothing
    cast = full.to(torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 17, 3], [1, 6, 8, 40, 3]])
    with torch.no_grad():
        out, expected = forward_of(cast)(input_ids=ids), half(input_ids=ids).logits.float()
    assert not isinstance(out, LeanOutput)  # transformers' forward answered
    assert torch.allclose(out.logits.float(), expected, atol=4 * ulp(torch.bfloat16, float(expected.abs().max())))


def test_bfloat16_loads_and_decodes_on_the_cpu(trained_models) -> None:
    """Target and draft in bfloat16: every decoder's answers are real, distinct items with finite,
    non-increasing scores; they are float32's items for nearly every user (rounding reorders only
    near-ties); the API and the command say and take the dtype."""
    target, draft = trained_models / "target", trained_models / "draft"
    half = Recommender.load(target, draft_dir=f"model:{draft}", dtype="bfloat16")
    full = Recommender.load(target, draft_dir=f"model:{draft}", dtype="float32")
    assert half.model.dtype == half.draft.dtype == torch.bfloat16 and full.model.dtype == torch.float32
    examples = half.examples("test", 64)
    reference = full.recommend(examples, K, "tree-beam").topk
    for decoder in ("hf", "beam", "tree-beam", "spec-strict"):
        topk = half.recommend(examples, K, decoder).topk
        assert bool((topk.items >= 0).all()) and bool(topk.scores.isfinite().all())
        assert bool((topk.scores[:, 1:] <= topk.scores[:, :-1]).all())
        assert all(len(set(row)) == K for row in topk.items.tolist())
        overlap = (topk.items[:, :, None] == reference.items[:, None, :]).any(2).float().mean()
        assert overlap > 0.9, (decoder, overlap)
    mixed = Recommender.load(target, draft_dir=f"model:{draft}", dtype="bfloat16", draft_dtype="float32")
    assert (mixed.model.dtype, mixed.draft.dtype) == (torch.bfloat16, torch.float32)
    model = recspec.load(target, draft=f"model:{draft}", decoder="tree-beam", device="cpu", dtype="bfloat16")
    assert model.dtype == "bfloat16" and model.notes == []  # an explicit dtype needs no note
    history = [half.encoder.item_keys[i] for i in examples.history_of(0)]
    [answer] = model.recommend([history], k=K)
    assert len(answer.items) == K and all(score == score for score in answer.scores)


@pytest.mark.parametrize("k", SPEC_KS)
def test_strict_equals_tree_beam_in_bfloat16(trained_models, k) -> None:
    """On trained models in bfloat16, ``spec-strict`` returns ``tree-beam``'s items in the same
    order for nearly every user, and every user that differs is a near-tie: its margin (the
    smaller of the two searches') is within the rounding bound. Where a margin exceeds the bound
    (the target's scores decide, not its rounding) the answers are identical, scores within the
    bound. (These small trained models leave few or no users decided in bfloat16: their
    candidates are closer than bfloat16 resolves, docs/precision.md.)"""
    target, draft = trained_models / "target", trained_models / "draft"
    recommender = Recommender.load(target, draft_dir=f"model:{draft}", dtype="bfloat16")
    examples = recommender.examples("test", USERS)
    tree = recommender.recommend(examples, k, "tree-beam", 16).topk
    strict = recommender.recommend(examples, k, "spec-strict", 16).topk
    magnitude = identifier_logit_magnitude(recommender, recommender.encoder.prompts(examples), tree)
    bound = tie_bound(torch.bfloat16, magnitude, recommender.trie.depth)
    decided = (tree.margin > bound) & (strict.margin > bound)
    same = (strict.items == tree.items).all(1)
    assert bool(same[decided].all()), decided.logical_and(~same).nonzero().flatten().tolist()
    gaps = (strict.scores - tree.scores)[decided].abs()
    assert gaps.numel() == 0 or float(gaps.max()) <= bound
    assert bool((torch.minimum(tree.margin, strict.margin)[~same] <= bound).all())
    assert float(same.float().mean()) >= 0.9, float(same.float().mean())  # rounding moves the edge of few lists
