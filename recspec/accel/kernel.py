"""recspec's small-row product kernel (``kernel.cpp``): built once per machine, checked on use.

Neither of torch's CPU kernels streams a weight at the memory's speed for a few rows: MKL's
product over 1-2 rows and oneDNN's over packed weights over 3-6 rows read SmolLM2's weights well
below the speed of a read in order. ``kernel.cpp`` keeps each weight once in panels of
16 output columns and streams them in order, a 6 x 16 register tile of AVX2 fused multiply-adds per
group of rows, so a call's products over 1 to 6 rows cost what reading its weights costs.

The kernel is C++ compiled here against torch's headers and libraries (a C++ compiler is needed)
into ``$RECSPEC_CACHE/kernels/rows-<source digest>-<torch>/`` the first time a process asks for it
(:func:`build` or ``recspec assets kernel`` does it ahead), under a file lock so that parallel
processes build it once; only a model on the CPU that accel's policy gives small-row products
(:mod:`recspec.accel.policy`) asks for it. The folder's files are checksummed (``checksums.json``) and
checked before the library is loaded; a damaged build is made again. Where it cannot be built or
used (accel switched off, ``RECSPEC_ACCEL=0``; not Linux on x86-64 with AVX2 and FMA; no compiler; a
build error) :func:`available` says so once, with the reason, and recspec computes with torch's
kernels as before.

**What is trusted.** Loading the library runs its code in the process (a library's constructors
run as it is loaded), so recspec loads only a library no one but the running user could have put
or changed there. Trusted: the C++ source in the installed package, the compiler (``$CXX``), torch's
headers and libraries, and folders and files that the running user owns and nobody else may write.
Not trusted: a cache another user owns or can write (a cache shared between users, a group-writable
``$RECSPEC_CACHE``). ``checksums.json`` beside the library catches damage (a torn or altered build),
not a writer of the cache, who can rewrite the listing with the library. So, as ssh does for its
keys (:func:`distrust`), the library file, its folder and every folder up to the cache root must be
the running user's and writable by no group or other user, and the folders above the cache root the
user's or root's and, where others may write them, sticky (``/tmp``): no one else can then replace
any of them between the check and the load. Where that fails, the kernel is built privately for the
process (a fresh 0700 folder, removed once loaded) and a warning names the path and the reason,
once; where that build fails too, products run on torch's kernels. recspec writes its build
folders private (0700, files 0600) whatever the umask, so that no one can alter a build while it
is made.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from recspec.accel.policy import is_enabled, unfit
from recspec.assets import cache_dir
from recspec.errors import RecspecError
from recspec.fileio import atomic_dir, record_checksums, verify_checksums

SOURCE = Path(__file__).with_name("kernel.cpp")
LIBRARY = "recspec_rows"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
#: The longest a build may take (a build takes seconds) before it counts as failed.
COMPILE_TIMEOUT_S = 600


def build_dir() -> Path:
    """The folder the kernel is built into: one per source, flags and torch version."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"rows-{digest}-torch{torch.__version__.replace('+', '-')}"


def unsupported() -> str | None:
    """Why the kernel cannot serve on this machine, or None where it can be built: accel switched
    off or this CPU not one it serves (:func:`~recspec.accel.policy.unfit`), not Linux, or no C++
    compiler."""
    reason = unfit("cpu")
    if reason is not None:
        return reason
    if sys.platform != "linux":
        return f"it is built for Linux (this is {sys.platform})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


