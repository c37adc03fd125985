"""Feature-level draft heads (the EAGLE / Medusa / NEZHA family, with PAD-Rec's level embeddings).

A head drafts in the target's feature space instead of running a model of its own over the
prompt. At a tree node whose parent the target has seen, the target's last hidden state there
``h_parent`` (after its final norm: ``lm_head(h) = logits``) and the embedding of the node's token
``e(x)`` (the target's own, frozen) give the head's guess of the target's feature at the node::

    u = W_fc [h_parent; e(x)] + level[d]          (d: identifier level of x, 0-based)
    u = u + MLP(norm(u))                            (``layers`` such blocks, SwiGLU as in Llama)
    h_hat = norm_out(u)

and the target's own output layer, restricted to the identifier tokens, turns ``h_hat`` into the
draft's distribution over the next identifier token. Deeper levels of a round feed the head its
own ``h_hat`` as the parent feature (autoregressive in feature space). A plain head never attends:
it sees the prompt only through the target's feature at the parent, so it keeps no KV cache and a
draft step over ``n`` nodes is a few ``[n, H] x [H, *]`` products, no prompt, no framework
overhead per layer. With ``context_heads > 0`` the head also attends, once, from every node over
the target's features at the user's prompt tokens (``u = u + Attn(norm(u), P)`` before the blocks,
``P``: the prompt's ``[T, H]`` features, which the target's first call computes anyway): which
history items bear on the next level depends on the token just chosen, and one feature at the
parent, shaped to predict that token, does not carry it. Its output projection starts at zero, so a
new attending head starts as the plain one.

The folder a head is saved in (:func:`save_head`, :func:`load_head`) holds ``head.safetensors``
(its own weights only, never the target's), ``head.json`` (shape, and the fingerprint of what it
was trained on: the sha256 of its target's weights and of the item index) and checksums; loading
checks all three, so a head is never used with another target. The text head
(:mod:`recspec.models.text_head`) is saved and loaded by the same functions, as another
:class:`HeadKind`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.checkpoint import weights_fingerprint
from recspec.models.tokenizer import identifier_token_ids, index_fingerprint
from recspec.fileio import CHECKSUMS, atomic_dir, read_json, record_checksums, verify_checksums, write_json_atomic

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head.json"
HEAD_FORMAT = "recspec-head/1"


@dataclass(frozen=True)
class HeadConfig:
    """``hidden``: the target's hidden size; ``intermediate``: the MLP width; ``layers``: blocks;
    ``levels``: identifier length L (one level embedding per level); ``context_heads``: attention
    heads over the prompt's features (0: none; they must divide ``hidden``)."""

    hidden: int
    intermediate: int
    layers: int
    levels: int
    context_heads: int = 0

    def check(self) -> None:
        if min(self.hidden, self.intermediate, self.layers, self.levels) < 1 or self.context_heads < 0:
            raise RecspecError(f"a head needs positive sizes, got {self}")
        if self.context_heads and self.hidden % self.context_heads:
            raise RecspecError(f"a head's {self.context_heads} attention heads do not divide its width {self.hidden}")


