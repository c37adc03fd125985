"""Training a draft head (:mod:`recspec.models.head`) on alignment data: `recspec align train --head`.

The head learns from the frozen target's own features. One target forward over the prompts and
the node tree of the alignment data (the prefixes of the target's top-K sequences and of the
ground truth) gives, at every node, the target's last hidden state ``h``; it runs the first time a
prompt is batched, and the features are kept for the later epochs (float16 in memory: 1 + M
nodes x H per prompt, e.g. 26 x 512 x 2 bytes for MovieLens, so 100 MB per 4,000 prompts). The head then
guesses each node's feature from its parent's, level by level from the root, exactly as it drafts:
a node under the root (an item's first token) reads the target's feature at the prompt's last
position, a deeper node the head's own guess at its parent. Its distributions at the nodes enter
the same alignment losses as a draft model's (AtSpeed-S / -R, WordKD, SeqKD, TVDKD, SFT:
:class:`~recspec.align.task.AlignmentTask`), with the target's exact level-1 distribution at the
root (a head never drafts level 1), plus EAGLE's feature regression: ``feature_weight`` times the
smooth-L1 distance between the guessed and the true features. For a head that attends
(``context_heads``), the same forward also gives the target's features at every real prompt
token, kept with the nodes' (float16, about ``T x H x 2`` bytes more per prompt) and read by the
head's attention as it reads them when drafting.

The folder is a head folder (``best/``: :func:`~recspec.models.head.save_head`), tied to the
target's weights and item index; the checkpoint is the head's weights with the trainer's state
(``checkpoint.{safetensors,json}``, never a pickle). Epochs are selected by validation
acceptance (mean accepted steps of strict speculative beam search with the head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from recspec.align.data import PARTS, tree_view
from recspec.align.task import AlignmentTask
from recspec.decoding.scorer import forward_features, prompt_and_tree
from recspec.errors import RecspecError
from recspec.models.checkpoint import CHECKPOINT_DIR
from recspec.models.head import ITEM_HEAD, HeadDraft, HeadKind, load_head, save_head
from recspec.models.train import autocast
from recspec.statefile import changed_settings, has_state, load_state, save_state, state_files

CHECKPOINT = CHECKPOINT_DIR  # the state's name, by which `prepare_training_dir` knows a head to resume
BEST = "best"
REMEDY = "delete the checkpoint files to start over, or choose another output folder"


class HeadStore:
    """The trainer's model store for a head of ``kind`` (an item head, or a text head):
    ``checkpoint.{safetensors,json}`` (the head's state with the trainer's) and ``best/`` (a head
    folder)."""

    def __init__(self, out_dir: Path, fingerprint: dict[str, str], info: dict[str, Any],
                 kind: HeadKind = ITEM_HEAD, shape: dict[str, Any] | None = None) -> None:
        self.out_dir, self.fingerprint, self.info, self.kind = Path(out_dir), fingerprint, info, kind
        self.shape = shape
        self.checkpoint_path, self.best_dir = state_files(out_dir, CHECKPOINT)[1], Path(out_dir) / BEST

    def run(self) -> dict[str, Any]:
        """What the checkpoint records the head was trained for: its info, with the target named by
        its fingerprint rather than by the path (or name) it was given, and the head's ``shape``
        (its config, when given: a resume with another shape is refused; the head folder records
        the config itself)."""
        shape = {} if self.shape is None else {"shape": self.shape}
        return {**{key: value for key, value in self.info.items() if key != "target"}, **shape,
                "fingerprint": self.fingerprint}

    def read_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint's state, or None; one trained for another target, method or data is refused."""
        if not has_state(self.out_dir, CHECKPOINT):
            return None
        saved = load_state(self.out_dir, CHECKPOINT, REMEDY)
        shown = changed_settings(saved.pop("run", {}), self.run())
        if shown:
            raise RecspecError(f"{self.checkpoint_path}: a head trained otherwise ({shown}); resume it with the same "
                               f"settings, or {REMEDY}")
        return saved

    def load_checkpoint(self, model: nn.Module, saved: dict[str, Any]) -> None:
        model.load_state_dict(saved["weights"])

    def save_checkpoint(self, model: nn.Module, state: dict[str, Any], info: dict[str, Any]) -> None:
        weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
        save_state(self.out_dir, CHECKPOINT, {**state, "weights": weights, "run": self.run()})

    def save_best(self, model: nn.Module, info: dict[str, Any]) -> None:
        save_head(self.best_dir, model, self.fingerprint,
                  {**self.info, "best": {key: info[key] for key in ("metric", "value", "epoch") if key in info}},
                  self.kind)

    def load_best(self, model: nn.Module) -> None:
        best = load_head(self.best_dir, self.fingerprint, next(model.parameters()).device, self.kind)
        model.load_state_dict(best.state_dict())


