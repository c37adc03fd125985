"""Packed next-item training: several consecutive examples of one user in one sequence.

A user's training examples are windows of one sequence: example ``j + 1``'s history is example
``j``'s history followed by its target, cut to the ``H`` most recent items. One-example training
feeds the shared history again for every example (MovieLens-100K at ``H = 20``: 65 tokens an
example at 20 items, 62 of them the prompt). A *pack* of ``c`` such examples feeds it once::

    prefix t(h_1) sep ... sep t(h_T) | suffix t(a_1) | suffix t(a_2) | ... | suffix t(a_c)
    '------------ trunk -----------'  '---------------- c branches -----------------'

The trunk is the prompt of the pack's last example without its suffix (``T`` items). Branch
``m`` (``0 <= m < c``) is example ``m``'s suffix and answer; it attends to the prefix, to the
first ``v_m = T - (c - 1 - m)`` trunk items (its own history, ending with its last item) and
causally to itself, never to another branch, and its position ids continue from its last
history token. So every branch computes exactly what ``prefix t(h_1) ... t(h_v) suffix answer``
computes alone (a test checks the logits on real models), for ``c`` answers' worth of tokens
plus one history instead of ``c`` histories.

What changes against one-example training: when the trunk is cut at ``H`` items, the pack's
earlier examples see their history cut at the trunk's first item (``v_m`` of their ``min(H,
len)`` items; at pack size ``C <= H`` each still sees at least ``H - C + 1``). Examples whose
history reaches back to the user's first item (every example while a user has at most ``H``
items, nearly all of Amazon Beauty's) are trained exactly as alone, and pack size 1 is
one-example training.

Batches: packs are rows, left-padded, with ``C`` branch slots of ``|suffix| + L`` columns at the
end of every row (``C`` the batch's largest pack; a pack of ``c < C`` examples fills the last
``c``), so the answer columns are the same in every row, and the output layer runs over the ``C L``
columns that predict them only.
"""

from __future__ import annotations

import numpy as np
import torch

from recspec.accel.packed_attention import additive_mask
from recspec.data.splits import Examples, SplitData
from recspec.errors import RecspecError
from recspec.hub import keep_logits_at
from recspec.models.examples import PromptEncoder
from recspec.models.train import SupervisedTask, TrainConfig, autocast

IGNORE = -100  # the label of an unused branch slot (cross-entropy's ignore index)


def pack_offsets(examples: Examples, size: int) -> np.ndarray:
    """Packs of at most ``size`` consecutive examples that continue each other: int64 ``[p + 1]``,
    pack ``i`` holding examples ``offsets[i]:offsets[i + 1]``.

    Example ``j`` continues example ``j - 1`` when both are the same user's and ``j``'s history
    (left-padded ``[H]``) is ``j - 1``'s history followed by its one target, cut to ``H`` items.
    A run of continuing examples is cut into packs of ``size`` from its start; anything else
    starts a new pack (an example that continues nothing is a pack of its own).
    """
    if size < 1:
        raise RecspecError(f"pack size must be at least 1, got {size}")
    n = len(examples)
    history = np.asarray(examples.history)
    if size > history.shape[1]:
        raise RecspecError(f"pack size {size} is above the history length {history.shape[1]}: a pack's first "
                           f"example would see no history; use at most {history.shape[1]}")
    counts = np.diff(examples.target_offsets)
    if (counts != 1).any():
        raise RecspecError("packing needs one target per example (use one_target_per_row)")
    targets = np.asarray(examples.target_items)[examples.target_offsets[:-1]]
    extended = np.concatenate((history[:-1, 1:], targets[:-1, None]), axis=1)  # [n - 1, H]
    follows = (examples.users[1:] == examples.users[:-1]) & (extended == history[1:]).all(axis=1)
    starts = np.concatenate(([True], ~follows))
    run_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    boundary = starts | ((np.arange(n) - run_start) % size == 0)
    return np.concatenate((np.flatnonzero(boundary), [n])).astype(np.int64)


