"""`recspec import` (and recspec's own loaders) on hostile or broken model folders: a folder that
asks for its own code to be run (refused before transformers could offer to run it, even when
standard input answers ``y``), safetensors that do not hold the model config.json describes (a
layer or an untied head missing, another vocabulary, absurd sizes such as a million layers:
refused before any weight is read or allocated, where transformers would fill the gaps with
random weights), malformed configs and tokenizers, and a folder recspec trained itself. Each is
one line (exit status 2 on the command line, no traceback) and nothing is written to --out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from recspec.fileio import CHECKSUMS
from recspec.hub import check_weights_fit, load_tokenizer
from recspec.importer import peer_parts
from recspec.itemids.index import ItemIndex
from recspec.models.checkpoint import BEST_DIR, INDEX_FILE, WEIGHTS_FILE, load_safetensors_lm, load_trained
from recspec.models.examples import TextTemplate
from recspec.models.tokenizer import RECSPEC_JSON, extend_llm_tokenizer
from tests.test_cli import recspec
from tests.test_import import LC_REC_PROMPT, copy_peer, peer_model, refused, save_peer, spec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, beauty_dir: Path) -> Path:
    """A tiny random Llama (two layers, tied embeddings) over SmolLM2's tokenizer extended with the
    identifier tokens of Beauty's released index, as LC-Rec leaves it: a folder that imports."""
    root = tmp_path_factory.mktemp("hostile")
    tokenizer = extend_llm_tokenizer(smollm2_dir, ItemIndex.load(beauty_dir / INDEX_FILE))
    return save_peer(root / "peer", peer_model(tokenizer, 0, 16, 2), tokenizer, root / "pickle-ran")


def edit_json(path: Path, **changes: object) -> None:
    """Update the JSON object in ``path`` with ``changes``."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def one_error_line(result: subprocess.CompletedProcess, needle: str) -> None:
    """A refused command: exit status 2 and one ``error:`` line holding ``needle``, no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle in lines[0], lines[0]


def import_args(model: Path, out: Path, beauty_dir: Path) -> list[str]:
    return ["import", "--model", str(model), "--index", str(beauty_dir / INDEX_FILE), "--dataset", str(beauty_dir),
            "--prompt-template", LC_REC_PROMPT, "--out", str(out)]


def plant_code(folder: Path, module: str, marker: Path) -> None:
    """``folder/module.py``, which creates ``marker`` when anything imports it (the payload)."""
    (folder / f"{module}.py").write_text(f"from pathlib import Path\n\nPath({str(marker)!r}).touch()\n")


