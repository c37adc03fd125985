"""Hugging Face helpers every layer may use: resolving a model (a cached asset by name, or any
local model folder, its checksums checked), loading tokenizers and bodies with one-line errors,
and the transformer call options recspec relies on (``logits_to_keep``, the KV cache's keyword). Causal LMs for
decoding are loaded by :func:`recspec.models.hf.load_causal_lm`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from recspec.assets import ASSETS, require
from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS, verify_checksums


def resolve_model_dir(spec: str | Path) -> Path:
    """The folder of a model given by asset name (``smollm2``) or by path to a HF model folder."""
    path = Path(spec).expanduser()
    if str(spec) in ASSETS and not path.exists():
        return require(str(spec))
    if not (path / "config.json").is_file():
        raise RecspecError(f"model {spec!r}: not a cached asset ({', '.join(ASSETS)}) "
                           f"and not a Hugging Face model folder (no config.json)")
    if (path / CHECKSUMS).is_file():  # a folder recspec wrote (e.g. `recspec distill`'s best/)
        verify_checksums(path, "the model folder is damaged; make it again or restore it from a copy")
    return path


@contextlib.contextmanager
def loading_errors(folder: Path) -> Iterator[None]:
    """Turn what transformers raises on a damaged or mismatched model folder (a config cut short,
    a truncated safetensors file, weights of another shape) into one line naming the folder."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, json.JSONDecodeError, SafetensorError) as err:
        detail = " ".join(str(err).split())[:200]
        raise RecspecError(f"{folder}: cannot load the model ({detail}); the folder is damaged or not a model "
                           f"of this kind") from None


def check_finite_weights(model: torch.nn.Module, folder: Path) -> None:
    """Refuse a model with a NaN or infinite weight (damaged weights decode to garbage)."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RecspecError(f"{folder}: weight {name} holds NaN or infinite values; the model file is damaged")


def load_tokenizer(spec: str | Path):
    from transformers import AutoTokenizer

    folder = resolve_model_dir(spec)
    with loading_errors(folder):
        return AutoTokenizer.from_pretrained(folder)


def load_base_model(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The transformer body without its LM head (for embeddings), in eval mode."""
    from transformers import AutoModel

    folder = resolve_model_dir(spec)
    with loading_errors(folder):
        model = AutoModel.from_pretrained(folder, dtype=dtype)
    check_finite_weights(model, folder)
    return model.to(device).eval()


def forward_parameters(model) -> frozenset[str]:
    """The names ``model.forward`` takes: read once per forward function (a signature costs about
    20 us, and every decoding call asks for it)."""
    forward = model.forward
    return _signature_names(getattr(forward, "__func__", forward))


@functools.cache
def _signature_names(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def keep_logits_at(model, keep: int | torch.Tensor) -> dict[str, int | torch.Tensor]:
    """``{"logits_to_keep": keep}`` where ``model.forward`` takes it, else ``{}`` (all positions'
    logits). ``keep``: a count of last positions, or int64 ``[n]``, the positions whose logits
    every row needs (the output layer then runs for those alone: logits ``[b, n, V]``)."""
    return {"logits_to_keep": keep} if "logits_to_keep" in forward_parameters(model) else {}


def with_cache(model, cache) -> dict[str, object]:
    """The keyword argument that hands ``model.forward`` its KV cache ``cache``: ``{"cache":
    cache}`` where forward takes ``cache`` (transformers 5.24 on, which deprecates
    ``past_key_values`` and drops it in 5.40; a model that no longer knows the old name would
    take it into its ``**kwargs`` and run without its cache, saying nothing), else
    ``{"past_key_values": cache}`` where it takes that (transformers 5.0-5.23). A model whose
    forward takes neither is a :class:`RecspecError`."""
    parameters = forward_parameters(model)
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return {name: cache}
    raise RecspecError(f"{type(model).__name__}.forward takes no KV cache (neither `cache` nor `past_key_values`); "
                       f"recspec's decoders need a transformers 5 causal LM")


def returned_cache(out):
    """The KV cache a forward returned: ``out.cache`` (transformers 5.24 on), else
    ``out.past_key_values``."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache
