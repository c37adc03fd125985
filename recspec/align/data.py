"""Alignment data (atspeed.txt D' of Eq. 3 and Eq. 8): what the target says about each prompt.

For every selected training prompt (and a validation set): the target's top-K sequences by
trie-constrained beam search (or, with ``mix_lambda < 1`` and a mixing draft, the top-K under the
target-mixed distribution of Eq. 3, :mod:`recspec.align.mixed`, ordered by the target's sequence
probability so that the last one is ``y_K``), and the target's log-probabilities of the *valid* next tokens at
every prefix the losses look at, the *nodes*: the prefixes (depth 0 .. L-1) of the K sequences and
of the ground-truth answer. Prefixes shared by several sequences are stored once, and only valid
tokens are kept (a few hundred values per prompt instead of L x V), in float16.

Layout: ``out/item_index.json`` (the target's identifiers), ``out/manifest.json`` (what made the data: target weights and item index fingerprints,
data set, split, prompt template, K; the shards with their sizes and sha256) and
``out/{train,valid}-NNNNN.npz`` shards of ``shard_size`` prompts. Shards are written atomically
and recorded as they complete; running the same command again skips recorded shards. A shard that
is missing, truncated or altered is reported by name when the data is loaded.

Arrays of a shard (n prompts, N nodes in all, V values in all):
``example`` int64 [n] (row of the part's examples), ``node_offsets`` int64 [n + 1],
``nodes`` int32 [N] (trie node ids, root first, ascending), ``value_offsets`` int64 [N + 1],
``values`` float16 [V] (the target's log-probs of each node's trie children, in the trie's child
order), ``seq_nodes`` int16 [n, K, L] (index of the prefix ``y_{<t}`` among the prompt's nodes),
``seq_tokens`` int32 [n, K, L], ``seq_scores`` float32 [n, K] (the target's sequence log-probs), ``gt_nodes`` int16 [n, L],
``gt_tokens`` int32 [n, L].
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.data import Dataset, Examples, split_dataset
from recspec.align.mixed import mixed_beam_search
from recspec.decoding.beam_search import TreeCache, beam_decode
from recspec.decoding.prompts import left_pad
from recspec.decoding.scorer import forward_prompt_and_tree, next_log_probs
from recspec.decoding.tree import ancestor_matrix, node_depths
from recspec.errors import RecspecError
from recspec.fileio import atomic_path, read_json, sha256_file, write_json_atomic
from recspec.itemids.index import ItemIndex
from recspec.itemids.trie import ItemTrie
from recspec.models.tokenizer import index_fingerprint
from recspec.models.checkpoint import INDEX_FILE
from recspec.recommend import Recommender, run_dataset

FORMAT = "recspec-align/1"
MANIFEST = "manifest.json"
PARTS = ("train", "valid")


@dataclass(frozen=True)
class DataConfig:
    """``k``: target sequences per prompt; ``max_prompts``: a seeded subsample of the training
    prompts (None: all); ``valid_prompts``: validation prompts (one target each);
    ``shard_size``: prompts per shard; ``batch_size``: prompts decoded together; ``mix_lambda``: the
    target's weight lambda in the sequences' mixture (1: the target alone; below 1 needs a draft)."""

    k: int = 20
    max_prompts: int | None = None
    valid_prompts: int = 512
    shard_size: int = 4096
    batch_size: int = 64
    seed: int = 0
    mix_lambda: float = 1.0

    def __post_init__(self) -> None:
        bad = [name for name, ok in {"k": self.k >= 1, "valid_prompts": self.valid_prompts >= 0,
                                     "shard_size": self.shard_size >= 1, "batch_size": self.batch_size >= 1,
                                     "max_prompts": self.max_prompts is None or self.max_prompts >= 1,
                                     "mix_lambda": 0.0 <= self.mix_lambda <= 1.0}.items()
               if not ok]
        if bad:
            raise RecspecError(f"bad alignment data option(s): {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


def part_examples(dataset: Dataset, split_kind: str | None, max_history: int, part: str,
                  config: DataConfig) -> Examples:
    """The prompts of ``part``: the training examples (seeded subsample), or the first
    ``valid_prompts`` validation users with their first target each."""
    split = split_dataset(dataset, split_kind, max_history)
    if part == "train":
        examples = split.train
        if config.max_prompts is not None and config.max_prompts < len(examples):
            rng = np.random.default_rng([config.seed, 4])
            examples = examples.subset(np.sort(rng.choice(len(examples), config.max_prompts, replace=False)))
        return examples
    return _first_targets(split.valid.subset(np.arange(min(config.valid_prompts, len(split.valid)))))


def _first_targets(examples: Examples) -> Examples:
    """One row per user: the user's first target only."""
    offsets = examples.target_offsets[:-1]
    return Examples(examples.users, examples.history, np.arange(len(examples) + 1, dtype=np.int64),
                    np.asarray(examples.target_items, dtype=np.int64)[offsets])


