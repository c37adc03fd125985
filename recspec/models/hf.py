"""Loading causal LMs for decoding: any HF causal LM by asset name or model folder, accelerated for
its device under accel's policy (:mod:`recspec.accel`)."""

from __future__ import annotations

from pathlib import Path

import torch

from recspec.accel import accelerate
from recspec.hub import check_finite_weights, loading_errors, resolve_model_dir


def load_causal_lm(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None):
    """A causal LM (with its LM head) by asset name or HF model folder on ``device``, in eval mode,
    accelerated for it (:func:`~recspec.accel.accelerate`: on the CPU, an LLM-sized model's linear
    layers compute a few rows through recspec's small-row products with sibling projections as one
    product, a small Llama's calls run through the lean forward, and grouped-query attention over
    several rows packs the query heads)."""
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    folder = resolve_model_dir(spec)
    with loading_errors(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False, **extra)
    check_finite_weights(model, folder)
    return accelerate(model.to(device).eval(), device)