class PackedTask(SupervisedTask):
    """:class:`~recspec.models.train.SupervisedTask` trained in packs of up to ``config.pack``
    examples (a batch of ``batch_size`` packs); validation as the unpacked task."""

    def __init__(self, encoder: PromptEncoder, split: SplitData, config: TrainConfig) -> None:
        super().__init__(encoder, split, config)
        template = encoder.template
        if not template.suffix:
            raise RecspecError("packing needs a prompt template with a suffix (the token(s) before the answer), "
                               "from which each packed example predicts its first answer token")
        self.size = config.pack
        self.offsets = pack_offsets(self.examples, self.size)
        self.slot = len(template.suffix) + encoder.length  # columns of one branch

    def lengths(self) -> np.ndarray:
        last = self.offsets[1:] - 1
        history = self.encoder.prompt_lengths(self.examples, last) - len(self.encoder.template.suffix)
        return history + np.diff(self.offsets) * self.slot

    def examples_in(self, rows: np.ndarray) -> int:
        return int((self.offsets[rows + 1] - self.offsets[rows]).sum())

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Packs ``rows`` as one batch: ``input_ids`` and ``position_ids`` int64 ``[b, W]``,
        ``visible`` bool ``[b, W, W]`` (what each column attends to), ``labels`` int64 ``[b, C,
        L]`` (the answers, :data:`IGNORE` in unused slots); the branch slots are the last ``C *
        (|suffix| + L)`` columns, ``C`` the batch's largest pack."""
        encoder, slot = self.encoder, self.slot
        rows = np.asarray(rows)
        first, stop = self.offsets[rows], self.offsets[rows + 1]
        counts = torch.from_numpy(stop - first)
        size = int(counts.max())  # C: the batch's largest pack
        trunk, sizes = encoder.history_tokens(self.examples, stop - 1)  # [b, W0], [b]
        b, width = len(rows), int(sizes.max())
        column = torch.arange(width + size * slot)
        in_branches = column >= width  # [W]: the slot columns
        pad = width - sizes  # [b]: the trunk starts there
        relative = column[None, :] - pad[:, None]  # [b, W]: column within the trunk
        is_trunk = (relative >= 0) & (column[None, :] < width)
        ids = torch.full((b, len(column)), encoder.pad_id, dtype=torch.int64)
        ids[:, :width] = torch.where(is_trunk[:, :width], trunk.gather(1, relative[:, :width].clamp(0, width - 1)),
                                     encoder.pad_id)
        # Branch slots: slot m holds example first + m - (C - c) when m >= C - c.
        m = torch.arange(size)
        used = m[None, :] >= (size - counts)[:, None]  # [b, C]
        example = (torch.from_numpy(first)[:, None] + m[None, :] - (size - counts)[:, None]).clamp(min=0)
        offsets = self.examples.target_offsets[example.numpy()]
        answers = encoder.answer_tokens(np.asarray(self.examples.target_items)[offsets])  # [b, C, L]
        suffix = torch.tensor(encoder.template.suffix, dtype=torch.int64)
        branches = torch.cat((suffix.expand(b, size, -1), answers), dim=2)
        ids[:, width:] = torch.where(used[:, :, None], branches, encoder.pad_id).reshape(b, size * slot)
        # What each branch sees of the trunk: the prefix and its v_m = T - (C - 1 - m) items, so
        # the trunk's columns less (C - 1 - m) items' tokens and separators.
        block = encoder.length + len(encoder.template.separator)
        seen = sizes[:, None] - (size - 1 - m)[None, :] * block  # [b, C] trunk columns
        in_slot = (column - width).clamp(min=0)
        slot_of, offset = in_slot // slot, in_slot % slot  # [W]
        is_branch = in_branches[None, :] & used.gather(1, slot_of[None, :].expand(b, -1))  # [b, W]
        cut = seen.gather(1, slot_of[None, :].expand(b, -1))  # [b, W]: trunk columns a branch column sees
        positions = torch.where(is_trunk, relative, 0)
        positions = torch.where(is_branch, cut + offset[None, :], positions)
        trunk_key = is_trunk[:, None, :]
        sees_trunk = (is_trunk[:, :, None] & trunk_key & (relative[:, None, :] <= relative[:, :, None])) | (
            is_branch[:, :, None] & trunk_key & (relative[:, None, :] < cut[:, :, None]))
        own = (slot_of[:, None] == slot_of[None, :]) & (offset[None, :] <= offset[:, None]) \
            & in_branches[:, None] & in_branches[None, :]  # [W, W]: earlier columns of its slot
        visible = sees_trunk | (is_branch[:, :, None] & own[None]) | torch.eye(len(column), dtype=torch.bool)
        labels = torch.where(used[:, :, None], answers, IGNORE)
        return {"input_ids": ids, "position_ids": positions, "visible": visible, "labels": labels}

    def answer_columns(self, width: int, size: int) -> torch.Tensor:
        """int64 ``[C * L]``: the columns of a batch ``width`` columns wide with ``size`` (C)
        slots whose logits predict the answer tokens, slot by slot (the suffix's last token, then
        each answer token but the last)."""
        slot, length = self.slot, self.encoder.length
        within = torch.arange(size)[:, None] * slot + (slot - length - 1) + torch.arange(length)[None, :]
        return (width - size * slot + within).reshape(-1)

    def logits(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        """The logits that predict every slot's answer tokens: ``[b, C, L, V]`` (the output layer
        runs over those columns alone where the model takes ``logits_to_keep``)."""
        size = batch["labels"].shape[1]
        columns = self.answer_columns(batch["input_ids"].shape[1], size).to(batch["input_ids"].device)
        keep = keep_logits_at(model, columns)
        mask = additive_mask(batch["visible"], autocast_dtype or model.dtype)[:, None]
        with autocast(batch["input_ids"].device, autocast_dtype):
            logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                           use_cache=False, **keep).logits
        return (logits if keep else logits[:, columns]).unflatten(1, (size, self.encoder.length))

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        """Mean cross-entropy over the answer tokens of the used slots."""
        logits = self.logits(model, batch, autocast_dtype)
        picked = logits.reshape(-1, logits.shape[-1]).float()
        return torch.nn.functional.cross_entropy(picked, batch["labels"].reshape(-1), ignore_index=IGNORE)


def next_item_task(encoder: PromptEncoder, split: SplitData, config: TrainConfig) -> SupervisedTask:
    """The next-item training task ``config`` asks for: one example a sequence, or packs of
    ``config.pack``."""
    return SupervisedTask(encoder, split, config) if config.pack == 1 else PackedTask(encoder, split, config)
