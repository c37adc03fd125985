"""Prefix trie over item identifiers, stored as flat tensors for batched constrained decoding.

Every item is identified by ``L`` model-vocabulary tokens. The trie has one node per distinct
prefix of every depth ``0..L``; node ids are assigned breadth-first and, within a depth, in
lexicographic order of the prefixes:

* node ``0`` is the root (the empty prefix), then come all depth-1 prefixes, then all depth-2
  prefixes, and so on; the leaves (depth ``L``) are the last ``num_items`` nodes.
* Because parents are numbered in the same order as their children, the children of every node
  are consecutive node ids, sorted by token. Every non-root node is the target of exactly one
  edge, so edge ``e`` (``0 <= e < num_nodes - 1``) leads to node ``e + 1``.

Flat tensors, all int64 (``N`` nodes, ``E = N - 1`` edges, ``V`` vocabulary size):

* ``_spans [N + 1, 3]``: per node its first edge ``f``, its last child slot (``count - 1``, at
  least ``0``) and its child count: the children of node ``n`` are edges ``f .. f + count - 1``
  (child node ids ``f + 1 .. f + count``). A last row of zeros is what node ``-1`` reads (negative
  indexing), so that :meth:`ItemTrie.children` is a few gathers with no masking of dead nodes.
* ``_edge_tokens [E + 1]``: the token of each edge, then one filler, read by the leaves numbered
  last, whose first edge is ``E``; ``_slots [C_max]``: ``0 .. C_max - 1``.
* ``_keys [E]``: ``parent * V + token`` of each edge. Parents are non-decreasing over edges and
  tokens strictly increase among siblings, so the keys are strictly increasing and
  :meth:`ItemTrie.step` is one ``torch.searchsorted`` for the whole batch.
* ``_node_depth [N]``: the depth of each node; ``_node_item [N]``: the item index of each leaf,
  ``-1`` for inner nodes.

Node ``-1`` stands for "not a prefix of any item" and propagates through every method.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

_TENSORS = ("_spans", "_edge_tokens", "_slots", "_keys", "_node_depth", "_node_item")


class ItemTrie:
    """Prefix trie over the identifiers of all items, as flat tensors (CPU or CUDA).

    Batched methods take node ids of shape ``[B]`` (int64, on the trie's device, each in
    ``[-1, num_nodes)``) and never loop over the batch in Python.
    """

    depth: int
    num_items: int
    num_nodes: int
    vocab_size: int
    root: int = 0

    def __init__(self, codes: torch.Tensor, vocab_size: int, item_ids: torch.Tensor | None = None) -> None:
        """Build the trie from ``codes``, int ``[num_items, L]``; row ``i`` holds item ``i``'s ids,
        or those of item ``item_ids[i]`` when given (int ``[num_items]``: a trie over some of the
        items that still reports their index rows, e.g. the catalogue less excluded items).

        The trie's tensors are placed on ``codes.device``. Raises ``ValueError`` for input that is
        not a non-empty 2-D integer tensor, for ids outside ``[0, vocab_size)`` and for two items
        with the same identifier.
        """
        codes = torch.as_tensor(codes)
        device = codes.device
        if codes.dim() != 2:
            raise ValueError(f"codes must be 2-D [num_items, L], got shape {tuple(codes.shape)}")
        if codes.numel() == 0:
            raise ValueError(f"codes must be non-empty, got shape {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"codes must hold integer token ids, got dtype {codes.dtype}")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        codes = codes.to("cpu", torch.int64)
        bad = ((codes < 0) | (codes >= vocab_size)).any(dim=1).nonzero()
        if len(bad):
            item = int(bad[0])
            raise ValueError(
                f"item {item} has token ids {codes[item].tolist()} outside [0, {vocab_size})"
            )

        num_items, depth = codes.shape
        order = torch.from_numpy(np.lexsort(codes.numpy().T[::-1]).astype(np.int64))
        ordered = codes[order]
        # differs[i, d]: sorted item i + 1 differs from sorted item i in its first d + 1 tokens.
        differs = (ordered[1:] != ordered[:-1]).cumsum(dim=1) > 0
        dup = (~differs[:, -1]).nonzero()
        if len(dup):
            i = int(dup[0])
            first, second = sorted((int(order[i]), int(order[i + 1])))
            raise ValueError(
                f"items {first} and {second} have the same identifier {codes[first].tolist()}"
            )

        parents, tokens, depths = [], [], []
        node_of_item = torch.zeros(num_items, dtype=torch.int64)  # depth-d node of sorted item
        next_id = 1
        for d in range(depth):
            starts = torch.cat((torch.ones(1, dtype=torch.bool), differs[:, d]))
            parents.append(node_of_item[starts])
            tokens.append(ordered[starts, d])
            node_of_item = next_id + starts.cumsum(0) - 1
            next_id += len(tokens[-1])
            depths.append(torch.full((len(tokens[-1]),), d + 1, dtype=torch.int64))
        edge_parent = torch.cat(parents)

        self.depth = depth
        self.num_items = num_items
        self.num_nodes = next_id
        self.vocab_size = vocab_size
        child_tokens = torch.cat(tokens)
        self._keys = edge_parent * vocab_size + child_tokens
        offsets = torch.searchsorted(edge_parent, torch.arange(next_id + 1))  # CSR: node n's edges start here
        counts = offsets[1:] - offsets[:-1]
        self._max_children = int(counts.max())
        self._spans = torch.cat((torch.stack((offsets[:-1], (counts - 1).clamp(min=0), counts), dim=1),
                                 torch.zeros(1, 3, dtype=torch.int64)))
        self._edge_tokens = torch.cat((child_tokens, torch.zeros(1, dtype=torch.int64)))
        self._slots = torch.arange(self._max_children)
        self._node_depth = torch.cat([torch.zeros(1, dtype=torch.int64), *depths])
        self._node_item = torch.full((next_id,), -1, dtype=torch.int64)
        self._node_item[node_of_item] = order if item_ids is None else torch.as_tensor(item_ids).cpu().long()[order]
        for name in _TENSORS:
            setattr(self, name, getattr(self, name).to(device))

    @property
    def device(self) -> torch.device:
        """The device the trie's tensors (and the inputs of its methods) live on."""
        return self._keys.device

    def to(self, device: torch.device | str) -> ItemTrie:
        """A copy of the trie whose tensors live on ``device``."""
        moved = copy.copy(self)
        for name in _TENSORS:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def step(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Child reached by appending ``tokens[b]`` to ``nodes[b]``'s prefix: int64 ``[B]``.

        ``-1`` where the input node is ``-1`` or the token (any integer) does not continue the
        prefix towards an item.
        """
        nodes, tokens = nodes.long(), tokens.long()
        keys = nodes * self.vocab_size + tokens
        edge = torch.searchsorted(self._keys, keys).clamp(max=len(self._keys) - 1)
        in_range = (nodes >= 0) & (tokens >= 0) & (tokens < self.vocab_size)
        return torch.where(in_range & (self._keys[edge] == keys), edge + 1, -1)

    def walk(self, prefixes: torch.Tensor) -> torch.Tensor:
        """Node of each prefix in ``prefixes``, int ``[B, d]``: int64 ``[B]``, ``-1`` if none."""
        if prefixes.dim() != 2:
            raise ValueError(f"prefixes must be 2-D [B, d], got shape {tuple(prefixes.shape)}")
        nodes = torch.full(
            (prefixes.shape[0],), self.root, dtype=torch.int64, device=prefixes.device
        )
        for d in range(prefixes.shape[1]):
            nodes = self.step(nodes, prefixes[:, d])
        return nodes

    def prefix_nodes(self, other: ItemTrie) -> torch.Tensor:
        """This trie's node with the prefix of each node of ``other`` (e.g. a trie over some of the
        same identifiers: the catalogue less excluded items): int64 ``[other.num_nodes]`` on this
        trie's device, ``-1`` where this trie lacks the prefix.

        One pass per depth, no prefix spelled out: ``other``'s nodes of a depth are their parents'
        nodes here stepped by their last tokens, and the parents (one depth up) are done already.
        """
        other = other if other.device == self.device else other.to(self.device)
        nodes = torch.arange(other.num_nodes, device=self.device)
        depths, parents, tokens = other.node_depth(nodes), other.parent(nodes), other.last_token(nodes)
        mapped = torch.zeros_like(nodes)  # the root's, the empty prefix: the root; the others are set below
        for d in range(1, other.depth + 1):
            at = depths == d
            mapped[at] = self.step(mapped[parents[at]], tokens[at])
        return mapped

    def parent(self, nodes: torch.Tensor) -> torch.Tensor:
        """Parent of each non-root node (the prefix one token shorter): int64 ``[B]``; ``-1`` for
        the root and for ``-1``."""
        edge = (nodes.long() - 1).clamp(min=0)
        return torch.where(nodes > self.root, self._keys[edge] // self.vocab_size, -1)

    def last_token(self, nodes: torch.Tensor) -> torch.Tensor:
        """Last token of each non-root node's prefix: int64 ``[B]``; ``-1`` for the root and ``-1``."""
        edge = (nodes.long() - 1).clamp(min=0)
        return torch.where(nodes > self.root, self._keys[edge] % self.vocab_size, -1)

    def node_depth(self, nodes: torch.Tensor) -> torch.Tensor:
        """Prefix length of each node: int64 ``[B]``, ``-1`` for node ``-1``."""
        return torch.where(nodes >= 0, self._node_depth[nodes.clamp(min=0)], -1)

    def items(self, nodes: torch.Tensor) -> torch.Tensor:
        """Item index of each leaf node (depth ``L``): int64 ``[B]``, ``-1`` for other nodes."""
        return self._node_item[nodes.clamp(min=0)]  # -1 reads the root's entry, also -1

    def allowed_mask(self, nodes: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, V]``: True where the token continues ``nodes[b]`` towards an item.

        All False for node ``-1`` and for leaves.
        """
        columns, has_children = self._mask_columns(nodes)
        mask = torch.zeros(len(nodes), self.vocab_size, dtype=torch.bool, device=nodes.device)
        # Rows without children write False onto arbitrary columns, which changes nothing.
        return mask.scatter_(1, columns, has_children[:, None].expand_as(columns))

    def additive_mask(
        self, nodes: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``[B, V]`` of ``dtype``: 0 where :meth:`allowed_mask` is True, else ``finfo(dtype).min``.

        Built directly, without an intermediate bool mask.
        """
        lowest = torch.finfo(dtype).min
        columns, has_children = self._mask_columns(nodes)
        mask = torch.full((len(nodes), self.vocab_size), lowest, dtype=dtype, device=nodes.device)
        fill = torch.zeros(len(nodes), dtype=dtype, device=nodes.device)
        fill.masked_fill_(~has_children, lowest)  # rows without children rewrite ``lowest``
        return mask.scatter_(1, columns, fill[:, None].expand_as(columns))

    def first_tokens(self) -> torch.Tensor:
        """The first identifier tokens, the root's children: int64 ``[F]``, in increasing order
        (trie nodes ``1..F``, see the module doc)."""
        tokens, real = self.children(torch.tensor([self.root], device=self.device))
        return tokens[0][real[0]]

    def children(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid next tokens of each node, padded to ``C`` = the most children among ``nodes``.

        Returns ``(tokens, real)``, int64 and bool ``[B, C]``: row ``b`` holds node ``b``'s child
        tokens in increasing order, then pad token ``0`` where ``real`` is False. Computing ``C``
        reads one number back from the device.
        """
        tokens, real, _ = self.child_edges(nodes)
        return tokens, real

    def child_edges(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`children` and the node each child token leads to: ``(tokens, real, children)``,
        int64, bool and int64 ``[B, C]`` (``children`` is meaningless where ``real`` is False), so
        that a beam step reads its new nodes instead of searching for them (:meth:`step`)."""
        tokens, count, edge = self._padded_children(nodes, width=None)
        real = self._slots[:tokens.shape[1]] < count[:, None]
        return tokens.masked_fill_(~real, 0), real, edge + 1

    def _mask_columns(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocabulary columns to scatter into each mask row, int64 ``[B, W]``, and bool ``[B]``,
        whether the node has children (see :meth:`_padded_children`).

        On CPU, reading the batch's largest fan-out back is free and keeps the gather small; on an
        accelerator it would stall the stream, so ``W`` is the trie's largest fan-out there (at
        most ``V``, so never more work than filling the mask).
        """
        width = None if nodes.device.type == "cpu" else self._max_children
        tokens, count, _ = self._padded_children(nodes, width)
        return tokens, count > 0

    def _padded_children(
        self, nodes: torch.Tensor, width: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Child tokens of each node in ``W`` slots, int64 ``[B, W]``, child counts, ``[B]``, and the
        edge of each slot, ``[B, W]`` (edge ``e`` leads to node ``e + 1``).

        ``W`` is ``width`` (at least every count) or, if None, the largest count among ``nodes``.
        Slots past a node's last child repeat that child; a node without children (a leaf or
        ``-1``) gets arbitrary tokens.
        """
        spans = self._spans[nodes.long()]  # node -1 reads the last row: no children
        count = spans[:, 2]
        if width is None:
            width = int(count.max()) if len(nodes) else 0
        edge = spans[:, :1] + torch.minimum(self._slots[:width], spans[:, 1:2])
        return self._edge_tokens[edge], count, edge
