"""Examples to token tensors: prompts for decoding and teacher-forcing batches for training.

Prompt of an example (``n`` history items, identifier length ``L``)::

    <bos> t(h_1) ... t(h_n) <sep>          length P = 2 + n * L, oldest history item first

where ``t(i)`` is the L identifier tokens of item ``i``. The answer is the target's L tokens, with
no ``<eos>`` (every identifier has the same length). A training sequence is prompt + answer,
length P + L; its labels are -100 except at the L answer positions, in the Hugging Face convention
(``labels[t]`` is the token at position ``t``; the model predicts it from the logits at ``t - 1``).

Items are dense dataset item indices (``Examples.history`` / ``target_items``); the encoder holds
a table ``item_tokens`` [num_dataset_items, L] of token ids, built once. Every method is
vectorized over examples and tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recspec.data.splits import PAD_ITEM, Examples
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.tokenizer import identifier_token_ids

IGNORE_INDEX = -100


def _shown(values: Sequence, limit: int = 5) -> str:
    values = list(values)
    text = ", ".join(str(v) for v in values[:limit])
    return text + (f" and {len(values) - limit} more" if len(values) > limit else "")


class PromptEncoder:
    """Turns examples into token ids for one item index and one tokenizer.

    index: the item identifiers; dataset_item_keys: raw id of each dense dataset item
    (``Dataset.item_ids``), every one of which must be in the index; tokenizer: from
    :func:`recspec.models.tokenizer.build_tokenizer` (or any tokenizer holding the identifier
    tokens and bos / sep / pad tokens).
    """

    def __init__(self, index: ItemIndex, dataset_item_keys: Sequence[str], tokenizer) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.length = index.length
        ids = identifier_token_ids(tokenizer, index)
        table = np.array([ids[t] for t in index.tokens], dtype=np.int64)
        rows = index.positions(list(dataset_item_keys))
        #: int64 [num_dataset_items, L]: token ids of each dataset item's identifier
        self.item_tokens = torch.from_numpy(table[index.codes[rows]])
        special = {}
        for name in ("bos", "sep", "pad"):
            value = getattr(tokenizer, f"{name}_token_id", None)
            if value is None:
                raise RecspecError(f"the tokenizer has no {name} token; build it with build_tokenizer")
            special[name] = int(value)
        self.bos_id, self.sep_id, self.pad_id = special["bos"], special["sep"], special["pad"]
        self.vocab_size = len(tokenizer)

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

    def _prompt_matrix(self, history: torch.Tensor, lengths: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """[b, max P + extra] prompts, left-aligned and right-padded with ``<pad>``."""
        b, h = history.shape
        L = self.length
        tokens = self.item_tokens[history.clamp(min=0)].reshape(b, h * L)  # left-padded like history
        width = 2 + int(lengths.max()) * L + extra
        col = torch.arange(width - 1)  # output column - 1, for the token columns
        src = col[None, :] + ((h - lengths) * L)[:, None]  # shift the real tokens to the left
        keep = col[None, :] < (lengths * L)[:, None]
        out = torch.full((b, width), self.pad_id, dtype=torch.int64)
        out[:, 0] = self.bos_id
        out[:, 1:] = torch.where(keep, tokens.gather(1, src.clamp(max=h * L - 1)), self.pad_id)
        out[torch.arange(b), 1 + lengths * L] = self.sep_id
        return out

    def prompt_lengths(self, examples: Examples, rows: np.ndarray | None = None) -> np.ndarray:
        """int64 [b]: prompt length P = 2 + n * L of each example (no checks, cheap)."""
        history = examples.history if rows is None else examples.history[rows]
        return 2 + (history != PAD_ITEM).sum(axis=1).astype(np.int64) * self.length

    def prompts(self, examples: Examples, rows: np.ndarray | None = None) -> list[torch.Tensor]:
        """One int64 prompt tensor per example (of ``rows``, default all), variable length."""
        history, lengths = self._history(examples, rows)
        matrix = self._prompt_matrix(history, lengths)
        sizes = 2 + lengths * self.length
        mask = torch.arange(matrix.shape[1])[None, :] < sizes[:, None]
        return list(matrix[mask].split(sizes.tolist()))

    def prompt_batch(self, examples: Examples, rows: np.ndarray | None = None,
                     padding_side: str = "left") -> dict[str, torch.Tensor]:
        """Prompts as one padded batch: input_ids, attention_mask, position_ids [b, max P].

        Left padding (default) puts every prompt's last token in the last column, as generation
        wants; position ids count real tokens only, so a padded row computes what it would alone.
        """
        history, lengths = self._history(examples, rows)
        matrix = self._prompt_matrix(history, lengths)
        sizes = 2 + lengths * self.length
        width = matrix.shape[1]
        mask = torch.arange(width)[None, :] < sizes[:, None]
        if padding_side == "left":
            shift = (width - sizes)[:, None]
            src = (torch.arange(width)[None, :] - shift) % width
            matrix, mask = matrix.gather(1, src), mask.gather(1, src)
        elif padding_side != "right":
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        return {"input_ids": matrix, "attention_mask": mask.long(), "position_ids": positions}

    def answer_tokens(self, items: np.ndarray | torch.Tensor) -> torch.Tensor:
        """int64 [..., L]: identifier token ids of dense dataset items."""
        return self.item_tokens[torch.as_tensor(np.asarray(items), dtype=torch.int64)]

    def training_batch(self, examples: Examples, rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """Teacher-forcing batch of prompt + answer, right-padded: input_ids, attention_mask,
        labels (-100 except the L answer positions) and position_ids, all [b, T], T = max(P + L)."""
        history, lengths = self._history(examples, rows)
        targets = self._targets(examples, rows)
        L = self.length
        matrix = self._prompt_matrix(history, lengths, extra=L)
        b, width = matrix.shape
        sizes = 2 + lengths * L  # answer starts here
        answer_cols = sizes[:, None] + torch.arange(L)[None, :]
        batch_rows = torch.arange(b)[:, None].expand(b, L)
        answers = self.item_tokens[targets]
        matrix[batch_rows, answer_cols] = answers
        labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.int64)
        labels[batch_rows, answer_cols] = answers
        positions = torch.arange(width)
        mask = positions[None, :] < (sizes + L)[:, None]
        return {"input_ids": matrix, "attention_mask": mask.long(), "labels": labels,
                "position_ids": positions[None, :].expand(b, width).contiguous()}


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
