"""Item text to embeddings: mean-pooled last hidden states of a Hugging Face model.

Embeddings are cached under ``$RECSPEC_CACHE/embeddings/<key>.npy`` where the key hashes the
model folder's identity (its asset manifest or config), the pooling settings and the texts, so
the same items are embedded once. Beside each array, ``<key>.json`` (written after it, atomically)
records its sha256, size, shape and dtype; an entry without a record, one that does not match it
(truncated, zeroed, altered), or one that holds non-finite values or the wrong number of rows is
ignored and rebuilt (overwritten), never used. Arrays are plain float32 (numpy refuses object arrays on load).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from recspec.assets import MANIFEST, cache_dir
from recspec.errors import RecspecError
from recspec.fileio import atomic_path, read_json, write_json_atomic
from recspec.hub import load_base_model, load_tokenizer, resolve_model_dir


def _model_identity(model_dir: Path) -> str:
    """What names the model in a cache key: the sha256 of its asset manifest (which lists the
    sha256 of every file) or of its config, else its resolved path."""
    for name in (MANIFEST, "config.json"):
        if (model_dir / name).is_file():
            return _sha256((model_dir / name).read_bytes())
    return str(model_dir.resolve())


def read_cached(cache_file: Path, rows: int) -> np.ndarray | None:
    """The float32 ``[rows, hidden]`` array cached in ``cache_file`` if it is intact, else None.

    Intact: the bytes have the size and sha256 its ``.json`` record gives, parse as a plain
    ``.npy`` of plain numbers of the recorded shape and dtype, with ``rows`` rows and finite values.
    The bytes are read once, so what is hashed is what is parsed.
    """
    try:
        record = read_json(cache_file.with_suffix(".json"))
        data = cache_file.read_bytes()
    except (RecspecError, OSError):
        return None
    if not isinstance(record, dict) or len(data) != record.get("size") or _sha256(data) != record.get("sha256"):
        return None
    try:
        array = np.load(io.BytesIO(data))  # object arrays are refused by default
    except (OSError, ValueError, EOFError):
        return None
    if (not isinstance(array, np.ndarray) or array.dtype != np.float32 or record.get("dtype") != "float32"
            or array.ndim != 2 or list(array.shape) != record.get("shape") or array.shape[0] != rows
            or not np.isfinite(array).all()):
        return None
    return array


def write_cached(cache_file: Path, array: np.ndarray) -> None:
    """Cache ``array`` in ``cache_file`` (atomically), then, atomically too, its record
    ``<key>.json``: sha256, size, shape and dtype of the bytes written."""
    buffer = io.BytesIO()
    np.save(buffer, array.astype(np.float32, copy=False))
    data = buffer.getvalue()
    with atomic_path(cache_file) as tmp:
        tmp.write_bytes(data)
    write_json_atomic(cache_file.with_suffix(".json"), {"sha256": _sha256(data), "size": len(data),
                                                        "shape": list(array.shape), "dtype": str(array.dtype)})


def _sha256(data: bytes) -> str:
    """Hex sha256 digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


@torch.inference_mode()
def mean_pooled(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the last hidden states over real tokens.

    input_ids, attention_mask: [B, T] -> float32 [B, hidden].
    """
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return ((hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)).float()


def embed_texts(texts: Sequence[str], model: str | Path = "smollm2", batch_size: int = 32, max_length: int = 64,
                device: str | torch.device = "cpu", use_cache: bool = True, progress: bool = True) -> np.ndarray:
    """Embed ``texts`` with a HF model: float32 [len(texts), hidden]. Cached on disk when ``use_cache``."""
    model_dir = resolve_model_dir(model)
    key = hashlib.sha256(json.dumps([_model_identity(model_dir), max_length, "mean", list(texts)]).encode()).hexdigest()
    cache_file = cache_dir() / "embeddings" / f"{key[:32]}.npy"
    cached = read_cached(cache_file, len(texts)) if use_cache else None
    if cached is not None:
        return cached
    tokenizer = load_tokenizer(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    encoder = load_base_model(model_dir, device=device)
    # sort by length so batches pad little; restore the order at the end
    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.empty((len(texts), encoder.config.hidden_size), dtype=np.float32)
    batches = range(0, len(texts), batch_size)
    for start in tqdm(batches, desc="embedding items", unit="batch", disable=not progress):
        index = order[start:start + batch_size]
        batch = tokenizer([texts[i] for i in index], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt").to(device)
        out[index] = mean_pooled(encoder, batch["input_ids"], batch["attention_mask"]).cpu().numpy()
    if use_cache:
        write_cached(cache_file, out)
    return out
