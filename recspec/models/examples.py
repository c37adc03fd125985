"""Examples to token tensors: prompts for decoding and teacher-forcing batches for training.

A prompt wraps the user's history (``n`` items, identifier length ``L``) in a
:class:`PromptTemplate` of token ids::

    prefix  t(h_1) sep t(h_2) sep ... sep t(h_n)  suffix      oldest history item first

where ``t(i)`` is the L identifier tokens of item ``i``, so its length is
``P = |prefix| + n * (L + |sep|) - |sep| + |suffix|``. recspec's own identifier tokenizer uses
``<bos>`` / nothing / ``<sep>`` (``P = 2 + n * L``); a prompt written as text with a
``{history}`` slot (:class:`TextTemplate`: the LLM preset's instruction rendered by the LLM's chat
template, or the prompt of a checkpoint trained elsewhere) becomes one by tokenizing the text
around the slot. The answer is the target's L tokens, with no end token (every identifier has the
same length).

A training sequence is prompt + answer, *left*-padded, so the answer always occupies the last L
columns and the loss needs the logits of the last ``L + 1`` positions only (``logits_to_keep``:
for an LLM with a 50k vocabulary this skips the output layer at every prompt position).

Items are dense dataset item indices (``Examples.history`` / ``target_items``); the encoder holds
a table ``item_tokens`` [num_dataset_items, L] of token ids, built once. Every method is
vectorized over examples and tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from recspec.data.splits import PAD_ITEM, Examples
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.tokenizer import identifier_token_ids, read_metadata

HISTORY_SLOT = "{history}"


def _shown(values: Sequence, limit: int = 5) -> str:
    values = list(values)
    text = ", ".join(str(v) for v in values[:limit])
    return text + (f" and {len(values) - limit} more" if len(values) > limit else "")


@dataclass(frozen=True)
class PromptTemplate:
    """Token ids around a history: ``prefix``, ``separator`` between two items, ``suffix``."""

    prefix: tuple[int, ...]
    separator: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def identifiers_only(cls, tokenizer) -> PromptTemplate:
        """``<bos>`` + identifier tokens + ``<sep>``: the template of recspec's own tokenizer."""
        ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "sep")}
        missing = [name for name, value in ids.items() if value is None]
        if missing:
            raise RecspecError(f"the tokenizer has no {' / '.join(missing)} token; build it with build_tokenizer "
                               f"or give the encoder a prompt template")
        return cls((int(ids["bos"]),), (), (int(ids["sep"]),))

    @classmethod
    def from_text(cls, tokenizer, text: str, separator: str, special_tokens: bool = False) -> PromptTemplate:
        """Tokenize ``text`` around its one ``{history}`` slot, and ``separator``; with
        ``special_tokens``, the tokens ``tokenizer(text)`` adds around a text go around it too.

        Identifier tokens are added tokens, which a tokenizer splits off before anything else,
        so the pieces tokenize exactly as the whole prompt text would.
        """
        if text.count(HISTORY_SLOT) != 1:
            raise RecspecError(f"a prompt text needs exactly one {HISTORY_SLOT} slot, got {text!r}")
        before, after = text.split(HISTORY_SLOT)

        def encode(piece: str) -> tuple[int, ...]:
            return tuple(tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else ()

        lead, tail = added_special_tokens(tokenizer) if special_tokens else ((), ())
        return cls(lead + encode(before), encode(separator), encode(after) + tail)

    def to_json(self) -> dict[str, list[int]]:
        return {"prefix": list(self.prefix), "separator": list(self.separator), "suffix": list(self.suffix)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PromptTemplate:
        try:
            return cls(*(tuple(int(t) for t in data[key]) for key in ("prefix", "separator", "suffix")))
        except (KeyError, TypeError, ValueError):
            raise RecspecError(f"malformed prompt template {data!r}") from None


def added_special_tokens(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids ``tokenizer(text)`` puts before and after a text's own tokens (LLaMA's
    ``<s>`` before; nothing for most chat LLMs, whose chat template writes its own)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    if not starts:
        raise RecspecError("the tokenizer's special tokens change the tokens of the text itself; write them "
                           "into the prompt template and use the chat template or none")
    return tuple(full[:starts[0]]), tuple(full[starts[0] + len(plain):])


@dataclass(frozen=True)
class TextTemplate:
    """A prompt written as text (LC-Rec style): ``text`` holds one ``{history}`` slot, which
    becomes the history's identifiers, oldest first, each item's tokens written together and the
    items joined by ``separator``. With ``chat``, ``text`` is the user's message (after the
    ``system`` message, when given) rendered by the tokenizer's chat template with the generation
    prompt, as the LLM presets do; without, it is tokenized as ``tokenizer(text)`` does, with the
    special tokens the tokenizer adds (:func:`added_special_tokens`)."""

    text: str
    separator: str = ", "
    chat: bool = False
    system: str | None = None

    def __post_init__(self) -> None:
        if self.text.count(HISTORY_SLOT) != 1:
            raise RecspecError(f"a prompt template needs exactly one {HISTORY_SLOT} slot (where the history's "
                               f"identifiers go), got {self.text!r}")

    def history_text(self, identifiers: Sequence[Sequence[str]]) -> str:
        """The text of a history: each item's identifier tokens written together, oldest first."""
        return self.separator.join("".join(tokens) for tokens in identifiers)

    def render(self, tokenizer, history: str) -> str:
        """The prompt text with ``history`` in the slot, rendered by the chat template with ``chat``."""
        text = self.text.replace(HISTORY_SLOT, history)
        if not self.chat:
            return text
        if not getattr(tokenizer, "chat_template", None):
            raise RecspecError("the tokenizer has no chat template; write the whole prompt as the template instead")
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return tokenizer.apply_chat_template([*messages, {"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    def encode(self, tokenizer, history: str) -> list[int]:
        """Token ids of the whole prompt text around ``history``, as the tokenizer makes them."""
        return list(tokenizer(self.render(tokenizer, history), add_special_tokens=not self.chat)["input_ids"])

    def tokens(self, tokenizer) -> PromptTemplate:
        """The template as token ids, for :class:`PromptEncoder`."""
        return PromptTemplate.from_text(tokenizer, self.render(tokenizer, HISTORY_SLOT), self.separator,
                                        special_tokens=not self.chat)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def saved_template(folder, tokenizer) -> PromptTemplate:
    """The prompt template recorded in a model folder's ``recspec.json`` (models trained before
    templates were recorded used :meth:`PromptTemplate.identifiers_only`)."""
    data = read_metadata(folder).get("prompt")
    return PromptTemplate.identifiers_only(tokenizer) if data is None else PromptTemplate.from_json(data)


class PromptEncoder:
    """Turns examples into token ids for one item index, one tokenizer and one prompt template.

    index: the item identifiers; dataset_item_keys: raw id of each dense dataset item
    (``Dataset.item_ids``, or the list a model folder keeps of them:
    :class:`~recspec.models.run_data.ServingData`), every one of which must be in the index, kept
    as :attr:`item_keys` (the rows of the examples it encodes); tokenizer: one holding the
    identifier tokens and a pad token (:func:`recspec.models.tokenizer.build_tokenizer`, or an
    LLM's tokenizer extended with them); template: default
    :meth:`PromptTemplate.identifiers_only`.
    """

    def __init__(self, index: ItemIndex, dataset_item_keys: Sequence[str], tokenizer,
                 template: PromptTemplate | None = None) -> None:
        self.index = index
        self.item_keys = list(dataset_item_keys)
        self.tokenizer = tokenizer
        self.length = index.length
        self.template = template or PromptTemplate.identifiers_only(tokenizer)
        ids = identifier_token_ids(tokenizer, index)
        table = np.array([ids[t] for t in index.tokens], dtype=np.int64)
        rows = index.positions(self.item_keys)
        #: int64 [num_dataset_items, L]: token ids of each dataset item's identifier
        self.item_tokens = torch.from_numpy(table[index.codes[rows]])
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise RecspecError("the tokenizer has no pad token; set one (e.g. its end-of-text token)")
        self.pad_id = int(tokenizer.pad_token_id)
        self.vocab_size = len(tokenizer)
        self._prefix = torch.tensor(self.template.prefix, dtype=torch.int64)
        self._separator = torch.tensor(self.template.separator, dtype=torch.int64)
        self._suffix = torch.tensor(self.template.suffix, dtype=torch.int64)

    @property
    def num_items(self) -> int:
        return self.item_tokens.shape[0]

    # ------------------------------------------------------------------ checks

    def _history(self, examples: Examples, rows: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked history [b, H] (torch int64) and its lengths [b]."""
        history = np.asarray(examples.history if rows is None else examples.history[rows], dtype=np.int64)
        where = np.arange(len(examples)) if rows is None else np.asarray(rows)
        if history.ndim != 2:
            raise RecspecError(f"history must be a 2-D array, got shape {history.shape}")
        bad = (history < PAD_ITEM) | (history >= self.num_items)
        if bad.any():
            raise RecspecError(f"unknown item index(es) {_shown(np.unique(history[bad]))} in the history of example(s) "
                               f"{_shown(where[bad.any(axis=1)])}; the encoder knows {self.num_items} items")
        real = history != PAD_ITEM
        lengths = real.sum(axis=1)
        if (lengths == 0).any():
            empty = where[lengths == 0]
            raise RecspecError(f"example(s) {_shown(empty)} (user(s) {_shown(examples.users[empty])}) have an empty "
                               f"history; a prompt needs at least one item")
        if (real[:, :-1] & ~real[:, 1:]).any():
            raise RecspecError(f"example(s) {_shown(where[(real[:, :-1] & ~real[:, 1:]).any(axis=1)])}: history "
                               f"padding must be on the left (most recent item last)")
        return torch.from_numpy(history), torch.from_numpy(lengths)

    def _targets(self, examples: Examples, rows: np.ndarray | None) -> torch.Tensor:
        """The single target item of each example [b]; several or no targets is an error."""
        where = np.arange(len(examples)) if rows is None else np.asarray(rows)
        counts = np.diff(examples.target_offsets)[where]
        if (counts != 1).any():
            raise RecspecError(f"example(s) {_shown(where[counts != 1])} have {_shown(np.unique(counts[counts != 1]))} "
                               f"targets; teacher forcing needs one per example (use one_target_per_row)")
        targets = examples.target_items[examples.target_offsets[where]]
        bad = (targets < 0) | (targets >= self.num_items)
        if bad.any():
            raise RecspecError(f"unknown target item index(es) {_shown(np.unique(targets[bad]))} in example(s) "
                               f"{_shown(where[bad])}")
        return torch.from_numpy(np.asarray(targets, dtype=np.int64))

    def check(self, examples: Examples, targets: bool = False) -> None:
        """Raise what encoding would raise for any of ``examples`` (vectorized, no tensors built)."""
        self._history(examples, None)
        if targets:
            self._targets(examples, None)

    # ------------------------------------------------------------------ encoding

    def _lengths(self, items: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """Prompt length P of ``items`` history items (numpy or torch, any shape)."""
        t = self.template
        return len(t.prefix) + items * (self.length + len(t.separator)) - len(t.separator) + len(t.suffix)

    def _right_padded(self, history: torch.Tensor, lengths: torch.Tensor, answers: torch.Tensor | None = None,
                      suffix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts (+ ``answers`` [b, L] after them; without the suffix unless ``suffix``),
        left-aligned and right-padded with the pad token: ``([b, W] token ids, [b] sequence lengths)``."""
        b, h = history.shape
        block = self.length + len(self._separator)
        items = self.item_tokens[history.clamp(min=0)]  # [b, h, L]
        blocks = torch.cat((items, self._separator.expand(b, h, -1)), dim=2).reshape(b, h * block)
        body = lengths * block - len(self._separator)  # history tokens without the last separator
        prefix, tail = len(self._prefix), len(self._suffix) if suffix else 0
        sizes = prefix + body + tail
        extra = 0 if answers is None else answers.shape[1]
        width = int(sizes.max()) + extra
        col = torch.arange(width)[None, :] - prefix  # column within the history part
        src = (col + ((h - lengths) * block)[:, None]).clamp(0, h * block - 1)  # history is left-padded
        out = torch.where((col >= 0) & (col < body[:, None]), blocks.gather(1, src), self.pad_id)
        out[:, :prefix] = self._prefix
        rows = torch.arange(b)[:, None]
        out[rows, (prefix + body)[:, None] + torch.arange(tail)] = self._suffix[:tail]
        if answers is not None:
            out[rows, sizes[:, None] + torch.arange(extra)] = answers
        return out, sizes + extra

    @staticmethod
    def _left_padded(matrix: torch.Tensor, sizes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Right-padded rows ``[b, W]`` of ``sizes`` real tokens moved to the right end:
        input_ids, attention_mask and position_ids (real tokens counted from 0, 0 on padding)."""
        width = matrix.shape[1]
        src = (torch.arange(width)[None, :] - (width - sizes)[:, None]) % width
        mask = torch.arange(width)[None, :] >= (width - sizes)[:, None]
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        return {"input_ids": matrix.gather(1, src), "attention_mask": mask.long(), "position_ids": positions}

    def prompt_lengths(self, examples: Examples, rows: np.ndarray | None = None) -> np.ndarray:
        """int64 [b]: prompt length P of each example (no checks, cheap)."""
        history = examples.history if rows is None else examples.history[rows]
        return self._lengths((history != PAD_ITEM).sum(axis=1).astype(np.int64))

    def prompts(self, examples: Examples, rows: np.ndarray | None = None) -> list[torch.Tensor]:
        """One int64 prompt tensor per example (of ``rows``, default all), variable length."""
        history, lengths = self._history(examples, rows)
        matrix, sizes = self._right_padded(history, lengths)
        mask = torch.arange(matrix.shape[1])[None, :] < sizes[:, None]
        return list(matrix[mask].split(sizes.tolist()))

    def history_tokens(self, examples: Examples, rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts of ``rows`` without their suffix (the prefix and the history), left-aligned
        and right-padded with the pad token: ``(int64 [b, W] token ids, int64 [b] lengths)``."""
        history, lengths = self._history(examples, rows)
        return self._right_padded(history, lengths, suffix=False)

    def prompt_batch(self, examples: Examples, rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """Prompts as one left-padded batch: input_ids, attention_mask, position_ids [b, max P].

        Every prompt's last token is in the last column, as generation wants; position ids count
        real tokens only, so a padded row computes what it would alone.
        """
        history, lengths = self._history(examples, rows)
        return self._left_padded(*self._right_padded(history, lengths))

    def answer_tokens(self, items: np.ndarray | torch.Tensor) -> torch.Tensor:
        """int64 [..., L]: identifier token ids of dense dataset items."""
        return self.item_tokens[torch.as_tensor(np.asarray(items), dtype=torch.int64)]

    def training_batch(self, examples: Examples, rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """Teacher-forcing batch of prompt + answer, left-padded: input_ids, attention_mask and
        position_ids [b, T] (T = max(P + L)), and labels [b, L], the answer tokens, which are the
        last L columns of input_ids (predicted from the logits at columns T - L - 1 .. T - 2)."""
        history, lengths = self._history(examples, rows)
        answers = self.item_tokens[self._targets(examples, rows)]
        batch = self._left_padded(*self._right_padded(history, lengths, answers))
        return {**batch, "labels": answers}


# ---------------------------------------------------------------------- example selection

def truncate_history(examples: Examples, max_history: int) -> Examples:
    """The same examples with each history cut to its ``max_history`` most recent items."""
    if max_history < 1:
        raise RecspecError(f"max history must be at least 1, got {max_history}")
    if examples.history.shape[1] <= max_history:
        return examples
    return Examples(examples.users, np.ascontiguousarray(examples.history[:, -max_history:]),
                    examples.target_offsets, examples.target_items)


def one_target_per_row(examples: Examples) -> Examples:
    """One example per (history, target) pair: an example with k targets becomes k rows."""
    counts = np.diff(examples.target_offsets)
    rows = np.repeat(np.arange(len(examples)), counts)
    return Examples(examples.users[rows], examples.history[rows], np.arange(len(rows) + 1, dtype=np.int64),
                    np.asarray(examples.target_items, dtype=np.int64).copy())


def last_per_user(examples: Examples, n: int) -> np.ndarray:
    """Positions (ascending) of each user's last ``n`` examples, in the examples' own order."""
    if n < 1:
        raise RecspecError(f"examples per user must be at least 1, got {n}")
    order = np.argsort(examples.users, kind="stable")
    users = examples.users[order]
    group_end = np.searchsorted(users, users, side="right")
    from_end = group_end - 1 - np.arange(len(users))
    return np.sort(order[from_end < n])
