"""Requests and batches: prompts left-padded the way Hugging Face generate expects, the checks
every decoder runs on a request before any work, and the one batch wrapper of the item decoders
(validate, move the trie to the model's device, decode batch by batch without autograd)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from recspec.decoding.beams import TopK
from recspec.decoding.prefix import shared_columns
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie

R = TypeVar("R")


@dataclass(frozen=True)
class Prompts:
    """A batch of ``B`` prompts, left-padded to width ``P`` as Hugging Face generate expects.

    ``input_ids``: int64 ``[B, P]``, each prompt right-aligned after ``pad_token_id``s;
    ``attention_mask``: int64 ``[B, P]``, 1 on real tokens; ``position_ids``: int64 ``[B, P]``,
    a token's index among its row's real tokens (``cumsum(attention_mask) - 1``, 0 on padding, as
    generate computes them); ``lengths``: int64 ``[B]``, the number of real tokens, which is also
    the position id of the first generated token. ``shared``: the number of leading columns that
    hold the same tokens in every row, a prefix every prompt starts with (0: none), laid out
    before the padding: ``[prefix | padding | suffix]`` (:mod:`~recspec.decoding.prefix`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    pad_token_id: int
    shared: int = 0


def left_pad(prompts: Sequence[torch.Tensor], pad_token_id: int, device: torch.device, shared: int = 0) -> Prompts:
    """Left-pad 1-D non-empty token-id tensors into one :class:`Prompts` batch on ``device``;
    with ``shared``, the first ``shared`` tokens of every prompt (the same in all, and fewer than
    each prompt has) stay in the first columns and the rest is left-padded after them."""
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    width = int(lengths.max())
    columns = torch.arange(width)
    real = (columns >= (width - lengths + shared)[:, None]) | (columns < shared)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    input_ids[real] = torch.cat([prompt.to("cpu", torch.int64) for prompt in prompts])
    position_ids = (real.long().cumsum(dim=1) - 1).masked_fill_(~real, 0)
    return Prompts(
        input_ids=input_ids.to(device),
        attention_mask=real.long().to(device),
        position_ids=position_ids.to(device),
        lengths=lengths.to(device),
        pad_token_id=pad_token_id,
        shared=shared,
    )


def prompt_batches(prompts: Sequence[torch.Tensor], pad_token_id: int, device: torch.device,
                   batch_size: int | None, shared: int = 0) -> Iterator[Prompts]:
    """Consecutive batches of ``batch_size`` prompts (all at once if None), left-padded on
    ``device`` (``shared`` leading columns as :func:`left_pad`)."""
    size = batch_size or len(prompts)
    for start in range(0, len(prompts), size):
        yield left_pad(prompts[start:start + size], pad_token_id, device, shared)


def decode_batches(model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
                   batch_size: int | None, decode: Callable[[Prompts, ItemTrie], R],
                   check: Callable[[], None] | None = None) -> list[R]:
    """Validate the request (then the decoder's own ``check``), then ``decode(batch, trie)`` every
    batch of prompts (the trie on the model's device, no autograd; ``model``'s declared prefix, if
    every prompt starts with it, laid out as shared columns): the one batch wrapper of the item
    decoders."""
    validate_request(model, prompts, trie, k, pad_token_id, batch_size)
    if check is not None:
        check()
    device = model.device
    trie = trie if trie.device == device else trie.to(device)
    shared = shared_columns(model, prompts)
    with torch.inference_mode():
        return [decode(batch, trie) for batch in prompt_batches(prompts, pad_token_id, device, batch_size, shared)]


def decode_in_batches(
    decode: Callable[..., TopK],
    model,
    prompts: Sequence[torch.Tensor],
    trie: ItemTrie,
    k: int,
    pad_token_id: int,
    batch_size: int | None,
) -> TopK:
    """Validate, then run ``decode(model, Prompts, trie, k)`` on consecutive batches of
    ``batch_size`` users (all at once if None) and concatenate the results."""
    return TopK.cat(decode_batches(model, prompts, trie, k, pad_token_id, batch_size,
                                   lambda batch, on_device: decode(model, batch, on_device, k)))


def validate_request(
    model, prompts: Sequence[torch.Tensor], trie: ItemTrie, k: int, pad_token_id: int,
    batch_size: int | None,
) -> None:
    """Raise :class:`RecspecError` for arguments no decoder can serve."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RecspecError(f"k must be a positive integer, got {k!r}")
    if k > trie.num_items:
        raise RecspecError(f"k={k} exceeds the number of items in the trie ({trie.num_items}); "
                           f"ask for at most {trie.num_items}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise RecspecError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if len(prompts) == 0:
        raise RecspecError("no prompts given: pass one 1-D tensor of token ids per user")
    vocab_size = model.config.get_text_config().vocab_size
    if trie.vocab_size > vocab_size:
        raise RecspecError(f"the trie's vocabulary ({trie.vocab_size} tokens) is larger than the "
                           f"model's ({vocab_size}); build the trie for this model's tokens")
    if not 0 <= pad_token_id < vocab_size:
        raise RecspecError(f"pad_token_id {pad_token_id} is outside the model's vocabulary "
                           f"[0, {vocab_size})")
    for i, prompt in enumerate(prompts):
        if (not isinstance(prompt, torch.Tensor) or prompt.dim() != 1
                or prompt.dtype.is_floating_point or prompt.dtype.is_complex
                or prompt.dtype == torch.bool):
            raise RecspecError(f"prompt {i} must be a 1-D tensor of integer token ids, got "
                               f"{type(prompt).__name__} {getattr(prompt, 'shape', '')}")
        if prompt.numel() == 0:
            raise RecspecError(f"prompt {i} is empty: every user needs at least one prompt token")
    tokens = torch.cat([prompt.to("cpu", torch.int64) for prompt in prompts])
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise RecspecError(f"prompt token ids must lie in the model's vocabulary "
                           f"[0, {vocab_size}), got ids from {low} to {high}")


def check_draft_vocabulary(target, draft) -> None:
    """Raise :class:`RecspecError` unless the draft's vocabulary is the target's."""
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise RecspecError(f"the draft's vocabulary ({draft_vocab}) differs from the target's ({target_vocab}); "
                           f"train the draft with the target's tokenizer")
