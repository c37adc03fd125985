"""`benchmarks/before_after.py` runs each command under the tree it is given, even when started
from the repository root (where ``python -c`` would put this checkout first on the path)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.before_after import run_cli


def test_worker_imports_the_tree_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the repository root, which holds another recspec
    tree, marker = tmp_path / "old", tmp_path / "seen.json"
    (tree / "recspec").mkdir(parents=True)
    (tree / "recspec" / "__init__.py").write_text("")
    (tree / "recspec" / "cli.py").write_text(
        "import json, sys\nfrom pathlib import Path\nimport recspec\n\n\ndef main():\n"
        f"    Path({str(marker)!r}).write_text(json.dumps([recspec.__file__, sys.argv[1:]]))\n")
    args = argparse.Namespace(target="T", k=10, batch_size=16, users=8, draft="model:D", threads=1)
    run_cli(tree, args, "recommend", "--decoder", "beam")
    imported, argv = json.loads(marker.read_text())
    assert Path(imported).resolve() == (tree / "recspec" / "__init__.py").resolve()
    assert argv == ["recommend", "--decoder", "beam", "--target", "T", "--k", "10", "--batch-size", "16",
                    "--users", "8", "--draft", "model:D"]