def prefix_nodes(trie: ItemTrie, tokens: torch.Tensor) -> torch.Tensor:
    """Trie node of every prefix ``tokens[..., :t]``, ``t = 0 .. L-1``: int64 ``[..., L]``."""
    shape = tokens.shape
    flat = tokens.reshape(-1, shape[-1])
    nodes = [torch.full((flat.shape[0],), trie.root, dtype=torch.int64, device=flat.device)]
    for t in range(shape[-1] - 1):
        nodes.append(trie.step(nodes[-1], flat[:, t]))
    return torch.stack(nodes, dim=1).view(shape)


def unique_rows(ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the distinct values of ``ids`` ``[B, A]`` ascending, padded with ``pad`` (larger than
    any id): ``([B, U] values, [B] counts)``."""
    ordered = ids.sort(dim=1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    counts = first.sum(dim=1)
    slot = first.long().cumsum(dim=1) - 1
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ordered)
    out = torch.full((ids.shape[0], int(counts.max())), pad, dtype=ids.dtype, device=ids.device)
    out[rows[first], slot[first]] = ordered[first]
    return out, counts


@dataclass(frozen=True)
class NodeTree:
    """The nodes of ``B`` prompts as one tree per prompt, for a forward pass after the prompts.

    ``nodes``: int64 ``[B, 1 + M]`` trie ids (column 0 the root, padding ``pad``); ``tokens``,
    ``parents`` (index among the ``M`` non-root nodes, ``-1`` under the root): int64 ``[B, M]``;
    ``real``: bool ``[B, 1 + M]``.
    """

    nodes: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    real: torch.Tensor

    @staticmethod
    def build(trie: ItemTrie, nodes: torch.Tensor, counts: torch.Tensor, pad_token: int) -> NodeTree:
        real = torch.arange(nodes.shape[1], device=nodes.device)[None, :] < counts[:, None]
        inner = nodes[:, 1:]
        safe = inner.masked_fill(~real[:, 1:], trie.root)
        parents = torch.searchsorted(nodes, trie.parent(safe)) - 1  # rows are ascending
        tokens = trie.last_token(safe)
        return NodeTree(nodes=nodes, tokens=tokens.masked_fill(~real[:, 1:], pad_token),
                        parents=parents.masked_fill(~real[:, 1:], -1), real=real)

    def visible(self, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tree_view(self.parents, prompt_mask)


def tree_view(parents: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For tree nodes fed after left-padded prompts (``parents`` int64 ``[B, M]``, ``-1`` under the
    prompt; ``prompt_mask`` ``[B, P]``): what each node sees, bool ``[B, M, P + M]`` (the prompt's
    real tokens, its ancestors, itself), and its depth ``[B, M]``."""
    ancestors = ancestor_matrix(parents)
    past = prompt_mask.bool()[:, None, :].expand(-1, ancestors.shape[1], -1)
    return torch.cat((past, ancestors), dim=2), node_depths(ancestors)


def children_values(trie: ItemTrie, log_probs: torch.Tensor, nodes: torch.Tensor,
                    real_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs ``[B, 1 + M, V]`` at the valid children of each node: ``(children [B, 1 + M, C],
    real [B, 1 + M, C], values [B, 1 + M, C])`` (``-inf`` on padding)."""
    batch, width = nodes.shape
    children, real = trie.children(nodes.masked_fill(~real_nodes, -1).view(-1))
    children, real = children.view(batch, width, -1), real.view(batch, width, -1)
    values = log_probs.gather(2, children).masked_fill(~real, -torch.inf)
    return children, real, values


@torch.inference_mode()
def _decode_batch(recommender: Recommender, examples: Examples, rows: np.ndarray, k: int,
                  mix_lambda: float) -> dict[str, np.ndarray]:
    """Alignment records of the examples ``rows``: the shard arrays of those prompts."""
    model, trie, encoder = recommender.model, recommender.trie, recommender.encoder
    prompts = encoder.prompts(examples, rows)
    device = model.device
    padded = left_pad(prompts, encoder.pad_id, device)
    if mix_lambda < 1.0:
        topk = mixed_beam_search(model, recommender.draft, padded, trie, k, mix_lambda)
    else:  # tree_beam_search on the batch padded once for both uses
        topk = beam_decode(TreeCache, model, padded, trie, k)
    answers = encoder.answer_tokens(examples.target_items[examples.target_offsets[rows]]).to(device)
    seq_ids, gt_ids = prefix_nodes(trie, topk.tokens), prefix_nodes(trie, answers)
    batch, length = answers.shape
    pad_id = trie.num_nodes
    nodes, counts = unique_rows(torch.cat((seq_ids.view(batch, -1), gt_ids), dim=1), pad_id)
    tree = NodeTree.build(trie, nodes, counts, encoder.pad_id)
    visible, depths = tree.visible(padded.attention_mask)
    logits = forward_prompt_and_tree(model, None, padded.input_ids, padded.attention_mask, padded.position_ids,
                                     tree.tokens, visible, padded.lengths[:, None] + depths)
    log_probs = next_log_probs(logits)
    _, real, values = children_values(trie, log_probs, nodes, tree.real)
    node_counts = counts.cpu().numpy()
    kept_values = values[real & tree.real[:, :, None]]
    seq_at = torch.searchsorted(nodes, seq_ids.view(batch, -1)).view(batch, k, length)
    seq_tokens, seq_scores = topk.tokens, topk.scores
    if mix_lambda < 1.0:  # the target's sequence log-probs, and its order
        token_log_probs = log_probs[torch.arange(batch, device=device)[:, None, None], seq_at, seq_tokens]
        seq_scores, order = token_log_probs.sum(dim=2).sort(dim=1, descending=True, stable=True)
        seq_at = seq_at.gather(1, order[:, :, None].expand(-1, -1, length))
        seq_tokens = seq_tokens.gather(1, order[:, :, None].expand(-1, -1, length))
    return {
        "example": np.asarray(rows, dtype=np.int64),
        "node_counts": node_counts,
        "nodes": nodes[tree.real].cpu().numpy().astype(np.int32),
        "value_counts": real[tree.real].sum(dim=1).cpu().numpy(),
        "values": kept_values.cpu().numpy().astype(np.float16),
        "seq_nodes": seq_at.cpu().numpy().astype(np.int16),
        "seq_tokens": seq_tokens.cpu().numpy().astype(np.int32),
        "seq_scores": seq_scores.cpu().numpy().astype(np.float32),
        "gt_nodes": torch.searchsorted(nodes, gt_ids).cpu().numpy().astype(np.int16),
        "gt_tokens": answers.cpu().numpy().astype(np.int32),
    }


def _write_shard(path: Path, records: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Concatenate batch records into one shard file (atomically); its manifest entry."""
    merged = {key: np.concatenate([r[key] for r in records]) for key in records[0]}
    node_counts, value_counts = merged.pop("node_counts"), merged.pop("value_counts")
    merged["node_offsets"] = np.concatenate(([0], np.cumsum(node_counts))).astype(np.int64)
    merged["value_offsets"] = np.concatenate(([0], np.cumsum(value_counts))).astype(np.int64)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **merged)
    return {"file": path.name, "prompts": int(len(merged["example"])), "bytes": path.stat().st_size,
            "sha256": sha256_file(path)}


def provenance(recommender: Recommender, target_dir: Path, k: int, draft_dir: Path | None = None) -> dict[str, Any]:
    """What the data depends on: refused for mixing when any of it differs (the mixing draft's
    weights too, when there is one)."""
    from recspec.models.checkpoint import WEIGHTS_FILE, trained_model_dir

    mixing = {} if draft_dir is None else {
        "mix_draft": str(Path(draft_dir).resolve()),
        "mix_draft_sha256": sha256_file(trained_model_dir(draft_dir) / WEIGHTS_FILE)}
    return {**mixing, "format": FORMAT, "target": str(Path(target_dir).resolve()),
            "target_sha256": sha256_file(trained_model_dir(target_dir) / WEIGHTS_FILE),
            "index_fingerprint": index_fingerprint(recommender.index), "dataset": recommender.info["dataset"],
            "format_of_dataset": recommender.info.get("format"), "split": recommender.info.get("split"),
            "max_history": recommender.info.get("max_history", 20), "preset": recommender.info.get("preset"),
            "only_indexed_items": recommender.info.get("only_indexed_items"),
            "prompt": recommender.encoder.template.to_json(), "k": k}


def manifest_dataset(manifest: dict[str, Any], index: ItemIndex) -> Dataset:
    """The data set alignment data was made on, as its target saw it (:func:`~recspec.recommend.run_dataset`)."""
    return run_dataset({"dataset": manifest["dataset"], "format": manifest.get("format_of_dataset"),
                        "only_indexed_items": manifest.get("only_indexed_items")}, index)


def generate_alignment_data(target_dir: Path, out_dir: Path, config: DataConfig = DataConfig(), device: str = "cpu",
             progress: bool = True, mix_draft: Path | None = None) -> dict[str, Any]:
    """Write (or complete) the alignment data of a trained target into ``out_dir``; the manifest.
    ``mix_draft``: the draft of the target-mixed sequences (needed exactly when
    ``config.mix_lambda < 1``)."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    if (mix_draft is None) != (config.mix_lambda == 1.0):
        raise RecspecError("target-mixed sequences need both a mixing draft and mix_lambda below 1; "
                           f"got mix_lambda={config.mix_lambda} and {'a' if mix_draft else 'no'} draft")
    recommender = Recommender.load(target_dir, device=device, draft_dir=mix_draft)
    if config.k > recommender.trie.num_items:
        raise RecspecError(f"k={config.k} exceeds the number of items ({recommender.trie.num_items})")
    made_by = provenance(recommender, target_dir, config.k, mix_draft)
    manifest_path = out_dir / MANIFEST
    manifest: dict[str, Any] = {**made_by, "config": vars(config), "shards": {part: [] for part in PARTS},
                                "seconds": 0.0}
    if manifest_path.is_file():
        manifest = read_json(manifest_path)
        differ = [key for key, value in made_by.items() if manifest.get(key) != value]
        if differ or {**vars(DataConfig()), **manifest.get("config", {})} != vars(config):
            raise RecspecError(f"{out_dir}: holds alignment data made by another target, data set or setting "
                               f"({', '.join(differ) or 'options'} differ); choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    recommender.index.save(out_dir / INDEX_FILE)  # the draft's identifiers come from here
    for part in PARTS:
        examples = part_examples(recommender.dataset, recommender.info.get("split"),
                                 recommender.info.get("max_history", 20), part, config)
        order = np.argsort(recommender.encoder.prompt_lengths(examples), kind="stable")  # less padding
        done = {entry["file"] for entry in manifest["shards"][part]}
        shards = [order[i:i + config.shard_size] for i in range(0, len(order), config.shard_size)]
        bar = tqdm(total=len(order), desc=f"alignment data ({part})", unit="prompt", disable=not progress,
                   initial=sum(len(s) for i, s in enumerate(shards) if f"{part}-{i:05d}.npz" in done))
        for number, shard in enumerate(shards):
            name = f"{part}-{number:05d}.npz"
            if name in done:
                continue
            started = time.perf_counter()
            records = []
            for start in range(0, len(shard), config.batch_size):
                rows = shard[start:start + config.batch_size]
                records.append(_decode_batch(recommender, examples, rows, config.k, config.mix_lambda))
                bar.update(len(rows))
            entry = _write_shard(out_dir / name, records)
            manifest["shards"][part].append(entry)
            manifest["seconds"] += time.perf_counter() - started
            write_json_atomic(manifest_path, manifest)
        bar.close()
    manifest["complete"] = True
    write_json_atomic(manifest_path, manifest)
    return manifest
