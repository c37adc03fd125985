"""The target scorer: one forward pass over the nodes of a token tree appended after a KV cache.

Every speculative decoder ends a round the same way: the tokens it proposes (a draft model's
beams, a retrieved continuation tree) are fed to the target in one call, each node attending to
the cached positions it continues (the prompt, the text or beams accepted so far) and to its own
ancestors in the tree, at position ``root position + depth``. :func:`score_tree` is that call
(:func:`forward_visible` for nodes whose visibility is already built, :func:`prefill` for the
prompts); :func:`next_log_probs` turns its logits into the float32 log-probabilities every
verifier and beam search compares (log-softmax over the full vocabulary, as transformers'
generation does). Every decoder reaches the model through here, except the per-beam reference
cache of ``beam`` and transformers' own ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recspec.accel.lean_forward import forward_of
from recspec.accel.packed_attention import additive_mask
from recspec.decoding.prefix import OpenCache, open_cache
from recspec.decoding.prompts import Prompts
from recspec.decoding.tree import node_depths, tree_rows
from recspec.hub import keep_logits_at, returned_cache, with_cache
from recspec.models.text_head import layer_features


def next_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the full vocabulary (last dim), as HF beam search computes it."""
    return torch.log_softmax(logits.float(), dim=-1)


def prefill(model, prompts: Prompts):
    """Run the prompts once: ``(log_probs [B, 1, V] of the first generated token, KV cache)``."""
    log_probs, cache, _ = _prefill(model, prompts, False)
    return log_probs, cache


def prefill_features(model, prompts: Prompts, layers: Sequence[int] = ()):
    """:func:`prefill` that also returns the model's last hidden state at every prompt column
    (after its final norm, what a text draft head reads; meaningless on padding), with the
    normalised outputs of its decoder ``layers`` before it (a fused head's input,
    :func:`~recspec.models.text_head.layer_features`): ``(log_probs [B, 1, V], KV cache, features
    [B, P, (len(layers) + 1) * H])``."""
    log_probs, cache, features = _prefill(model, prompts, True, layers)
    assert features is not None
    return log_probs, cache, features


def prefill_tree(model, prompts: Prompts, tokens: torch.Tensor, tree_visible: torch.Tensor,
                 tree_positions: torch.Tensor) -> tuple[torch.Tensor, object]:
    """:func:`prefill` with a token tree fed after the prompts in the same call
    (:func:`prompt_and_tree`): ``(log_probs [B, 1 + M, V]`` of the first generated token and of
    the token after each of the ``M`` nodes, ``KV cache)``, the cache holding the prompts' columns
    then the nodes'. ``tokens``, ``tree_positions``: int64 ``[B, M]``; ``tree_visible``: bool
    ``[B, M, P + M]``."""
    start = open_cache(model, prompts)
    block = prompt_and_tree(prompts.input_ids, prompts.attention_mask, prompts.position_ids, tokens, tree_visible,
                            tree_positions)
    logits, _ = forward_opened(model, start, *block, False)
    return next_log_probs(logits), start.cache


def _prefill(model, prompts: Prompts, features: bool, layers: Sequence[int] = ()):
    start = open_cache(model, prompts)  # the shared prefix, if any, is not fed again
    out = forward_of(model)(
        input_ids=prompts.input_ids[:, start.skip:],
        attention_mask=prompts.attention_mask,
        position_ids=prompts.position_ids[:, start.skip:],
        **with_cache(model, start.cache),
        use_cache=True,
        output_hidden_states=features,
        **keep_logits_at(model, 1),
    )
    return (next_log_probs(out.logits[:, -1:]), returned_cache(out),
            layer_features(model, start.joined(out.hidden_states), layers) if features else None)


def score_tree(
    model,
    cache,
    tokens: torch.Tensor,
    ancestors: torch.Tensor,
    past_visible: torch.Tensor,
    root_positions: torch.Tensor,
) -> torch.Tensor:
    """Feed ``N`` tree nodes per row after the ``P`` positions in ``cache``: logits ``[B, N, V]``.

    ``tokens``: int64 ``[B, N]``; ``ancestors``: bool ``[B, N, N]`` from
    :func:`~recspec.decoding.tree.ancestor_matrix` (padding nodes are roots that nothing
    descends from); ``past_visible``: bool ``[B, P]`` or ``[B, N, P]``, the cached positions
    each node attends to (see :func:`~recspec.decoding.tree.tree_rows`);
    ``root_positions``: int64 ``[B]`` or ``[B, N]``, the position id of a depth-0 node (the
    number of real tokens before it on its path), so node positions are ``root + depth``.

    The cache grows by ``N`` positions per row, in node order; compact it afterwards with
    :func:`~recspec.decoding.cache.gather_positions`. Needs a model whose cache layers are all
    full attention and which takes a custom 4D float mask (transformers 5 decoder-only models).
    """
    return forward_visible(model, cache, tokens, *tree_inputs(ancestors, past_visible, root_positions))


def score_tree_features(model, cache, tokens: torch.Tensor, ancestors: torch.Tensor, past_visible: torch.Tensor,
                        root_positions: torch.Tensor, layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`score_tree` that also returns the model's last hidden state at the nodes (after its
    final norm, what a text draft head reads; with the outputs of ``layers`` before it, as
    :func:`prefill_features`): ``(logits [B, N, V], features [B, N, (len(layers) + 1) * H])``."""
    return forward_features(model, cache, tokens, *tree_inputs(ancestors, past_visible, root_positions),
                            layers=layers)


def tree_inputs(ancestors: torch.Tensor, past_visible: torch.Tensor,
                root_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each node of a tree sees and its position id (:func:`score_tree`'s arguments):
    ``(visible [B, N, P + N], position_ids [B, N])``."""
    if root_positions.dim() == 1:
        root_positions = root_positions[:, None]
    return tree_rows(past_visible, ancestors), root_positions + node_depths(ancestors)


