"""A small Llama's inference forward in one function: transformers' operations without its module tree.

A call of a model the size this CPU trains (``target-mini``: 4 layers of width 256; ``draft-tiny``:
one of width 128) spends more of its time in transformers' Python than in its products: the module
tree, the keyword plumbing of every layer, the mask builder and the output recorders: on
``target-mini`` the products are about half of a one-node call.
:class:`LeanLlama` runs the same operations in the same order on the same weights:

* the token embedding; the rotary embedding from the model's own module;
* per layer: RMSNorm (``torch.nn.functional.rms_norm``, the same float32 sums), the q / k / v
  products, the rotary rotation, the cache's own ``update``, SDPA under the mask transformers would
  build, the output product and residual, RMSNorm, the gated MLP and residual;
* the final norm and the output layer over the kept positions only.

Its logits and cached keys and values are bit-identical to transformers' (tested over random
models, left-padded batches, cache continuations and tree masks), and each model is checked once
when it is given one (:func:`agrees`): where the installed transformers computes other bits, the
model keeps its own forward. The mask is built as transformers 5 builds it for SDPA
(:func:`sdpa_mask`): a 4-D mask is used as given; a 2-D padding mask becomes the boolean
``causal & padding`` mask, or no mask with SDPA's ``is_causal`` where transformers skips it (no
padding, and one query or an empty cache).

It serves what recspec's decoders ask of a model (:func:`forward_of`): ``input_ids``,
``attention_mask``, ``position_ids``, the cache, ``use_cache`` and an integer ``logits_to_keep``.
Anything else (hidden states, training mode, other arguments) goes to the model's own forward,
and so does every call not made through :func:`forward_of` (``generate``, training). Only the
models :func:`eligible` names get one: transformers' Llama with multi-head attention (as many
key/value heads as query heads), the default rotary embedding, no biases, SiLU, SDPA attention and
float32 weights. accel's policy (:mod:`recspec.accel.policy`) gives it to every such model whose
products stay transformers' (a model that streams its weights gets recspec's products instead,
which this forward's own ``F.linear`` calls would bypass).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, LlamaForCausalLM

from recspec.accel.packed_attention import PACKED_SDPA
from recspec.hub import with_cache

#: Bumped whenever how a lean call computes changes: part of every kept timing's key.
LEAN_FORWARD_VERSION = 1

#: The model forward's keyword arguments a lean call serves (the cache under either name).
SERVED = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                    "output_hidden_states", "logits_to_keep"})

_LEAN: weakref.WeakKeyDictionary[nn.Module, LeanLlama] = weakref.WeakKeyDictionary()  # in use
_CHECKED: weakref.WeakKeyDictionary[nn.Module, LeanLlama | None] = weakref.WeakKeyDictionary()  # by agrees()


@dataclass
class LeanOutput:
    """What a lean call returns, named as transformers 5.24's output: ``logits`` ``[B, n, V]`` and the
    ``cache`` (None without one; :func:`~recspec.hub.returned_cache` reads it)."""

    logits: torch.Tensor
    cache: DynamicCache | None


def eligible(model: nn.Module) -> bool:
    """Whether :class:`LeanLlama` computes ``model``'s forward bit for bit (module doc)."""
    if not isinstance(model, LlamaForCausalLM):
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    return (config.num_key_value_heads == config.num_attention_heads
            and rope.get("rope_type", "default") == "default"
            and not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
            and config.hidden_act == "silu" and config._attn_implementation in ("sdpa", PACKED_SDPA)
            and all(p.dtype == torch.float32 for p in model.parameters()))


def use_lean_forward(model: nn.Module) -> bool:
    """Give ``model`` a :class:`LeanLlama` for :func:`forward_of` where :func:`eligible` and where
    it computes this model's calls bit for bit as the installed transformers does (:func:`agrees`:
    a check of a few milliseconds, so that a transformers release that computes a Llama another way
    leaves its models on their own forward instead of changing what they decode); returns whether
    it got one."""
    if not eligible(model):
        return False
    if model not in _CHECKED:
        lean = LeanLlama(model)
        _CHECKED[model] = lean if agrees(model, lean) else None
    lean = _CHECKED[model]
    if lean is not None:
        _LEAN[model] = lean
    return lean is not None


@torch.inference_mode()
def agrees(model: LlamaForCausalLM, lean: LeanLlama) -> bool:
    """Whether ``lean`` and ``model``'s own forward return the same logits and cache, bit for bit,
    for two left-padded prompts of random tokens and one token after them (in eval mode)."""
    was_training = model.training
    model.eval()
    device = model.lm_head.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(2, 7, dtype=torch.long, device=device)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    grown = torch.cat((mask, torch.ones(2, 1, dtype=torch.long, device=device)), dim=1)
    step = positions[:, -1:] + 1
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    outputs = []
    for forward, cache in zip((model, lean), caches):
        first = forward(input_ids=tokens, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                        use_cache=True)
        second = forward(input_ids=tokens[:, :1], attention_mask=grown, position_ids=step, **with_cache(model, cache),
                         use_cache=True)
        outputs.append((first.logits[mask.bool()], second.logits))  # padding columns are never read
    model.train(was_training)
    real = grown.bool()
    return all(torch.equal(a, b) for a, b in zip(*outputs)) and all(
        torch.equal(a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real])
        and torch.equal(a.values.transpose(1, 2)[real], b.values.transpose(1, 2)[real])
        for a, b in zip(caches[0].layers, caches[1].layers))


