"""Tree attention: masks and position ids for verifying a token tree in one forward pass.

A *token tree* hangs off a *prefix* (a user's prompt, already in the KV cache) and is stored
flattened: ``N`` nodes per row, each with a parent index in ``[-1, N)`` (``-1``: the node follows
the prefix directly). Its ``depth`` is the number of tree nodes above it (``0`` for children of
the prefix), so its position id is ``prefix length + depth``, exactly the position it would have in
an ordinary left-to-right sequence of its own path. A node attends to the prefix's real tokens, to
its ancestors and to itself, never to siblings or cousins; then every root-to-node path is
computed exactly as if it were the only continuation of the prefix.

**One representation.** What a node sees is a bool matrix over the cached positions and the nodes
fed with it (``visible[b, i, j]``: node ``i`` of row ``b`` attends to position ``j``), whatever the
decoder: a whole tree (:func:`ancestor_matrix`, :func:`tree_rows`), one layer at a time as beam
search and the draft levels grow (:func:`child_rows`), a chain of text tokens (a tree whose
ancestors are the lower triangle). :func:`~recspec.decoding.scorer.forward_visible` turns it into
the model's mask.

Masks follow transformers 5.x for custom 4D masks: an *additive* float mask of the model's dtype,
``0`` where attention is allowed and ``torch.finfo(dtype).min`` where it is blocked, passed with
explicit ``position_ids``. transformers returns a 4D mask unchanged to the attention function;
``eager`` attention *adds* it to the attention scores (a bool mask would add 0/1 and block nothing)
and ``sdpa`` accepts an additive float mask as well, so additive masks are right under both.

Two ways to build the rows of a tree:

* all at once, for a whole tree of any shape (e.g. a retrieved tree to verify):
  :func:`ancestor_matrix` then :func:`tree_rows` (and :func:`node_depths` for positions);
* one layer at a time, when each layer's nodes are children of the previous layer's nodes (beam
  search, where the tree grows by ``K`` nodes per step): :func:`child_rows`, which costs one
  gather per layer instead of rebuilding the tree.
"""

from __future__ import annotations

import torch

from recspec.accel.packed_attention import additive_mask


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """Which nodes each node may attend to: bool ``[B, N, N]``.

    ``parents``: int64 ``[B, N]``, the parent index of each node in ``[-1, N)`` (``-1``: a child
    of the prefix); the parent links must form a forest (no cycles), in any node order.
    Entry ``[b, i, j]`` is True iff node ``j`` is node ``i`` or one of its ancestors.

    Pointer doubling: after round ``r`` every node knows its ancestors less than ``2**r`` steps
    up, so ``ceil(log2 N)`` rounds of one batched gather each cover any depth (``N - 1`` at most).
    """
    parents = parents.long()
    batch, n = parents.shape
    device = parents.device
    # Row ``n`` is a virtual empty node standing for "above the tree": jumping there adds nothing.
    known = torch.zeros(batch, n + 1, n, dtype=torch.bool, device=device)
    known[:, :n] = torch.eye(n, dtype=torch.bool, device=device)
    jump = torch.cat(
        (parents.masked_fill(parents < 0, n), torch.full((batch, 1), n, device=device)), dim=1
    )  # [B, N + 1]: the node 2**r steps up (the virtual node once past the top)
    for _ in range((n - 1).bit_length()):
        known = known | known.gather(1, jump[:, :, None].expand(-1, -1, n))
        jump = jump.gather(1, jump)
    return known[:, :n]


def node_depths(ancestors: torch.Tensor) -> torch.Tensor:
    """Depth of each node (``0`` for children of the prefix): int64 ``[B, N]``, from the
    :func:`ancestor_matrix` ``[B, N, N]``."""
    return ancestors.sum(dim=-1) - 1


def tree_position_ids(prefix_lengths: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Position ids of tree nodes: int64 ``[B, N]`` = ``prefix_lengths[b] + depths[b, n]``.

    ``prefix_lengths``: int64 ``[B]``, the number of *real* (non-padding) prefix tokens, i.e.
    the position the first generated token gets in Hugging Face generate
    (``attention_mask.cumsum(-1) - 1`` continued); ``depths``: int64 ``[B, N]`` or ``[1, N]``.
    """
    return prefix_lengths[:, None] + depths


def tree_rows(past_visible: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """What each of ``N`` tree nodes fed together after ``P`` cached positions sees: bool
    ``[B, N, P + N]``.

    ``past_visible``: bool ``[B, P]`` (the same for every node: e.g. a prompt, False on left
    padding) or ``[B, N, P]`` (per node: e.g. the prompt plus the cached ancestors of the node's
    root, when trees hang off different cached beams); ``ancestors``: bool ``[B, N, N]`` from
    :func:`ancestor_matrix`, the tree nodes fed in this forward pass, in cache order (a chain of
    ``N`` tokens is the lower triangle).
    """
    batch, n, _ = ancestors.shape
    if past_visible.dim() == 2:
        past_visible = past_visible[:, None, :].expand(batch, n, -1)
    return torch.cat((past_visible, ancestors), dim=2)


def tree_attention_mask(
    past_visible: torch.Tensor, ancestors: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive 4D mask ``dtype`` ``[B, 1, N, P + N]`` of :func:`tree_rows` (for calling a model
    directly; recspec's decoders call :func:`~recspec.decoding.scorer.forward_visible`)."""
    return additive_mask(tree_rows(past_visible, ancestors), dtype)[:, None]


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[b, index[b, i]]``: ``[B, n, ...]`` from ``rows`` ``[B, M, ...]`` and int64 ``index``
    ``[B, n]`` (each node's row of its parent's level, each beam's of its parent node)."""
    return rows.gather(1, index.view(*index.shape, *([1] * (rows.dim() - 2))).expand(-1, -1, *rows.shape[2:]))


def child_rows(parent_rows: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """What a new layer of ``N`` tree nodes, appended after ``T`` positions, sees: bool
    ``[B, N, T + N]``.

    ``parent_rows``: bool ``[B, S, T]``, what the ``S`` nodes of the previous layer see (the
    prefix's visibility with ``S = 1`` for the first layer, or nodes that see themselves);
    ``parents``: int64 ``[B, N]`` in ``[0, S)``, the previous-layer node each new node continues.
    New node ``n`` sees what its parent sees (the prefix, its parent's ancestors and, when the
    parent was fed, the parent itself) and itself. One gather per layer; the result is the
    ``parent_rows`` of the next layer.
    """
    batch, n = parents.shape
    inherited = gather_rows(parent_rows, parents)
    own = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n)
    return torch.cat((inherited, own), dim=2)
