"""The small-row kernel is loaded only from a cache that is the running user's own
(:func:`recspec.accel.kernel.distrust`): a foreign library planted in a cache that others own
or can write, with its ``checksums.json`` rewritten to match, never runs; recspec builds the kernel
privately instead, or falls back to torch's kernels, and says so once. A cache that is the user's
own is trusted, whatever the umask it was made under."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from recspec.fileio import record_checksums
from recspec.accel.kernel import LIBRARY, build_dir, distrust, unsupported

pytestmark = pytest.mark.skipif(unsupported() is not None or shutil.which("gcc") is None,
                                reason=f"the small-row kernel cannot be built here: {unsupported() or 'no gcc'}")

PRIVATE_NOTE = "it was built privately for this process instead"
FALLBACK_NOTE = "products run on torch's kernels"
LOAD = "from recspec.accel.kernel import available; print(available())"
FOREIGN_SOURCE = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("foreign code ran", marker); fclose(marker); }
}
"""


def run_python(code: str, cache: Path, tmp: Path, umask: int | None = None, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``$RECSPEC_CACHE`` at ``cache`` and ``$TMPDIR`` at
    ``tmp`` (so that a private build's folder can be seen to go), under ``umask`` when given."""
    tmp.mkdir(mode=0o700, exist_ok=True)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RECSPEC_CACHE": str(cache), "TMPDIR": str(tmp), **env},
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))


@pytest.fixture
def foreign(tmp_path: Path) -> tuple[Path, Path]:
    """A shared library whose constructor writes ``marker`` when it is loaded (what an attacker
    would plant), and ``marker``; checked live: loading it with ctypes writes the marker."""
    marker, source, library = tmp_path / "foreign-code-ran", tmp_path / "foreign.c", tmp_path / "foreign.so"
    source.write_text(FOREIGN_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(library)], check=True)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(library)!r})"], check=True)
    assert marker.read_text() == "foreign code ran"
    marker.unlink()
    return library, marker


def plant(library: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``library`` put where the kernel's build lives in ``cache``, with ``checksums.json``
    rewritten to match it (what a writer of a shared cache can do); the build folder."""
    monkeypatch.setenv("RECSPEC_CACHE", str(cache))
    folder = build_dir()
    folder.mkdir(parents=True, mode=0o755)
    shutil.copyfile(library, folder / f"{LIBRARY}.so")
    record_checksums(folder)
    return folder


def writable_kernels(folder: Path) -> None:
    os.chmod(folder.parent, 0o777)


def owned_by_nobody(folder: Path) -> None:
    for path in (folder, *folder.iterdir()):
        os.chown(path, 65534, 65534)


def writable_library(folder: Path) -> None:
    os.chmod(folder / f"{LIBRARY}.so", 0o666)


@pytest.mark.parametrize("spoil, compiler, built", [(writable_kernels, "c++", True), (owned_by_nobody, "false", False),
                                                    (writable_library, "false", False)],
                         ids=["kernels-writable-by-others", "build-owned-by-another-uid", "library-writable-by-others"])
def test_a_foreign_library_in_a_cache_others_can_write_never_runs(
        foreign: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        spoil: Callable[[Path], None], compiler: str, built: bool) -> None:
    """The planted library passes its (rewritten) checksums but sits where another user could have
    put it: it is never loaded; recspec builds the kernel privately (and removes that build once
    loaded) or, where that build fails too (``CXX=false``), falls back to torch's kernels; either
    way one warning names the path and the reason, and the planted build is left as it was."""
    library, marker = foreign
    folder = plant(library, tmp_path / "cache", monkeypatch)
    spoil(folder)
    result = run_python(LOAD, tmp_path / "cache", tmp_path / "tmp", CXX=compiler)
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), "the foreign library was loaded"
    assert result.stdout.split() == [str(built)]
    note = PRIVATE_NOTE if built else FALLBACK_NOTE
    assert result.stderr.count(note) == 1 and result.stderr.count("is not loaded, as") == 1, result.stderr
    reason = "owned by uid 65534" if spoil is owned_by_nobody else "writable by group or others"
    assert reason in result.stderr and str(folder) in result.stderr, result.stderr
    assert (folder / f"{LIBRARY}.so").read_bytes() == library.read_bytes()
    assert not list((tmp_path / "tmp").iterdir()), "the private build is removed once loaded"


def test_a_cache_of_ones_own_loads_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache made under a group-writable umask (002): the build folder is private (0700,
    files 0600) whatever the umask, the cache folders writable by their owner only; the next
    process loads it without building and without a warning."""
    cache = tmp_path / "cache"
    first = run_python(LOAD, cache, tmp_path / "tmp", umask=0o002)
    assert first.returncode == 0 and first.stdout.split() == ["True"], first.stderr
    assert "building the small-row kernel" in first.stderr and "not loaded" not in first.stderr
    monkeypatch.setenv("RECSPEC_CACHE", str(cache))
    folder = build_dir()
    assert {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()} == \
        {f"{LIBRARY}.so": 0o600, "checksums.json": 0o600}
    assert folder.stat().st_mode & 0o777 == 0o700 and not cache.stat().st_mode & 0o022
    assert distrust(folder / f"{LIBRARY}.so", cache) is None
    again = run_python(LOAD, cache, tmp_path / "tmp", umask=0o002)
    assert again.returncode == 0 and again.stdout.split() == ["True"], again.stderr
    assert "building" not in again.stderr and "warn" not in again.stderr.lower(), again.stderr


def test_distrust_names_what_others_could_change(tmp_path: Path) -> None:
    """The rule itself: the user's own folders and files pass; one writable by others, owned by
    another uid, or reached through a symbolic link that leads out of the root, is named."""
    root = tmp_path / "root"
    (root / "inner").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    library = root / "inner" / "lib.so"
    library.write_bytes(b"\0")
    os.chmod(library, 0o644)
    assert distrust(library, root) is None
    os.chmod(root, 0o775)
    assert distrust(library, root) == f"{root} is writable by group or others (mode 775; `chmod go-w` it)"
    os.chmod(root, 0o755)
    os.chown(root / "inner", 65534, 0)
    assert distrust(library, root) == f"{root / 'inner'} is owned by uid 65534, not by this user (uid {os.geteuid()})"
    os.chown(root / "inner", os.geteuid(), 0)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    (root / "link").symlink_to(outside)
    assert "lies outside" in distrust(root / "link", root)
