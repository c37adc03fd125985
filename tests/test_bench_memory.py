"""Peak memory of a call, as the benchmarks measure it."""

from __future__ import annotations

import multiprocessing

import torch

from recspec.bench.memory import peak_memory, return_freed_memory


def _peaks_of_allocations() -> list[int]:
    """Peaks of a call that holds 12n KB at once and allocates 14n KB in all, for n = 2000, 8000,
    after a warm-up call (the first use of an operation sets up buffers of its own)."""
    return_freed_memory()

    def allocate(n: int) -> float:
        a = torch.ones(n, 1000)  # 4n KB
        b = torch.ones(2 * n, 1000)  # 8n KB: 12n KB held together
        del a
        c = torch.ones(n // 2, 1000)  # 2n KB, while b (8n KB) is held
        return float(b.sum() + c.sum())

    allocate(100)
    return [peak_memory(lambda: allocate(n)) for n in (2000, 8000)]


def test_peak_memory_follows_live_tensors() -> None:
    """In a process that returns freed memory (a worker of its own, as the benchmarks use), the peak
    of a call is what it holds at once: 24 MB, then 96 MB, not the 28 or 112 MB it allocates."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        small, large = pool.apply(_peaks_of_allocations)
    assert 23.5e6 <= small <= 26e6 and 95e6 <= large <= 98e6
