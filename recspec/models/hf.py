"""Resolving and loading Hugging Face models: a cached asset by name, or any local model folder."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from recspec.assets import ASSETS, require
from recspec.errors import RecspecError
from recspec.models.small_rows import use_small_row_products


def resolve_model_dir(spec: str | Path) -> Path:
    """The folder of a model given by asset name (``smollm2``) or by path to a HF model folder."""
    path = Path(spec).expanduser()
    if str(spec) in ASSETS and not path.exists():
        return require(str(spec))
    if not (path / "config.json").is_file():
        raise RecspecError(f"model {spec!r}: not a cached asset ({', '.join(ASSETS)}) "
                           f"and not a Hugging Face model folder (no config.json)")
    return path


def load_tokenizer(spec: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(spec))


def load_base_model(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The transformer body without its LM head (for embeddings), in eval mode."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(resolve_model_dir(spec), dtype=dtype)
    return model.to(device).eval()


def load_causal_lm(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None):
    """A causal LM (with its LM head) by asset name or HF model folder, in eval mode; its linear
    layers compute a few rows through the fast CPU path (:mod:`recspec.models.small_rows`)."""
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(spec), dtype=dtype, **extra)
    return use_small_row_products(model.to(device).eval())


def keep_last_logits(model, count: int) -> dict[str, int]:
    """``{"logits_to_keep": count}`` where ``model.forward`` takes it (transformers' causal LMs
    then compute the output layer for the last ``count`` positions only), else ``{}``."""
    takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": count} if takes else {}
