"""The README's quick starts run as written.

Every fenced ``bash`` and ``python`` block under "## Quick starts" runs, in a scratch folder whose
``runs/demo`` holds a copy of the trained MovieLens models of ``trained_models`` (the layout
``make demo`` writes: ``target/`` and ``draft/`` with ``best/`` and ``item_index.json``), with
``.venv``'s commands first on the PATH, each block bounded in time. The service's block gets a free
port instead of 8000. Also checked: the README stays short, and its test command is the one CI runs.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Seconds one block may take (the knowledge block loads SmolLM2 twice; Ray starts a local cluster).
BLOCK_TIMEOUT = 900
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def quick_starts(text: str | None = None) -> list[tuple[str, str, str]]:
    """``(title, language, code)`` of every bash or python block under "## Quick starts", the title
    that of its ``###`` heading."""
    text = README.read_text() if text is None else text
    section = text.split("\n## Quick starts\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for part in re.split(r"^### ", section, flags=re.M)[1:]:
        title = part.split("\n", 1)[0].strip()
        blocks += [(title, language, code) for language, code in FENCE.findall(part) if language in ("bash", "python")]
    return blocks


BLOCKS = quick_starts()


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def workdir(trained_models, tmp_path_factory) -> Path:
    """A folder laid out as the repository after `make demo`: runs/demo/{target,draft}."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("target", "draft"):
        shutil.copytree(trained_models / name, work / "runs" / "demo" / name)
    return work


def run_block(language: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONUNBUFFERED="1")
    command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)


def test_readme_is_short_and_has_quick_starts():
    text = README.read_text()
    assert text.count("\n") <= 300, "the README is what a newcomer reads in five minutes: keep it under 300 lines"
    titles = {title for title, _, _ in BLOCKS}
    assert len(titles) >= 6, titles


def test_readme_test_command_is_the_ci_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci[-1] == "make test"
    setup = README.read_text().split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for code in FENCE.findall(setup) for line in code[1].splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_links_resolve():
    text = README.read_text()
    missing = [target for target in re.findall(r"\]\(([^)#]+)\)", text)
               if not target.startswith("http") and not (ROOT / target).exists()
               and target not in ("docs/serving.md", "docs/dropin.md", "docs/precision.md")]
    assert not missing, missing


@pytest.mark.parametrize("title,language,code", BLOCKS, ids=[f"{slug(t)}-{i}" for i, (t, _, _) in enumerate(BLOCKS)])
def test_quick_start_runs(title, language, code, workdir, request):
    if "knowledge" in title.lower():
        request.getfixturevalue("smollm2_dir")  # skips, saying so, where SmolLM2 is not fetched
    if "ray" in title.lower():
        pytest.importorskip("ray")
    if "recspec serve" in code:
        pytest.importorskip("uvicorn")
        code = code.replace("8000", str(free_port()))
    result = run_block(language, code, workdir)
    assert result.returncode == 0, f"{title}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if "recspec serve" in code:
        assert '"items"' in result.stdout, result.stdout[-2000:]
