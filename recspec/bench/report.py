"""Shared benchmark plumbing: repeated timing (median), machine description, atomic JSON + Markdown
output and plots."""

from __future__ import annotations

import ctypes
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.errors import RecspecError
from recspec.extras import require_extra
from recspec.fileio import atomic_path, write_json_atomic, write_text_atomic


def reuse_freed_memory() -> None:
    """Make glibc keep freed large blocks for reuse instead of returning them to the OS.

    Decoders allocate large short-lived tensors every step; with glibc's defaults, blocks above
    the mmap threshold go back to the OS when freed and are faulted in again on the next step,
    which on a small VM costs seconds and makes timings erratic. Raising the mmap and trim
    thresholds (what jemalloc or tcmalloc do by default) applies to every decoder alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise RecspecError("mallopt failed; cannot set the allocator policy for benchmarks")


def timed(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; seconds per run and their median."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return {"median_s": statistics.median(runs), "runs_s": runs}


def matmul_gflops(size: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matrix-multiply throughput of this machine (GFLOP/s): the compute ceiling."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = timed(lambda: a @ b, repeats=repeats)["median_s"]
    return 2 * size**3 / seconds / 1e9


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def target_label(dataset: str, preset: str | None, folder: Path) -> str:
    """A target's name in result tables: ``dataset/preset``, and its folder's name where that
    differs from the preset (two models of one preset, such as two prompts, stay apart). ``folder``
    is the training folder or its ``best/``."""
    from recspec.models.checkpoint import BEST_DIR

    folder = Path(folder)
    name = folder.parent.name if folder.name == BEST_DIR else folder.name
    preset = preset or name
    return f"{dataset}/{preset}" + ("" if name == preset else f" ({name})")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out_dir: Path, name: str, results: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``name.json`` and ``name.md`` atomically into ``out_dir``."""
    results = {"benchmark": name, "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **results}
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    write_json_atomic(json_path, results)
    write_text_atomic(md_path, markdown.rstrip() + "\n")
    return json_path, md_path


def new_figure(**subplots: Any) -> tuple[Any, Any]:
    """An off-screen matplotlib figure and its axes (the Agg backend): ``plt.subplots(**subplots)``;
    the ``plot`` extra is required."""
    require_extra("plot", "a benchmark's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**subplots)


def save_figure(figure: Any, path: Path) -> None:
    """Lay out ``figure``, write it to ``path`` as a PNG atomically, and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=110, format="png")
    plt.close(figure)
