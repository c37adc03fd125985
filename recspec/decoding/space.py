"""Free text as a candidate space, so that the beam machinery of the item decoders (beams,
beam sampling, DSBD's rounds) runs over a vocabulary instead of an item trie.

Every live prefix may continue with any token; a prefix that ends with the end token is
*finished* and continues with it at probability 1 (so finished beams keep their score and keep
competing); generation stops at ``depth`` tokens or when every beam of a row is finished.

A draft whose distribution is zero outside a draft vocabulary (a text head's reduced output layer)
drafts over :meth:`FreeText.restricted`: the same text with only those tokens (and the end token)
as candidates, so that its per-layer work runs over ``|D|`` instead of ``V`` tokens a beam.
"""

from __future__ import annotations

import torch


class FreeText:
    """The candidate space of text generation (the interface of
    :class:`~recspec.itemids.trie.ItemTrie` that beam sampling and DSBD use): node ``0`` is a live
    prefix, ``1`` a finished one (it ended with ``eos``), ``-1`` a dead beam; ``depth`` is the
    number of tokens to generate."""

    root = 0

    def __init__(self, vocab_size: int, depth: int, eos: int | None, device: torch.device | str = "cpu",
                 tokens: torch.Tensor | None = None) -> None:
        self.vocab_size, self.depth, self.eos = vocab_size, depth, eos
        self._tokens = torch.arange(vocab_size, device=device) if tokens is None else tokens.to(device)
        # the end token's column among the candidates (its id over the whole vocabulary)
        self._eos_column = None if eos is None else int(torch.searchsorted(self._tokens, eos))

    @property
    def tokens(self) -> torch.Tensor:
        """int64 ``[C]``: the candidate tokens after every live node, ascending (``C = V`` unless
        :meth:`restricted`)."""
        return self._tokens

    def restricted(self, tokens: torch.Tensor) -> FreeText:
        """The same text with only ``tokens`` (int64 ``[D]``, distinct ids) and the end token as
        candidates, ascending."""
        keep = tokens.to(self.device) if self.eos is None else torch.cat(
            (tokens.to(self.device), torch.tensor([self.eos], device=self.device)))
        return FreeText(self.vocab_size, self.depth, self.eos, self.device, torch.unique(keep))

    @property
    def device(self) -> torch.device:
        return self._tokens.device

    def children(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token for every node: int64 and bool ``[N, V]`` (nothing for a dead node)."""
        tokens = self._tokens.repeat(len(nodes), 1)
        return tokens, (nodes >= 0)[:, None].expand_as(tokens)

    def step(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The node after appending ``tokens`` ``[N]`` to ``nodes`` ``[N]``."""
        finished = (nodes == 1) | (tokens == (-1 if self.eos is None else self.eos))
        return torch.where(nodes < 0, -1, finished.long())

    def absorb(self, nodes: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """``log_probs`` ``[B, n, V]`` with each finished node's row replaced by the end token at
        probability 1."""
        if self.eos is None:
            return log_probs
        only_eos = torch.full_like(log_probs[:1, :1], -torch.inf)
        only_eos[..., self.eos] = 0.0
        return torch.where((nodes == 1)[:, :, None], only_eos, log_probs)

    def kept(self, k: int, fanout: int) -> torch.Tensor:
        """int64 ``[k]``: in the ``[k * fanout]`` candidate layout of ``k`` beams, each beam's end
        token (what a finished beam continues with)."""
        return torch.arange(k, device=self.device) * fanout + self._eos_column

    def complete(self, nodes: torch.Tensor) -> torch.Tensor:
        """bool ``[B]``: every beam of the row (``nodes`` ``[B, K]``) is finished or dead."""
        return (nodes != 0).all(dim=1)
