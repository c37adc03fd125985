"""`recspec generate` on the real SmolLM2-135M-Instruct with MovieLens knowledge prompts, the
layer draft sharing the target's weights, and the command's bad-input errors (before loading)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recspec.errors import RecspecError
from recspec.models.layer_draft import layer_draft, parse_layers
from tests.test_cli import recspec


@pytest.mark.parametrize(("extra", "message"), [
    (["--decoder", "spec-sample", "--gamma", "0"], "gamma must be a positive integer"),
    (["--decoder", "sample", "--temperature", "0"], "temperature must be a positive number"),
    (["--decoder", "sample", "--top-p", "1.5"], r"top-p must lie in (0, 1]"),
    (["--decoder", "dsbd", "--beams", "3", "--draft-width", "2"], "draft width W_S=2 is below W_min=3"),
    (["--decoder", "dsbd", "--threshold", "1.5"], "threshold t must lie in [0, 1]"),
    (["--decoder", "dsbd", "--max-new-tokens", "2"], "gamma=2 is outside [1, 1]"),  # dsbd's own default gamma
    (["--decoder", "dsbd", "--max-new-tokens", "2", "--gamma", "3"], "gamma=3 is outside [1, 1]"),
    (["--decoder", "nucleus"], "unknown decoder"),
])
def test_generate_bad_input(tmp_path: Path, extra: list[str], message: str) -> None:
    result = recspec("generate", "--target", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "o.jsonl"),
                     *extra)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_layer_draft_shares_the_targets_weights() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    draft = layer_draft(model, parse_layers("0,3", 4))
    assert len(draft.model.layers) == 2
    assert draft.model.layers[1].mlp.up_proj.weight.data_ptr() == model.model.layers[3].mlp.up_proj.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    full = layer_draft(model, parse_layers("0-3", 4))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(full(input_ids=ids).logits, model(input_ids=ids).logits)
    for spec in ("0,0", "4", "a-b", ""):
        with pytest.raises(RecspecError, match="draft layers"):
            parse_layers(spec, 4)


@pytest.mark.slow
def test_generate_profiles_with_smollm2(smollm2_dir: Path, ml100k, tmp_path: Path) -> None:
    out = tmp_path / "profiles.jsonl"
    result = recspec("generate", "--decoder", "spec-sample", "--draft-layers", "0-1,29", "--count", "2",
                     "--max-new-tokens", "6", "--score", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(1 <= row["tokens"] <= 6 and row["log_likelihood"] < 0 for row in rows)
    assert "the movies the user watched most recently" in rows[0]["prompt"] and "accepted" in result.stdout


def test_method_is_a_deprecated_alias_of_decoder(tmp_path: Path) -> None:
    """`--method` (renamed `--decoder`) still works for one release, with one line saying so."""
    result = recspec("generate", "--target", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "o.jsonl"),
                     "--method", "nucleus")
    assert result.returncode == 2 and "unknown decoder 'nucleus'" in result.stderr, result.stderr
    assert "warning: --method is renamed --decoder" in result.stderr
