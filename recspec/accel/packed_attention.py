"""Grouped-query attention over a few query rows without copying the keys and values.

A model with grouped-query attention (SmolLM2-135M: 9 query heads over 3 key/value heads) runs
transformers' SDPA attention by copying every layer's cached keys and values once per query head
of a group (``repeat_kv``) whenever a call feeds more than one token under an explicit mask, which
is every verifying call of a draft tree or chain: for a 356-token cache, 30 layers copy 3 x 2 x
356 x 64 floats into 9 x 2 x 356 x 64 on every call. transformers skips the copy for a single query
token by packing the query heads of a group into the query rows of their key/value head; this
module does the same for any number of query rows:

``query [b, H, q, d] -> [b, H_kv, g q, d]`` (``g = H / H_kv``; query head ``h`` attends with
key/value head ``h // g``, as ``repeat_kv`` pairs them), the mask ``[b, 1, q, k] -> [b, 1, g q,
k]`` (one copy of the mask per group member, which is q x k, not the cache), one SDPA call over
the unrepeated keys and values, and the output unpacked to ``[b, q, H, d]``. The same sums in
the same order per query row and head, so the logits agree with transformers' own path to float
noise (SmolLM2's logits over a 356-token cache: identical for 4 and 8 rows, within 2e-5 for 2).

Calls of 2-8 rows gain most (`python -m benchmarks.lab rows` measures it): a 2-row call then
costs what a 1-row call does. One-row calls and calls without a mask (a prompt's causal prefill) and training
(attention dropout) keep transformers' own SDPA path, so plain greedy decoding and ``generate``
are unchanged: the gain is the verifying calls' alone.

:func:`use_packed_attention` switches a loaded model's SDPA attention to this one (accel's policy
gives it to the models recspec loads, :mod:`recspec.accel.policy`; other attention implementations
are left as they are).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

#: The attention implementation's name (``config._attn_implementation``); it contains "sdpa", so
#: transformers checks the model's SDPA support for it as for its own.
PACKED_SDPA = "recspec_sdpa"

#: Bumped whenever how a call's attention is computed changes: part of every kept timing's key.
ATTENTION_VERSION = 1


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask of ``dtype`` with ``visible``'s shape: ``0`` where ``visible`` (bool)
    is True, ``torch.finfo(dtype).min`` where it is False."""
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return blocked.masked_fill_(visible, 0.0)


def packs(module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether :func:`packed_sdpa_attention` packs this call: grouped heads, more than one query
    row, a 4-D mask shared by all heads (``[b, 1, q, k]``), and inference (no attention dropout)."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (groups > 1 and query.shape[2] > 1 and not module.training and attention_mask is not None
            and attention_mask.dim() == 4 and attention_mask.shape[1] == 1)


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[b, H, q, d]``, ``key`` and ``value``
    ``[b, H_kv, k, d]``, ``attention_mask`` additive or bool ``[b, 1, q, k]`` (or None); returns
    the attention output ``[b, q, H, d]`` and no weights. Packs the query heads of each group
    where :func:`packs` says so, else is transformers' SDPA attention."""
    if not packs(module, query, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    assert attention_mask is not None  # packs() checked it
    batch, heads, rows, dim = query.shape
    groups = module.num_key_value_groups
    packed = query.reshape(batch, heads // groups, groups * rows, dim)
    mask = attention_mask[:, :, None].expand(batch, 1, groups, rows, attention_mask.shape[-1])
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask.reshape(batch, 1, groups * rows, -1),
                                         scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def use_packed_attention(model):
    """Switch ``model`` (a transformers model) from SDPA attention to :func:`packed_sdpa_attention`
    and return it; a model on another implementation (eager, flash, flex) is returned as it is."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(PACKED_SDPA)
    return model
