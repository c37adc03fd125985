"""Tree attention: masks and position ids for verifying a token tree in one forward pass.

A *token tree* hangs off a *prefix* (a user's prompt, already in the KV cache) and is stored
flattened: ``N`` nodes per row, each with a parent index in ``[-1, N)`` (``-1``: the node follows
the prefix directly). Its ``depth`` is the number of tree nodes above it (``0`` for children of
the prefix), so its position id is ``prefix length + depth``, exactly the position it would have in
an ordinary left-to-right sequence of its own path. A node attends to the prefix's real tokens, to
its ancestors and to itself, never to siblings or cousins; then every root-to-node path is
computed exactly as if it were the only continuation of the prefix.

Masks follow transformers 5.x for custom 4D masks: an *additive* float mask of the model's dtype,
``0`` where attention is allowed and ``torch.finfo(dtype).min`` where it is blocked, passed with
explicit ``position_ids``. transformers returns a 4D mask unchanged to the attention function;
``eager`` attention *adds* it to the attention scores (a bool mask would add 0/1 and block nothing)
and ``sdpa`` accepts an additive float mask as well, so additive masks are right under both.

Two ways to build the rows of a tree in the mask:

* all at once, for a whole tree of any shape (e.g. a draft tree to verify):
  :func:`ancestor_matrix` then :func:`tree_attention_mask` (and :func:`node_depths` for positions);
* one layer at a time, when each layer's nodes are children of the previous layer's nodes (beam
  search, where the tree grows by ``K`` nodes per step): :func:`append_children`, which costs one
  gather per layer instead of rebuilding the tree.
"""

from __future__ import annotations

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask of ``dtype`` with ``visible``'s shape: ``0`` where ``visible`` (bool)
    is True, ``torch.finfo(dtype).min`` where it is False."""
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return blocked.masked_fill_(visible, 0.0)


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


def tree_attention_mask(
    past_visible: torch.Tensor, ancestors: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive 4D mask for a forward pass that feeds a whole tree after ``P`` cached positions.

    ``past_visible``: bool ``[B, P]`` (the same for every node: e.g. a prompt, False on left
    padding) or ``[B, N, P]`` (per node: e.g. the prompt plus the cached ancestors of the node's
    root, when trees hang off different cached beams); ``ancestors``: bool ``[B, N, N]`` from
    :func:`ancestor_matrix`, the tree nodes fed in this forward pass, in cache order.
    Returns ``dtype`` ``[B, 1, N, P + N]``.
    """
    batch, n, _ = ancestors.shape
    if past_visible.dim() == 2:
        past_visible = past_visible[:, None, :].expand(batch, n, -1)
    visible = torch.cat((past_visible, ancestors), dim=2)
    return additive_mask(visible, dtype)[:, None]


def self_only_rows(n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Additive mask block ``[n, n]`` of ``dtype`` in which each of ``n`` sibling nodes fed
    together attends only to itself (``0`` on the diagonal, ``finfo(dtype).min`` elsewhere)."""
    return additive_mask(torch.eye(n, dtype=torch.bool, device=device), dtype)


def append_children(
    parent_rows: torch.Tensor, parents: torch.Tensor, self_rows: torch.Tensor
) -> torch.Tensor:
    """Mask rows of a new layer of ``N`` tree nodes appended after ``T`` cached positions.

    ``parent_rows``: additive ``[B, S, T]``, the mask rows of the ``S`` nodes of the previous
    layer over the ``T`` cached positions (for the first layer: ``S = 1``, the prefix's
    visibility); ``parents``: int64 ``[B, N]`` in ``[0, S)``, the previous-layer node each new node
    continues; ``self_rows``: ``[N, N]`` from :func:`self_only_rows` (built once, reused for
    every layer).

    Returns additive ``[B, N, T + N]``: new node ``n`` sees what its parent sees (its parent's
    ancestors and the prefix), its parent itself (its own diagonal entry in ``parent_rows``) and
    itself. The result is the ``parent_rows`` of the next layer; ``[:, None]`` makes it the 4D mask
    of the forward pass that feeds the new layer.
    """
    batch, n = parents.shape
    inherited = parent_rows.gather(1, parents[:, :, None].expand(-1, -1, parent_rows.shape[2]))
    return torch.cat((inherited, self_rows.expand(batch, n, n)), dim=2)
