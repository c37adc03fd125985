"""Per-model measurements on this machine, taken once and kept beside the model: the call cost
``F + r * n`` (:class:`~recspec.decoding.cost.CallCost`) that draft trees and ``--decoder auto``
are sized from.

The record lives in the model folder as ``calibration-<device>.json``: the cost, what it was
measured for (the sha256 of the weights, the device, torch's thread count, the prompt length) and
the sha256 of the record itself. It is used only when all of that matches and the digest checks
out; otherwise the cost is measured again and the record rewritten (atomically). A folder that
cannot be written to still works: the cost is then measured in every process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from recspec.decoding.cost import CallCost, measure_cost_model
from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS, read_json, sha256_file, write_json_atomic

WEIGHTS = "model.safetensors"


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 of the folder's weights: from its ``checksums.json`` where recspec wrote one (the
    loader has checked it), else hashed here."""
    listing = model_dir / CHECKSUMS
    if listing.is_file():
        entry = read_json(listing).get("files", {}).get(WEIGHTS)
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    return sha256_file(model_dir / WEIGHTS)


def calibration_path(model_dir: Path, device: torch.device) -> Path:
    return model_dir / f"calibration-{device.type}.json"


def _digest(record: dict[str, Any]) -> str:
    body = {key: value for key, value in record.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def call_cost(model, model_dir: str | Path, prompt_len: int, repeats: int = 10,
              remeasure: bool = False) -> CallCost:
    """The call cost of ``model`` (loaded from ``model_dir``) on its device for prompts of about
    ``prompt_len`` tokens: the kept record where it matches (see the module doc), else measured
    now (:func:`~recspec.decoding.cost.measure_cost_model`) and kept."""
    model_dir = Path(model_dir)
    device = next(model.parameters()).device
    path = calibration_path(model_dir, device)
    key = {"weights_sha256": weights_fingerprint(model_dir), "device": str(device),
           "threads": torch.get_num_threads(), "prompt_len": int(prompt_len)}
    if not remeasure and path.is_file():
        try:
            record = read_json(path)
        except RecspecError:  # a damaged record is measured again, never trusted
            record = None
        if (isinstance(record, dict) and record.get("sha256") == _digest(record)
                and all(record.get(name) == value for name, value in key.items())):
            return CallCost.from_json(record["cost"])
    cost = measure_cost_model(model, prompt_len, repeats)
    record = {**key, "cost": cost.to_json()}
    record["sha256"] = _digest(record)
    try:
        write_json_atomic(path, record)
    except OSError:  # a read-only model folder: measured again in the next process
        pass
    return cost