def distrust(path: Path, root: Path) -> str | None:
    """Why ``path`` (a file or folder inside ``root``) might hold what someone other than the
    running user put there, or None where it cannot: ``path`` and every folder from it up to
    ``root`` must be owned by the running user and writable by no group or other user, and every
    folder above ``root`` owned by the user or root and, where others may write it, sticky (as
    ``/tmp``), so that nobody else can alter or replace any of them (ssh's rule for its keys)."""
    uid = os.geteuid()
    path, root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if path != root and root not in path.parents:
        return f"{path} lies outside {root} (a symbolic link leads out)"
    for part in (path, *path.parents):
        info = os.lstat(part)
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISLNK(info.st_mode):
            return f"{part} became a symbolic link"
        if part == root or root in part.parents:
            if info.st_uid != uid:
                return f"{part} is owned by uid {info.st_uid}, not by this user (uid {uid})"
            if mode & 0o022:
                return f"{part} is writable by group or others (mode {mode:o}; `chmod go-w` it)"
        elif info.st_uid not in (uid, 0):
            return f"{part} is owned by uid {info.st_uid}, neither this user (uid {uid}) nor root"
        elif mode & 0o022 and not mode & stat.S_ISVTX:
            return f"{part} is writable by group or others and not sticky (mode {mode:o})"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed, in a folder that exists) for the block."""
    try:
        import fcntl  # POSIX only; imported here so that the module imports everywhere
    except ImportError:
        raise RecspecError(f"recspec's small-row kernel is not used: {unsupported() or 'no file locks here'}") from None
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def build() -> Path:
    """The kernel's shared library, loaded into ``torch.ops.recspec_rows`` (once per process): the
    cache's build (made once, under a lock, and checked against its checksums) where the cache is
    the running user's own (module doc), else one built privately for this process, with a
    warning naming the path and the reason; raises :class:`RecspecError` where it cannot be."""
    reason = unsupported()
    if reason is not None:
        raise RecspecError(f"recspec's small-row kernel is not used: {reason}")
    folder = build_dir()
    try:
        doubt = _load_cached(folder)
    except OSError as err:  # a cache that cannot be written (read-only) or a folder that went away
        doubt = f"{err.filename or folder}: {err.strerror}"
    if doubt is None:
        return folder / f"{LIBRARY}.so"
    library = _load_private(doubt)
    warnings.warn(f"{folder}: recspec's small-row kernel there is not loaded, as {doubt}; it was built privately "
                  f"for this process instead (a cache only you can write keeps one build)", stacklevel=2)
    return library


def _load_cached(folder: Path) -> str | None:
    """Load the cache's build in ``folder`` (built again when missing or damaged) where
    :func:`distrust` finds nothing against it; None once loaded, else why not."""
    root = cache_dir()
    missing = [part for part in (folder.parent, *folder.parent.parents) if not part.exists()]
    for part in reversed(missing):  # the cache root and kernels/ are made writable by their owner alone
        part.mkdir(mode=0o755, exist_ok=True)
    doubt = distrust(folder.parent, root)  # before the lock is taken there
    if doubt is not None:
        return doubt
    with _locked(folder.with_name(folder.name + ".lock")):
        if folder.is_dir():
            doubt = distrust(folder, root)  # a foreign build is neither checked nor removed
            if doubt is not None:
                return doubt
            try:
                verify_checksums(folder, "it is built again")
            except RecspecError as err:
                warnings.warn(f"{err}", stacklevel=3)
                shutil.rmtree(folder)
        if not folder.is_dir():
            with atomic_dir(folder, private=True) as tmp:
                _compile(tmp, folder)
                record_checksums(tmp)
        doubt = distrust(folder / f"{LIBRARY}.so", root)
        if doubt is None:
            _load(folder / f"{LIBRARY}.so")
    return doubt


def _load_private(doubt: str) -> Path:
    """Build the kernel into a fresh private folder (0700) and load it from there; the folder is
    removed once loaded (the process keeps the library mapped). ``doubt``: why the cache's build
    is not used, named in the error where this fails too."""
    private = Path(tempfile.mkdtemp(prefix="recspec-rows-"))
    library = private / f"{LIBRARY}.so"
    try:
        _compile(private, private)
        unsafe = distrust(library, private)
        if unsafe is not None:
            raise RecspecError(f"recspec's small-row kernel is not used: its private build is not safe ({unsafe})")
        _load(library)
    except RecspecError as err:
        raise RecspecError(f"{err} (the cache's build is not loaded, as {doubt})") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return library


def _load(library: Path) -> None:
    """Load ``library`` into ``torch.ops``; :class:`RecspecError` where it does not load."""
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as err:
        raise RecspecError(f"recspec's small-row kernel did not load: {str(err).splitlines()[0]}") from err


def _compile(folder: Path, shown: Path) -> None:
    """Compile :data:`SOURCE` into ``folder`` against the running torch's headers and libraries,
    saying so (the build ends up in ``shown``)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    print(f"recspec: building the small-row kernel into {shown} (about 10 s)", file=sys.stderr, flush=True)
    abi = int(torch.compiled_with_cxx11_abi())
    command = [os.environ.get("CXX", "c++"), *FLAGS, "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{path}" for path in include_paths()),
               str(SOURCE), "-o", str(folder / f"{LIBRARY}.so"),
               *(f"-L{path}" for path in library_paths()), "-lc10", "-ltorch_cpu"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise RecspecError(f"recspec's small-row kernel did not build within {COMPILE_TIMEOUT_S} s") from err
    if done.returncode != 0:
        first = next((line for line in done.stderr.splitlines() if "error" in line),
                     done.stderr.strip()[:200] or f"{command[0]} exited with status {done.returncode}")
        raise RecspecError(f"recspec's small-row kernel did not build: {first}")


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.recspec_rows`` computes small-row products in this process (built and
    loaded on the first call); where not, a warning says why, once."""
    try:
        build()
    except RecspecError as err:
        if is_enabled():
            warnings.warn(f"{err}; products run on torch's kernels", stacklevel=2)
        return False
    return True
