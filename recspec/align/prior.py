"""`recspec align prior`: fit a target prior (:mod:`recspec.decoding.target_prior`) on a trained
target's own beam search over a seeded subsample of its training prompts, and save it as a folder
fingerprinted to that target (``--draft`` then takes the folder).

The fit is one exact beam search (``K`` beams, tree attention) per prompt, in batches of
similar-length prompts; it writes nothing until it is done (an interrupted fit is run again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recspec.align.data import DataConfig, part_examples
from recspec.decoding.target_prior import empty_weights, fit_prior, save_prior
from recspec.errors import RecspecError
from recspec.models.head import head_fingerprint
from recspec.recommend import Recommender


@dataclass(frozen=True)
class PriorFit:
    """What :func:`fit_target_prior` did: prompts fitted, seconds, and the share of the trie's
    inner nodes (root excluded) that some fitted beam reached, per identifier level."""

    prompts: int
    seconds: float
    reached: tuple[float, ...]


def fit_target_prior(target_dir: Path, out: Path, users: int = 2000, k: int = 10, batch_size: int = 64,
                     seed: int = 0, device: str = "cpu", progress: bool = True) -> PriorFit:
    """Fit the prior of the target in ``target_dir`` on ``users`` training prompts (a seeded
    subsample; all if fewer) with ``k`` beams, and write it to ``out`` (replaced whole)."""
    from tqdm.auto import tqdm

    if min(users, k, batch_size) < 1:
        raise RecspecError(f"users, k and batch size must be positive, got {users}, {k}, {batch_size}")
    recommender = Recommender.load(target_dir, device=device, k=k)
    examples = part_examples(recommender.dataset, recommender.info.get("split"),
                             recommender.info.get("max_history", 20), "train", DataConfig(max_prompts=users, seed=seed))
    prompts = recommender.encoder.prompts(examples)
    order = np.argsort([len(prompt) for prompt in prompts], kind="stable")  # less padding
    trie, weights = recommender.trie, empty_weights(recommender.trie)
    started = time.perf_counter()
    with tqdm(total=len(prompts), desc="target prior", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            batch = [prompts[i] for i in order[start:start + batch_size]]
            fit_prior(recommender.model, batch, trie, k, recommender.encoder.pad_id, batch_size, weights)
            bar.update(len(batch))
    seconds = time.perf_counter() - started
    reached = reached_share(weights, trie)
    save_prior(out, weights, head_fingerprint(recommender.folder, recommender.index),
               {"k": k, "prompts": len(prompts), "seed": seed, "seconds": round(seconds, 1),
                "reached_per_level": [round(share, 4) for share in reached]})
    return PriorFit(len(prompts), seconds, reached)


def reached_share(weights: torch.Tensor, trie) -> tuple[float, ...]:
    """Per identifier level ``1 .. L - 1``: the share of that level's trie nodes whose children
    some fitted beam weighed (``weights``: float ``[num_nodes]`` from :func:`fit_prior`)."""
    nodes = torch.arange(1, trie.num_nodes, device=trie.device)
    parents = trie.parent(nodes)
    fitted = torch.zeros(trie.num_nodes, dtype=torch.float64, device=trie.device)
    fitted.index_add_(0, parents, weights[nodes] - empty_weights(trie)[nodes])
    depth = trie.node_depth(torch.arange(trie.num_nodes, device=trie.device))
    return tuple(float((fitted[depth == level] > 0).double().mean()) for level in range(1, trie.depth))