class HeadAlignmentTask(AlignmentTask):
    """:class:`~recspec.align.task.AlignmentTask` for a head bound to a frozen target (``bound``);
    the model the trainer trains is ``bound.head``."""

    def __init__(self, base: AlignmentTask, bound: HeadDraft, store: HeadStore, feature_weight: float = 1.0) -> None:
        super().__init__(base.encoder, base.trie, base.examples, base.data, base.method, base.alpha, base.k,
                         base.valid_batch_size)
        self.bound, self.head_store, self.feature_weight = bound, store, feature_weight
        self.kept: dict[tuple[int, int], torch.Tensor] = {}  # (part, row) -> the target's features
        for parameter in bound.target.parameters():
            parameter.requires_grad_(False)

    def store(self, out_dir: Path) -> HeadStore:
        return self.head_store

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        draft, feature_loss = self.head_outputs(batch, autocast_dtype)
        return self.combine(draft, batch) + self.feature_weight * feature_loss

    def batch(self, rows, part: str = "train") -> dict[str, torch.Tensor]:
        """:meth:`AlignmentTask.batch` plus the rows and part, under which the target's features
        are kept after the first time (:meth:`target_features`)."""
        out = super().batch(rows, part)
        return {**out, "rows": torch.as_tensor(rows, dtype=torch.int64),
                "part": torch.tensor(PARTS.index(part))}

    def target_features(self, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The frozen target's features at the root and at every node of the batch: float32
        ``[B, 1 + M, H]`` (zeros at padding nodes); for a head that attends, also the features at
        the prompts' real tokens, float32 ``[B, T, H]`` with their mask bool ``[B, T]`` (real
        tokens first), else None. Computed by one target forward over the prompts and the node
        tree the first time a row is seen, then kept (float16, per row: the data does not change
        between epochs)."""
        parents, tokens = batch["node_parents"], batch["node_tokens"]
        counts = 1 + batch["real"][:, 1:].any(dim=2).sum(dim=1)  # root + real nodes (they come first)
        keys = [(int(batch["part"]), row) for row in batch["rows"].tolist()]
        attends = self.bound.attends
        if any(key not in self.kept for key in keys):
            visible, depths = tree_view(parents, batch["attention_mask"])
            lengths = batch["attention_mask"].sum(dim=1)
            target = self.bound.target.to(tokens.device).eval()
            with torch.no_grad(), autocast(tokens.device, autocast_dtype):
                features = forward_features(target, None, *prompt_and_tree(
                    batch["input_ids"], batch["attention_mask"], batch["position_ids"], tokens, visible,
                    lengths[:, None] + depths), all_features=attends)[1]
            real = batch["attention_mask"].bool()
            for i, (key, count) in enumerate(zip(keys, counts.tolist())):
                nodes = features[i, features.shape[1] - tokens.shape[1] - 1:][:count].to("cpu", torch.float16)
                prompt = features[i, :real.shape[1]][real[i]].to("cpu", torch.float16) if attends else None
                self.kept[key] = (nodes, prompt)
        rows = torch.nn.utils.rnn.pad_sequence([self.kept[key][0] for key in keys], batch_first=True)
        rows = torch.nn.functional.pad(rows, (0, 0, 0, tokens.shape[1] + 1 - rows.shape[1]))
        if not attends:
            return rows.to(tokens.device, torch.float32), None
        prompts = [self.kept[key][1] for key in keys]
        lengths = torch.as_tensor([len(prompt) for prompt in prompts], device=tokens.device)
        mask = torch.arange(int(lengths.max()), device=tokens.device)[None, :] < lengths[:, None]
        context = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(tokens.device, torch.float32)
        return rows.to(tokens.device, torch.float32), (context, mask)

    def keep_features(self, device: torch.device, autocast_dtype: torch.dtype | None, batch_size: int = 64,
                      progress: bool = True) -> None:
        """Compute and keep the target's features of every training and validation row now
        (:meth:`target_features`), so that a training budget counts the head's training alone,
        as it does not count making the alignment data either."""
        from tqdm.auto import tqdm

        for part in PARTS:
            rows = np.arange(len(self.data[part]))
            for start in tqdm(range(0, len(rows), batch_size), desc=f"target features, {part}", unit="batch",
                              disable=not progress, leave=False):
                batch = self.batch(rows[start:start + batch_size], part)
                self.target_features({key: value.to(device) for key, value in batch.items()}, autocast_dtype)

    def head_outputs(self, batch: dict[str, torch.Tensor],
                     autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's log-probs of every node's children, float32 ``[B, 1 + M, C]`` (row 0, the
        root, holds the target's from the alignment data: level 1 is never drafted), and the
        feature loss (a scalar)."""
        bound = self.bound
        parents, tokens = batch["node_parents"], batch["node_tokens"]  # [B, M]
        depths = tree_view(parents, batch["attention_mask"])[1]
        features, context = self.target_features(batch, autocast_dtype)  # [B, 1 + M, H]: the root, then the nodes
        real = batch["real"][:, 1:].any(dim=2)  # [B, M]
        guessed = torch.zeros_like(features[:, 1:])
        with autocast(tokens.device, autocast_dtype):
            for depth in range(int(depths.max()) + 1 if real.any() else 0):  # root's children first
                above = guessed.gather(1, parents.clamp(min=0)[:, :, None].expand_as(guessed))
                parent = torch.where((parents < 0)[:, :, None], features[:, :1].expand_as(guessed), above)
                now = (depths == depth) & real
                guessed = torch.where(now[:, :, None], bound.features(parent, tokens, depths, context).float(), guessed)
        feature_loss = torch.nn.functional.smooth_l1_loss(guessed[real], features[:, 1:][real])
        rows = bound.id_log_probs(guessed)  # [B, M, V_id]
        ids = bound.token_ids.to(tokens.device)
        slot = torch.searchsorted(ids, batch["children"][:, 1:].clamp(max=int(ids.max())))
        nodes = rows.gather(2, slot)
        return torch.cat((batch["target"][:, :1], nodes), dim=1).masked_fill(~batch["real"], -torch.inf), feature_loss
