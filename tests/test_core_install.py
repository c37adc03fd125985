"""The core install: a fresh virtual environment with ``pip install recspec`` alone (no extra)
runs the transformers drop-in and ``recspec.load(...).recommend(...)`` on a trained folder, with
the answers of the full install, and ``recspec serve`` there says in one line which extra to
install. The environment is made by pip from the package registry (torch from the same release
as this one), as a user would make it."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from recspec.extras import EXTRAS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

#: Run inside the core environment: the drop-in's items and the API's answer, as JSON on stdout.
PROBE = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import recspec
from recspec.hf import trie_beam_search
from recspec.serve.schemas import RecommendRequest

target = sys.argv[1]
model = recspec.load(target, decoder="tree-beam", device="cpu", threads=1)
[answer] = model.recommend([["1", "2", "3"]], k=5)
folder = target + "/best"
tokenizer = AutoTokenizer.from_pretrained(folder)
lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
prompt = model.service.parse(RecommendRequest(history=["1", "2", "3"], k=5)).prompt.tolist()
inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
out = lm.generate(**inputs, custom_generate=trie_beam_search(target + "/item_index.json", tokenizer,
                  decoder="tree-beam"), num_beams=5, num_return_sequences=5, max_new_tokens=8)
print(json.dumps({"items": answer.items, "scores": answer.scores, "dropin": out[:, len(prompt):].tolist()}))
"""


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True, timeout=1500)


@pytest.fixture(scope="module")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh environment holding recspec's core install and nothing else."""
    folder = tmp_path_factory.mktemp("core-venv")
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    pip(python, f"torch=={torch.__version__.split('+')[0]}")  # the CPU build, as scripts/setup.sh pins it
    pip(python, str(REPO))
    return python


def probe(python: Path, target: Path) -> dict:
    run = subprocess.run([str(python), "-c", PROBE, str(target)], capture_output=True, text=True, timeout=600,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_core_install_has_no_extra(core_python: Path) -> None:
    found = subprocess.run([str(core_python), "-c", "import importlib.util, sys; print(' '.join(m for m in "
                            "sys.argv[1:] if importlib.util.find_spec(m)))",
                            *(m for modules in EXTRAS.values() for m in modules)],
                           capture_output=True, text=True, check=True)
    assert found.stdout.split() == []


def test_core_install_recommends_as_the_full_one(core_python: Path, trained_models: Path) -> None:
    target = trained_models / "target"
    assert probe(core_python, target) == probe(Path(sys.executable), target)


def test_core_install_names_the_missing_extra(core_python: Path, trained_models: Path) -> None:
    run = subprocess.run([str(core_python.parent / "recspec"), "serve", "--target", str(trained_models / "target")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == "error: recspec serve needs recspec's 'serve' extra: pip install 'recspec[serve]'"
