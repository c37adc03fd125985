"""Peak memory of one call: CUDA allocator statistics on a GPU, the process's peak resident set on
a CPU.

On a CPU, PyTorch keeps no allocator statistics, so :func:`peak_memory` measures the growth of the
process's peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``) above its
resident size before the call. That is only the call's own peak when freed memory goes back to the
operating system at once: call :func:`return_freed_memory` first, in a process of its own (the
timing benchmarks do the opposite, :func:`~recspec.bench.report.reuse_freed_memory`), which is why
benchmarks measure memory in a separate worker process.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from recspec.errors import RecspecError

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def return_freed_memory() -> None:
    """Make glibc serve every allocation above 64 KiB by its own mapping and unmap it when freed,
    so the resident set follows live memory (Linux + glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        raise RecspecError("peak CPU memory needs glibc (Linux)") from None
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 64 << 10) and libc.mallopt(m_trim_threshold, 64 << 10)):
        raise RecspecError("mallopt failed; cannot set the allocator policy for memory measurement")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RecspecError(f"/proc/self/status has no {field}; peak CPU memory needs Linux")


def peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Bytes ``fn()`` needs at its peak beyond what is allocated before it runs."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = _status_kib("VmRSS")
    _CLEAR_REFS.write_text("5")  # reset VmHWM to the current resident size
    fn()
    return max(0, _status_kib("VmHWM") - base) * 1024
