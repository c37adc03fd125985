"""recspec's small-row product kernel (``row_kernel.cpp``): built once per machine, checked on use.

On this project's CPU neither of torch's kernels streams a weight at the memory's speed for a few
rows: MKL's product over 1-2 rows reads SmolLM2's weights at 28-31 GB/s and oneDNN's over packed
weights at 20-25 GB/s over 3-6 rows, where a read in order reaches 31-51 GB/s as the host's memory
allows (BENCHMARKS.md "A small-row kernel"). ``row_kernel.cpp`` keeps each weight once in panels of
16 output columns and streams them in order, a 6 x 16 register tile of AVX2 fused multiply-adds per
group of rows, so a call's products over 1 to 6 rows cost what reading its weights costs.

The kernel is C++ compiled here against torch's headers and libraries (a C++ compiler is needed)
into ``$RECSPEC_CACHE/kernels/rows-<source digest>-<torch>/`` the first time a process asks for it
(about 10 seconds; :func:`build` or ``recspec assets kernel`` does it ahead), under a file lock so
that parallel processes build it once. The folder's files are
checksummed (``checksums.json``) and checked before the library is loaded; a damaged build is made
again. Where it cannot be built or used (not x86-64 with AVX2 and FMA, no compiler, a build error,
or ``RECSPEC_ROW_KERNEL=0``) :func:`available` says so once, with the reason, and recspec computes
with torch's kernels as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from recspec.assets import cache_dir
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, record_checksums, verify_checksums

SOURCE = Path(__file__).with_name("row_kernel.cpp")
LIBRARY = "recspec_rows"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
#: Set to 0 to compute with torch's kernels only.
SWITCH = "RECSPEC_ROW_KERNEL"
#: The longest a build may take (it takes about 10 s here) before it counts as failed.
COMPILE_TIMEOUT_S = 600


def build_dir() -> Path:
    """The folder the kernel is built into: one per source, flags and torch version."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"rows-{digest}-torch{torch.__version__.replace('+', '-')}"


def unsupported() -> str | None:
    """Why the kernel cannot serve on this machine, or None where it can be built."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it is built for Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build() -> Path:
    """The kernel's shared library, built (once, under a lock) and checked against its checksums,
    then loaded into ``torch.ops.recspec_rows``; raises :class:`RecspecError` where it cannot be."""
    reason = unsupported()
    if reason is not None:
        raise RecspecError(f"recspec's small-row kernel is not used: {reason}")
    folder = build_dir()
    library = folder / f"{LIBRARY}.so"
    with _locked(folder.with_name(folder.name + ".lock")):
        if folder.is_dir():
            try:
                verify_checksums(folder, "it is built again")
            except RecspecError as err:
                warnings.warn(f"{err}", stacklevel=2)
                shutil.rmtree(folder)
        if not folder.is_dir():
            _compile(folder)
        try:
            torch.ops.load_library(str(library))
        except (OSError, RuntimeError) as err:
            raise RecspecError(f"recspec's small-row kernel did not load: {str(err).splitlines()[0]}") from err
    return library


def _compile(folder: Path) -> None:
    """Compile :data:`SOURCE` into ``folder`` (atomically, with checksums), against the running
    torch's headers and libraries."""
    from torch.utils.cpp_extension import include_paths, library_paths

    print(f"recspec: building the small-row kernel into {folder} (once, about 10 s)", file=sys.stderr, flush=True)
    abi = int(torch.compiled_with_cxx11_abi())
    with atomic_dir(folder) as tmp:
        command = [os.environ.get("CXX", "c++"), *FLAGS, "-std=c++17", "-shared", "-fPIC",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{path}" for path in include_paths()),
                   str(SOURCE), "-o", str(tmp / f"{LIBRARY}.so"),
                   *(f"-L{path}" for path in library_paths()), "-lc10", "-ltorch_cpu"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            raise RecspecError(f"recspec's small-row kernel did not build within {COMPILE_TIMEOUT_S} s") from err
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
            raise RecspecError(f"recspec's small-row kernel did not build: {first}")
        record_checksums(tmp)


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.recspec_rows`` computes small-row products in this process (built and
    loaded on the first call); where not, a warning says why, once."""
    try:
        build()
    except RecspecError as err:
        if os.environ.get(SWITCH, "1") != "0":
            warnings.warn(f"{err}; products run on torch's kernels", stacklevel=2)
        return False
    return True
