"""Device names a user may pass (``--device``): checked once, before any work."""

from __future__ import annotations

import torch

from recspec.errors import RecspecError


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA where present, else CPU) as a
    :class:`torch.device`; an unknown name, or CUDA on a machine without it, is one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RecspecError(f"unknown device {name!r}; choose cpu, cuda, cuda:N or auto") from None
    if device.type not in ("cpu", "cuda"):
        raise RecspecError(f"device {name!r} is not supported; choose cpu, cuda, cuda:N or auto")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RecspecError(f"device {name!r} asked for but CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RecspecError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
