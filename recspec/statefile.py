"""Training state (optimizer moments, schedules, RNG, counters) as safetensors plus JSON.

A checkpoint must never be a serialized Python object (``torch.save``'s format): loading one runs
whatever code the file names, so a file planted in an output folder would run on resume. ``save_state(folder, name, state)`` splits a
nested state (dicts, lists, tuples, tensors, numbers, strings, ``None``; the shape of
``optimizer.state_dict()``, ``scheduler.state_dict()`` and ``torch.get_rng_state()``) into
``name.safetensors`` (every tensor, by its path in the state) and ``name.json`` (everything else,
tensors replaced by references, and the sha256 of the tensor file). ``load_state`` checks that
sha256, then rebuilds the state exactly: integer dict keys stay integers (the optimizer's parameter ids), tuples stay tuples,
non-finite floats survive.

A folder holding a state in the old object format (``*.pt``) is refused with one line; it is
never opened.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from recspec.errors import RecspecError
from recspec.fileio import atomic_path, read_json, sha256_file, write_json_atomic

FORMAT = "recspec-state/1"


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: _encode(v, f"{path}.{key}", tensors) for key, v in value.items()}
        if not all(isinstance(key, (str, int)) and not isinstance(key, bool) for key in value):
            raise TypeError(f"state at {path or 'root'}: dict keys must be str or int")
        return {"__items__": [[key, _encode(v, f"{path}.{key}", tensors)] for key, v in value.items()]}
    raise TypeError(f"state at {path or 'root'}: cannot store a {type(value).__name__}")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {key: _decode(v, tensors) for key, v in value["__items__"]}
    return {key: _decode(v, tensors) for key, v in value.items()}


def state_files(folder: Path, name: str) -> tuple[Path, Path]:
    """The two files of state ``name`` in ``folder``: (tensors, JSON)."""
    return Path(folder) / f"{name}.safetensors", Path(folder) / f"{name}.json"


def has_state(folder: Path, name: str) -> bool:
    """Whether ``folder`` holds state ``name`` (its JSON half; a missing tensor file is damage)."""
    return state_files(folder, name)[1].is_file()


OBJECT_FILES = ("*.pt", "*.pth", "*.pkl", "*.bin")  # torch.save and other serialized-object formats


def refuse_object_files(folder: Path, remedy: str) -> None:
    """Refuse a folder holding a serialized-object state (``*.pt``, ``*.pth``, ``*.pkl``, ``*.bin``):
    recspec never loads one, since loading it could run code."""
    found = sorted(p.name for pattern in OBJECT_FILES for p in Path(folder).glob(pattern))
    if found:
        raise RecspecError(f"{Path(folder) / found[0]}: a serialized Python object, which recspec never loads (it "
                           f"could run code); {remedy}")


def changed_settings(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """The settings of ``now`` that a resumed run recorded otherwise in ``before``, as ``"key: old ->
    new, ..."`` (empty when none; a key only one of them records is not compared)."""
    return ", ".join(f"{key}: {before[key]!r} -> {value!r}" for key, value in now.items()
                     if key in before and before[key] != value)


def save_state(folder: Path, name: str, state: dict[str, Any]) -> None:
    """Write ``state`` as ``folder/name.safetensors`` + ``folder/name.json`` (each atomically; the
    JSON, written last, records the tensor file's sha256, so a torn pair is detected on load)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    tensor_path, json_path = state_files(folder, name)
    with atomic_path(tensor_path) as tmp:
        save_file(tensors, str(tmp))
    write_json_atomic(json_path, {"format": FORMAT, "tensors": {"file": tensor_path.name,
                                                                "sha256": sha256_file(tensor_path)},
                                  "state": tree}, indent=None)


def load_state(folder: Path, name: str, remedy: str) -> dict[str, Any]:
    """The state written by :func:`save_state`; a missing, altered or unreadable file gives one
    line naming it and ending with ``remedy``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensor_path, json_path = state_files(folder, name)
    saved = read_json(json_path)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or "state" not in saved:
        raise RecspecError(f"{json_path}: not a recspec state file ({FORMAT}); {remedy}")
    if not tensor_path.is_file():
        raise RecspecError(f"{tensor_path}: missing; {remedy}")
    if sha256_file(tensor_path) != saved.get("tensors", {}).get("sha256"):
        raise RecspecError(f"{tensor_path}: damaged (its sha256 differs from {json_path.name}); {remedy}")
    try:
        tensors = load_file(str(tensor_path))
        return _decode(saved["state"], tensors)
    except (SafetensorError, KeyError, ValueError, TypeError) as err:
        raise RecspecError(f"{tensor_path}: unreadable state ({err}); {remedy}") from None
