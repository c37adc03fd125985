"""The distilled text draft (`recspec distill`) on the real SmolLM2: what it trains and shares,
its loss and acceptance against hand values, and a short run end to end (corpus, training,
resume, the draft usable by the speculative text decoders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recspec.errors import RecspecError
from recspec.align.distill import (BEST, CHECKPOINT, CORPUS, DistillConfig, acceptance, distill, forward_kl,
                                       trainable_draft)
from recspec.statefile import has_state

pytestmark = pytest.mark.usefixtures("one_thread")


def test_forward_kl_and_acceptance_by_hand() -> None:
    p = torch.tensor([[[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]]]).log()
    q = torch.tensor([[[0.25, 0.25, 0.5], [0.5, 0.5, 0.0]]]).log()
    real = torch.tensor([[True, False]])  # the second position is padding
    kl = 0.5 * torch.log(torch.tensor(2.0)) + 0.3 * torch.log(torch.tensor(1.2)) + 0.2 * torch.log(torch.tensor(0.4))
    torch.testing.assert_close(forward_kl(p, q, real), kl)
    torch.testing.assert_close(acceptance(p, q, real), torch.tensor([0.25 + 0.25 + 0.2]))
    torch.testing.assert_close(acceptance(p, p, real), torch.tensor([1.0]))
    assert float(forward_kl(p, p, real)) == pytest.approx(0.0, abs=1e-7)


def test_trainable_draft_copies_its_layers_and_shares_the_frozen_embeddings(smollm2_dir) -> None:
    from recspec.models.hf import load_causal_lm

    target = load_causal_lm(smollm2_dir)
    draft = trainable_draft(target, [0, 29])
    assert draft.config.num_hidden_layers == 2
    for mine, theirs in ((draft.model.layers[0], target.model.layers[0]), (draft.model.layers[1], target.model.layers[29]),
                         (draft.model.norm, target.model.norm)):
        for a, b in zip(mine.parameters(), theirs.parameters()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr() and a.requires_grad
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert not draft.model.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad
    trained = {name for name, p in draft.named_parameters() if p.requires_grad}
    assert trained and all(name.startswith(("model.layers.", "model.norm.")) for name in trained)


def test_distill_end_to_end_resumes_and_drafts(smollm2_dir, ml100k, tmp_path: Path) -> None:
    from recspec.decoding.text import TextOptions, generate
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    config = DistillConfig(prompts=16, max_new_tokens=6, epochs=1, batch_size=7, lr=1e-3, warmup_steps=1)
    stopped = distill(str(smollm2_dir), tmp_path, config, max_minutes=1e-6, progress=False)  # stops after a step
    assert stopped["stopped"] == "time budget" and has_state(tmp_path, CHECKPOINT)
    rows = [json.loads(line) for line in (tmp_path / CORPUS).read_text().splitlines()]
    assert len(rows) == 16 and all(1 <= len(row["response"]) <= 6 for row in rows)
    result = distill(str(smollm2_dir), tmp_path, config, progress=False)  # the rest, from the checkpoint
    history = result["history"]
    assert result["stopped"] == "epochs" and [row["epoch"] for row in history] == [0, 1, 1]
    assert history[1]["partial"] and not history[2]["partial"]
    assert result["best_acceptance"] == max(row["valid_acceptance"] for row in history[1:])
    assert result["best_acceptance"] > history[0]["valid_acceptance"]  # training moved the draft towards p
    with pytest.raises(RecspecError, match="other settings"):
        distill(str(smollm2_dir), tmp_path, DistillConfig(prompts=16, max_new_tokens=7), progress=False)

    target, tokenizer = load_causal_lm(smollm2_dir), load_tokenizer(smollm2_dir)
    draft = load_causal_lm(tmp_path / BEST)
    assert draft.config.num_hidden_layers == 2
    prompt = torch.tensor(rows[0]["prompt"])
    out = generate("spec-sample", target, draft, [prompt], TextOptions(max_new_tokens=8), tokenizer.pad_token_id,
                   tokenizer.eos_token_id)
    assert 1 <= len(out.tokens[0]) <= 8 and out.stats is not None