def test_remote_code_is_never_offered_nor_run(peer: Path, beauty_dir: Path, tmp_path: Path) -> None:
    """A tokenizer and a model whose auto_map points at code planted in the folder: the real
    command line, its standard input answering ``y``, refuses each in one line before
    transformers reads the folder (so it never asks), and no planted code runs; recspec's loaders
    refuse them too, as they refuse a tokenizer or model class transformers does not have."""
    marker = tmp_path / "remote-code-ran"
    tokenizer = copy_peer(peer, tmp_path / "evil-tokenizer")
    plant_code(tokenizer, "tokenization_evil", marker)
    edit_json(tokenizer / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
              auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    model = copy_peer(peer, tmp_path / "evil-model", {
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}})
    for module in ("configuration_evil", "modeling_evil"):
        plant_code(model, module, marker)
    command = Path(sys.executable).parent / "recspec"
    for folder, file in ((tokenizer, "tokenizer_config.json"), (model, "config.json")):
        out = tmp_path / f"out-{folder.name}"
        result = subprocess.run([str(command), *import_args(folder, out, beauty_dir)], input="y\n",
                                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        one_error_line(result, f"{folder / file}: its auto_map points at code in the model folder")
        assert "custom code" not in result.stdout + result.stderr  # transformers never asked
        assert not out.exists() and not marker.exists()
    with refused("its auto_map points at code"):
        load_tokenizer(tokenizer)
    with refused("its auto_map points at code"):
        load_safetensors_lm(model)
    for name, config, shown in (("custom-tokenizer", {"tokenizer_class": "EvilTokenizer"}, "EvilTokenizer"),
                                ("model-as-tokenizer", {"tokenizer_class": "LlamaForCausalLM"}, "LlamaForCausalLM"),
                                ("custom-model", {"architectures": ["EvilForCausalLM"]}, "EvilForCausalLM")):
        with refused(f"'{shown}' named in its config.json / tokenizer_config.json is not a model or tokenizer class"):
            peer_parts(spec(copy_peer(peer, tmp_path / name, config), beauty_dir / INDEX_FILE, beauty_dir))
    assert not marker.exists()


def without_norm(folder: Path) -> None:
    """Take the final norm's weight out of ``folder``'s safetensors."""
    weights = load_file(folder / WEIGHTS_FILE)
    del weights["model.norm.weight"]
    save_file(weights, folder / WEIGHTS_FILE, metadata={"format": "pt"})


@pytest.mark.parametrize(("config", "error"), [
    ({"num_hidden_layers": 3}, r"missing model\.layers\.2\.self_attn\.q_proj\.weight, .* \(9 in all\)\)"),
    ({"num_hidden_layers": 1}, r"\(unexpected model\.layers\.1\."),
    ({"tie_word_embeddings": False}, r"\(missing lm_head\.weight\)"),
    (None, r"\(missing model\.norm\.weight\)"),
    ({"vocab_size": 60000}, r"of another shape: model\.embed_tokens\.weight \[\d+, 16\] \(config\.json: "
                            r"\[60000, 16\]\)"),
    ({"hidden_size": 10 ** 9}, r"of another shape: .* \(20 in all\)"),
    ({"num_hidden_layers": 1_000_000}, r"describes a model of more than 48 weight tensors \(num_hidden_layers "
                                       r"1000000\) but its safetensors hold 20"),
    ({"num_attention_heads": 10 ** 6}, r"cannot read config\.json .*not a multiple of the number of attention"),
    ({"intermediate_size": -5}, r"intermediate_size -5: sizes must be positive integers"),
])
def test_weights_must_be_the_model_config_describes(peer: Path, beauty_dir: Path, tmp_path: Path,
                                                    config: dict | None, error: str) -> None:
    """Safetensors that do not hold exactly the model config.json describes (a layer too many or
    too few, an untied head or the final norm not saved (``config`` None), another vocabulary or
    width) and absurd sizes are refused from the headers alone: by the check, by import's checks
    and by recspec's own loader, which transformers would otherwise complete with random weights."""
    folder = copy_peer(peer, tmp_path / "spoiled", config)
    if config is None:
        without_norm(folder)
    for check in (check_weights_fit, lambda path: peer_parts(spec(path, beauty_dir / INDEX_FILE, beauty_dir)),
                  load_safetensors_lm):
        with refused(error):
            check(folder)


def test_malformed_config_and_tokenizer(peer: Path, beauty_dir: Path, tmp_path: Path) -> None:
    """A config or tokenizer file of the wrong structure or with fields of the wrong type, a
    truncated safetensors header, a broken chat template: one line each, naming the folder."""
    chat = TextTemplate("The user has interacted with items {history}.", chat=True)
    cases = [
        ("config.json", "{", None, r"config\.json: line 1: malformed JSON"),
        ("config.json", None, {"num_hidden_layers": "four"}, r"cannot read config\.json .*expected int, got str"),
        ("config.json", None, {"model_type": "nosuch"}, r"model_type 'nosuch' is not one transformers"),
        ("tokenizer_config.json", "[]", None, r"tokenizer_config\.json: holds list, not a JSON object"),
        ("tokenizer_config.json", None, {"pad_token": 5}, r"cannot load its tokenizer \(Special token pad_token"),
        ("tokenizer_config.json", None, {"added_tokens_decoder": [1, 2]}, r"cannot load its tokenizer"),
        ("tokenizer.json", "{}", None, r"cannot load its tokenizer"),
        ("tokenizer.json", None, {"model": {"type": "BPE", "vocab": 3}}, r"cannot load its tokenizer \(invalid type"),
        ("chat_template.jinja", "{% for %}", None, r"cannot tokenize the prompt template with its tokenizer"),
        (WEIGHTS_FILE, b"\x10\x00\x00\x00\x00\x00\x00\x00{", None, r"cannot read the header of model\.safetensors"),
    ]
    for number, (name, text, changes, error) in enumerate(cases):
        folder = copy_peer(peer, tmp_path / f"malformed-{number}")
        if changes:
            edit_json(folder / name, **changes)
        elif isinstance(text, bytes):
            (folder / name).write_bytes(text)
        else:
            (folder / name).write_text(text)
        with refused(error):
            peer_parts(spec(folder, beauty_dir / INDEX_FILE, beauty_dir, chat if name.endswith(".jinja") else
                            TextTemplate(LC_REC_PROMPT)))


def test_command_line_refuses_and_writes_nothing(peer: Path, beauty_dir: Path, tmp_path: Path) -> None:
    """Through `recspec import`: an untied head not saved, a config vocabulary beyond the saved
    embeddings, a tokenizer.json of another structure: exit status 2, one line, no --out folder
    (before, the first imported with a random head and the others ended in tracebacks)."""
    out = tmp_path / "out"
    for name, config, needle in (("untied", {"tie_word_embeddings": False}, "(missing lm_head.weight)"),
                                 ("vocab", {"vocab_size": 60000}, "of another shape: model.embed_tokens.weight"),
                                 ("tokenizer", None, "cannot load its tokenizer")):
        folder = copy_peer(peer, tmp_path / name, config)
        if config is None:
            (folder / "tokenizer.json").write_text("[]")
        one_error_line(recspec(*import_args(folder, out, beauty_dir)), needle)
        assert not out.exists()
    result = recspec(*import_args(peer, out, beauty_dir))  # the unspoiled folder imports
    assert result.returncode == 0, result.stderr


def test_a_folder_recspec_trained(trained_models: Path, tmp_path: Path) -> None:
    """A folder recspec trained (its word-level identifier tokenizer) is refused in one line, as
    the training folder or as its best/: every command takes it as it is. Without its
    recspec.json it is a foreign folder whose tokenizer cannot tokenize identifiers written
    together: one line too. recspec's own loader still loads it (its weights fit its config)."""
    out, index = tmp_path / "out", trained_models / "ids" / INDEX_FILE
    for folder in (trained_models / "target", trained_models / "target" / BEST_DIR):
        one_error_line(recspec("import", "--model", str(folder), "--index", str(index), "--dataset", "ml-100k",
                               "--prompt-template", "history: {history}", "--out", str(out)),
                       f"{folder}: already a recspec model folder (it has {RECSPEC_JSON}); pass it to --target")
    foreign = tmp_path / "foreign"
    shutil.copytree(trained_models / "target" / BEST_DIR, foreign,
                    ignore=shutil.ignore_patterns(RECSPEC_JSON, CHECKSUMS))
    one_error_line(recspec("import", "--model", str(foreign), "--index", str(index), "--dataset", "ml-100k",
                           "--prompt-template", "history: {history}", "--out", str(out)),
                   "cannot tokenize the identifiers with its tokenizer (WordLevel error: Missing [UNK] token")
    assert not out.exists()
    config = check_weights_fit(trained_models / "target" / BEST_DIR)
    model, _ = load_trained(trained_models / "target")
    assert model.config.num_hidden_layers == config.num_hidden_layers