class RMSNorm(nn.Module):
    """Llama's RMS norm (float32 statistics)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight


class Block(nn.Module):
    """``u + MLP(norm(u))`` with Llama's SwiGLU MLP."""

    def __init__(self, hidden: int, intermediate: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class ContextAttention(nn.Module):
    """Attention from nodes over the prompt's features (``heads`` heads of ``hidden / heads``);
    ``out`` starts at zero."""

    def __init__(self, hidden: int, heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.context_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key_value = nn.Linear(hidden, 2 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.query.weight, std=0.02)
            nn.init.normal_(self.key_value.weight, std=0.02)
            nn.init.zeros_(self.out.weight)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x``: float ``[B, n, H]`` (the nodes); ``context``: float ``[B, T, H]`` (the prompt's
        features); ``mask``: bool ``[B, T]``, True on real prompt tokens. Returns ``[B, n, H]``."""
        batch, n, hidden = x.shape
        split = (batch, -1, self.heads, hidden // self.heads)
        query = self.query(self.norm(x)).view(split).transpose(1, 2)  # [B, heads, n, d]
        key, value = self.key_value(self.context_norm(context.to(x.dtype))).chunk(2, dim=-1)
        key, value = key.reshape(split).transpose(1, 2), value.reshape(split).transpose(1, 2)  # [B, heads, T, d]
        attended = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None, None, :])
        return self.out(attended.transpose(1, 2).reshape(batch, n, hidden))


class DraftHead(nn.Module):
    """The head's own parameters (see the module doc). :meth:`forward` maps parent features,
    token embeddings and levels to the guessed features of the nodes."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden, config.hidden, bias=False)
        self.level = nn.Embedding(config.levels, config.hidden)
        self.context = ContextAttention(config.hidden, config.context_heads) if config.context_heads else None
        self.blocks = nn.ModuleList(Block(config.hidden, config.intermediate) for _ in range(config.layers))
        self.norm_out = RMSNorm(config.hidden)
        with torch.no_grad():  # start as "the parent's feature": the first guess is the parent's distribution
            nn.init.normal_(self.fc.weight, std=0.02)
            self.fc.weight[:, :config.hidden] += torch.eye(config.hidden)
            nn.init.zeros_(self.level.weight)
            for block in self.blocks:
                nn.init.normal_(block.gate.weight, std=0.02)
                nn.init.normal_(block.up.weight, std=0.02)
                nn.init.zeros_(block.down.weight)

    def forward(self, parent: torch.Tensor, embedded: torch.Tensor, level: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``parent``, ``embedded``: float ``[B, n, H]``; ``level``: int64 ``[B, n]`` (0-based level
        of the node's token, clamped to the table); ``context``: the prompt's features float
        ``[B, T, H]`` and their mask bool ``[B, T]`` (needed when the head attends, else unused).
        Returns float ``[B, n, H]``."""
        u = self.fc(torch.cat((parent, embedded.to(parent.dtype)), dim=-1))
        u = u + self.level(level.clamp(0, self.config.levels - 1))
        if self.context is not None:
            if context is None:
                raise RuntimeError("this head attends over the prompt's features: pass them")
            u = u + self.context(u, *context)
        for block in self.blocks:
            u = block(u)
        return self.norm_out(u)


class HeadDraft:
    """A head bound to its target: the target's input embedding and the rows of its output layer
    for the identifier tokens (both frozen, shared, not copied).

    ``token_ids``: int64 ``[V_id]``, the identifier tokens, in vocabulary order; ``vocab``: the
    target's vocabulary size.
    """

    def __init__(self, head: DraftHead, target, token_ids: torch.Tensor) -> None:
        self.head, self.target = head, target
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.token_ids = token_ids.to(next(target.parameters()).device)

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def attends(self) -> bool:
        """Whether the head reads the prompt's features (:class:`ContextAttention`)."""
        return self.head.context is not None

    def features(self, parent: torch.Tensor, tokens: torch.Tensor, level: torch.Tensor,
                 context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Guessed target features ``[B, n, H]`` of nodes with tokens ``tokens`` (int64 ``[B, n]``)
        at 0-based identifier level ``level`` (int64 ``[B, n]``), under parents with features
        ``parent`` ``[B, n, H]``; ``context`` as :meth:`DraftHead.forward`."""
        embedded = self.target.get_input_embeddings()(tokens)
        return self.head(parent, embedded, level, context)

    def id_log_probs(self, feature: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., V_id]``: log-softmax over the identifier tokens of the target's output
        layer at ``feature`` ``[..., H]``."""
        weight = self.target.get_output_embeddings().weight[self.token_ids.to(feature.device)]
        return torch.log_softmax((feature @ weight.to(feature.dtype).T).float(), dim=-1)

    def log_probs(self, feature: torch.Tensor) -> torch.Tensor:
        """:meth:`id_log_probs` scattered into the full vocabulary: float32 ``[..., V]``, ``-inf``
        on tokens that are not identifiers."""
        rows = self.id_log_probs(feature)
        out = torch.full((*rows.shape[:-1], self.vocab), -torch.inf, device=rows.device)
        return out.index_copy_(-1, self.token_ids.to(rows.device), rows)


@dataclass(frozen=True)
class HeadKind:
    """A kind of head folder: its config file and format tag, how its module is built from the saved
    config, and the command that trains one (named in refusals). Every kind keeps its own weights,
    never its target's, in ``head.safetensors``."""

    config_file: str
    format: str
    build: Callable[[dict[str, Any]], nn.Module]
    trained_by: str

    @property
    def remedy(self) -> str:
        return f"train the head again ({self.trained_by})"


ITEM_HEAD = HeadKind(HEAD_CONFIG, HEAD_FORMAT, lambda config: DraftHead(HeadConfig(**config)),
                     "recspec align train --head")


def save_head(path: Path, head: nn.Module, fingerprint: dict[str, str], info: dict[str, Any],
              kind: HeadKind = ITEM_HEAD) -> None:
    """Write the head folder ``path`` whole (``head.safetensors``: the module's state, buffers
    included; the kind's config file with ``head.config``, ``fingerprint`` and ``info``; checksums)
    under a temporary name."""
    from safetensors.torch import save_file

    with atomic_dir(path, overwrite=True) as tmp:
        save_file({name: value.detach().contiguous() for name, value in head.state_dict().items()},
                  str(tmp / HEAD_WEIGHTS))
        write_json_atomic(tmp / kind.config_file, {"format": kind.format, "config": asdict(head.config),
                                                   "fingerprint": fingerprint, **info})
        record_checksums(tmp)


def is_head_dir(path: str | Path, kind: HeadKind = ITEM_HEAD) -> bool:
    """Whether ``path`` (or its ``best/``) is a head folder of ``kind``."""
    path = Path(path)
    return (path / kind.config_file).is_file() or (path / "best" / kind.config_file).is_file()


def head_dir(path: str | Path, kind: HeadKind = ITEM_HEAD) -> Path:
    """The head folder itself: ``path`` or, for a training folder, its ``best/``."""
    path = Path(path)
    return path if (path / kind.config_file).is_file() else path / "best"


def read_tied_config(path: Path, config_file: str, fmt: str, what: str, remedy: str) -> dict[str, Any]:
    """The ``config_file`` of a folder tied to a target (a head, a target prior), its checksums
    checked first and its format tag ``fmt``; ``what`` names such a folder in refusals, ``remedy``
    says what to do."""
    if not (path / CHECKSUMS).is_file():
        raise RecspecError(f"{path}: not a {what} written by recspec (no {CHECKSUMS}); {remedy}")
    verify_checksums(path, remedy)
    meta = read_json(path / config_file)
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise RecspecError(f"{path / config_file}: not a {fmt} {what}; {remedy}")
    return meta


def check_tied(path: Path, meta: dict[str, Any], fingerprint: dict[str, str], made: str, remedy: str) -> None:
    """Refuse the folder ``path`` whose config ``meta`` was not made for the target of
    ``fingerprint`` (:func:`head_fingerprint`: every key must match); ``made`` says how it was
    made (``"this head was trained"``), ``remedy`` what to do."""
    saved = meta.get("fingerprint", {})
    for key, value in fingerprint.items():
        if saved.get(key) != value:
            raise RecspecError(f"{path}: {made} for another target ({key.replace('_', ' ')} differs); {remedy}")


def read_head_config(path: Path, kind: HeadKind = ITEM_HEAD) -> dict[str, Any]:
    """The config file of a head folder of ``kind``, its checksums checked first."""
    return read_tied_config(path, kind.config_file, kind.format, "head folder", kind.remedy)


def load_head(path: str | Path, fingerprint: dict[str, str], device: torch.device | str = "cpu",
              kind: HeadKind = ITEM_HEAD) -> nn.Module:
    """The head of ``kind`` saved in ``path`` (a head folder or a training folder), checked
    against the ``fingerprint`` of the target it is to draft for (same keys as saved)."""
    from safetensors.torch import load_file

    path = head_dir(path, kind)
    meta = read_head_config(path, kind)
    check_tied(path, meta, fingerprint, "this head was trained", f"train a head for this target with {kind.trained_by}")
    try:
        head = kind.build(meta["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise RecspecError(f"{path / kind.config_file}: a config this recspec cannot build ({err}); "
                           f"{kind.remedy}") from None
    weights = load_file(str(path / HEAD_WEIGHTS))
    own = head.state_dict()
    differ = sorted(set(own) ^ set(weights)) or sorted(k for k in own if own[k].shape != weights[k].shape)
    if differ:
        raise RecspecError(f"{path / HEAD_WEIGHTS}: weights do not match {kind.config_file} ({differ[:3]})")
    if not all(bool(torch.isfinite(value).all()) for value in weights.values() if value.is_floating_point()):
        raise RecspecError(f"{path / HEAD_WEIGHTS}: non-finite weights; {kind.remedy}")
    head.load_state_dict(weights)
    return head.to(device).eval()


def head_fingerprint(target_dir: Path, index: ItemIndex) -> dict[str, str]:
    """What a head is tied to: the sha256 of its target's weights (``target_dir``: the target's
    model folder) and of the item index."""
    return {"target_weights_sha256": weights_fingerprint(target_dir), "index_sha256": index_fingerprint(index)}


def bind_head(head: DraftHead, target, tokenizer, index: ItemIndex) -> HeadDraft:
    """``head`` bound to its loaded ``target`` over the identifier tokens of ``index``."""
    if head.config.hidden != target.config.get_text_config().hidden_size:
        raise RecspecError(f"the head's width ({head.config.hidden}) is not the target's hidden size "
                           f"({target.config.get_text_config().hidden_size})")
    ids = torch.as_tensor(sorted(identifier_token_ids(tokenizer, index).values()), dtype=torch.int64)
    return HeadDraft(head, target, ids)