def forward_visible(model, cache, tokens: torch.Tensor, visible: torch.Tensor, position_ids: torch.Tensor,
                    keep_last: int | None = None) -> torch.Tensor:
    """Feed ``N`` nodes per row after the ``P`` cached positions: logits ``[B, N, V]`` (of the last
    ``keep_last`` nodes only, if given: the output layer runs for those alone).

    ``tokens``, ``position_ids``: int64 ``[B, N]``; ``visible``: bool ``[B, N, P + N]``, what each
    node attends to (cached positions, then the nodes fed now; a node must see itself). With
    ``cache`` None nothing is cached (training).
    """
    return _forward(model, cache, tokens, visible, position_ids, keep_last, False)[0]


def forward_features(model, cache, tokens: torch.Tensor, visible: torch.Tensor, position_ids: torch.Tensor,
                     keep_last: int | None = None, all_features: bool = False, layers: Sequence[int] = ()
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_visible` that also returns the model's last hidden state at the same nodes
    (after its final norm, so that the output layer maps it to the logits): ``(logits [B, N, V],
    features [B, N, H])``, what a draft head reads (``[B, N, (len(layers) + 1) * H]`` with the
    outputs of ``layers`` before it, as :func:`prefill_features`); with ``all_features`` the
    features of all the ``N`` fed nodes whatever ``keep_last``."""
    logits, features = _forward(model, cache, tokens, visible, position_ids, keep_last, True, all_features, layers)
    assert features is not None
    return logits, features


def forward_opened(model, start: OpenCache, tokens: torch.Tensor, visible: torch.Tensor, position_ids: torch.Tensor,
                   keep_last: int, features: bool, layers: Sequence[int] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed a block of ``F`` columns that begins with the prompts' (:func:`prompt_and_tree`) after
    the cache ``start`` opened for them (:func:`~recspec.decoding.prefix.open_cache`): the first
    ``start.skip`` columns, which it holds, are not fed again. ``tokens``, ``position_ids``: int64
    ``[B, F]``; ``visible``: bool ``[B, F, F]``. Returns the logits of the last ``keep_last``
    columns ``[B, keep_last, V]`` and, if ``features``, the features of all ``F`` columns (the held
    ones included, as :func:`forward_features` with ``all_features``), else None."""
    skip = start.skip
    return _forward(model, start.cache, tokens[:, skip:], visible[:, skip:], position_ids[:, skip:], keep_last,
                    features, True, layers, start)


def _forward(model, cache, tokens: torch.Tensor, visible: torch.Tensor, position_ids: torch.Tensor,
             keep_last: int | None, features: bool, all_features: bool = False, layers: Sequence[int] = (),
             start: OpenCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    keep = {} if keep_last is None else keep_logits_at(model, keep_last)
    out = forward_of(model)(input_ids=tokens, attention_mask=additive_mask(visible, model.dtype)[:, None],
                            position_ids=position_ids, **with_cache(model, cache), use_cache=cache is not None,
                            output_hidden_states=features, **keep)
    last = slice(None) if keep_last is None else slice(-keep_last, None)
    if not features:
        return out.logits[:, last], None
    read = layer_features(model, out.hidden_states if start is None else start.joined(out.hidden_states), layers)
    return out.logits[:, last], read[:, slice(None) if all_features else last]


def forward_prompt_and_tree(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, tokens: torch.Tensor, tree_visible: torch.Tensor,
                            tree_positions: torch.Tensor) -> torch.Tensor:
    """Left-padded prompts and a token tree after them, in one forward: logits ``[B, 1 + M, V]``
    of the prompt's last position (row 0, the tree's root) and of the ``M`` tree nodes.

    ``input_ids``, ``attention_mask``, ``position_ids``: int64 ``[B, P]`` (the prompts, left-padded,
    position ids counting real tokens); ``tokens``, ``tree_positions``: int64 ``[B, M]``;
    ``tree_visible``: bool ``[B, M, P + M]``, what each node attends to (the prompt's real tokens,
    its ancestors, itself). Prompt tokens attend causally to real prompt tokens. ``cache``: an
    empty cache to fill, or None. The output layer runs for the ``1 + M`` positions only.
    """
    return forward_visible(model, cache, *prompt_and_tree(input_ids, attention_mask, position_ids, tokens,
                                                          tree_visible, tree_positions))


def prompt_and_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    tokens: torch.Tensor, tree_visible: torch.Tensor,
                    tree_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The inputs of :func:`forward_prompt_and_tree` as one block of nodes for
    :func:`forward_visible` / :func:`forward_features`: tokens and position ids ``[B, P + M]``,
    visibility ``[B, P + M, P + M]`` and ``keep_last = 1 + M`` (the root and the tree)."""
    prompt_len = input_ids.shape[1]
    width = tree_visible.shape[2]
    visible = torch.cat((torch.nn.functional.pad(prompt_rows(attention_mask), (0, width - prompt_len)),
                         tree_visible), dim=1)
    return (torch.cat((input_ids, tokens), dim=1), visible, torch.cat((position_ids, tree_positions), dim=1),
            tokens.shape[1] + 1)


def prompt_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """What each column of left-padded prompts attends to (``attention_mask``: int64 ``[B, P]``,
    1 on real tokens): bool ``[B, P, P]``, the real tokens up to itself, and itself (so that
    padding columns see something)."""
    prompt_len = attention_mask.shape[1]
    real = attention_mask.bool()
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=real.device).tril()
    return (causal & real[:, None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=real.device)
