"""Loading causal LMs for decoding: any HF causal LM by asset name or model folder, its linear
layers on the fast small-row CPU path, its grouped-query attention packed over several rows."""

from __future__ import annotations

from pathlib import Path

import torch

from recspec.hub import check_finite_weights, loading_errors, resolve_model_dir
from recspec.models.attention import use_packed_attention
from recspec.models.fused_projections import use_fused_projections
from recspec.models.small_rows import use_small_row_products


def load_causal_lm(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None):
    """A causal LM (with its LM head) by asset name or HF model folder, in eval mode; its linear
    layers compute a few rows through the fast CPU path (:mod:`recspec.models.small_rows`), sibling
    projections of one input as one product (:mod:`recspec.models.fused_projections`), and its
    grouped-query attention over several rows packs the query heads (:mod:`recspec.models.attention`)."""
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    folder = resolve_model_dir(spec)
    with loading_errors(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False, **extra)
    check_finite_weights(model, folder)
    return use_packed_attention(use_fused_projections(use_small_row_products(model.to(device).eval())))