def drop_lean_forward(model: nn.Module) -> None:
    """Let ``model`` be called through its own forward again (the benchmark's other arm)."""
    _LEAN.pop(model, None)


def forward_of(model: nn.Module) -> Callable[..., object]:
    """What recspec's decoders call ``model`` through: its :class:`LeanLlama` if it has one, else
    the model itself; either takes the model forward's keyword arguments."""
    return _LEAN.get(model, model)


class LeanLlama:
    """``model``'s inference forward in one function (module doc); falls back to the model for
    calls it does not serve."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps

    def __call__(self, **kwargs) -> object:
        model = self.model
        keep = kwargs.get("logits_to_keep", 0)
        if (model.training or kwargs.get("output_hidden_states") or not SERVED.issuperset(kwargs)
                or not isinstance(keep, int) or kwargs.get("input_ids") is None
                or model.lm_head.weight.dtype != torch.float32):  # moved to another dtype since
            return model(**kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None and kwargs.get("use_cache"):
            cache = DynamicCache(config=model.config)
        if cache is not None and not isinstance(cache, DynamicCache):
            return model(**kwargs)
        return LeanOutput(self.logits(kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"),
                                      cache, keep), cache)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None, cache: DynamicCache | None, keep: int) -> torch.Tensor:
        """Feed ``input_ids`` (int64 ``[B, N]``) after the ``P`` positions in ``cache``: logits
        ``[B, n, V]`` of the last ``n = keep`` positions (all if 0). ``attention_mask``: 2-D
        ``[B, P + N]`` (1 on real tokens) or 4-D ``[B, 1, N, P + N]`` (additive or bool), None for
        plain causal attention; ``position_ids``: int64 ``[B, N]``, ``P ..`` if None."""
        inner = self.model.model
        batch, count = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + count, device=input_ids.device)[None]
        mask, causal = sdpa_mask(attention_mask, count, past, input_ids.device)
        x = F.embedding(input_ids, inner.embed_tokens.weight)
        cos, sin = (part[:, None] for part in inner.rotary_emb(x, position_ids))  # [B, 1, N, D]
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's signs, once a call
        shape = (batch, count, self.heads, self.head_dim)
        for index, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, self.eps)
            q = rotate_rolled(F.linear(h, attention.q_proj.weight).view(shape).transpose(1, 2), cos, sin)
            k = rotate_rolled(F.linear(h, attention.k_proj.weight).view(shape).transpose(1, 2), cos, sin)
            v = F.linear(h, attention.v_proj.weight).view(shape).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(k, v, index)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attention.scaling, is_causal=causal)
            x = x + F.linear(o.transpose(1, 2).reshape(batch, count, -1), attention.o_proj.weight)
            h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, self.eps)
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                             mlp.down_proj.weight)
        x = F.rms_norm(x[:, -keep:] if keep else x, (x.shape[-1],), inner.norm.weight, self.eps)
        return F.linear(x, self.model.lm_head.weight)


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` ``[B, H, N, D]`` as transformers' ``apply_rotary_pos_emb``
    computes it, ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2, x1]``, in two
    operations fewer: ``x cos + roll(x) [-sin1, sin2]`` (``roll(x) = [x2, x1]``; ``-x2 sin1`` and
    ``x2 (-sin1)`` are the same float). ``cos``, ``signed_sin``: ``[B, 1, N, D]``, the latter with
    its first half negated."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def sdpa_mask(attention_mask: torch.Tensor | None, count: int, past: int,
              device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """The SDPA mask and ``is_causal`` flag transformers 5 computes for ``count`` queries after
    ``past`` cached positions: a 4-D mask as given; a 2-D padding mask ``[B, past + count]`` as the
    boolean ``[B, 1, count, past + count]`` of ``key <= past + query`` and the key's padding flag,
    unless nothing is padded and ``count == 1`` or ``past == 0`` (then no mask, causal for several
    queries, as transformers skips it); None as plain causal attention. New tensors go to ``device``."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask, False
    padding = None if attention_mask is None else attention_mask[:, :past + count].bool()
    if (count == 1 or past == 0) and (padding is None or bool(padding.all())):
        return None, count > 1
    keys = torch.arange(past + count, device=device)
    causal = keys[None, :] <= (past + torch.arange(count, device=device))[:, None]  # [count, past + count]
    mask = causal[None, None] if padding is None else causal[None, None] & padding[:, None, None, :]
    return mask, False
