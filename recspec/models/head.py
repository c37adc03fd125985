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
own ``h_hat`` as the parent feature (autoregressive in feature space). A head never attends: it
sees the prompt only through the target's feature, so it keeps no KV cache and a draft step over
``n`` nodes is a few ``[n, H] x [H, *]`` products, no prompt, no framework overhead per layer.

The folder a head is saved in (:func:`save_head`, :func:`load_head`) holds ``head.safetensors``
(its own weights only, never the target's), ``head.json`` (shape, and the fingerprint of what it
was trained on: the sha256 of its target's weights and of the item index) and checksums; loading
checks all three, so a head is never used with another target.
"""

from __future__ import annotations

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
    ``levels``: identifier length L (one level embedding per level)."""

    hidden: int
    intermediate: int
    layers: int
    levels: int

    def check(self) -> None:
        if min(self.hidden, self.intermediate, self.layers, self.levels) < 1:
            raise RecspecError(f"a head needs positive sizes, got {self}")


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

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class DraftHead(nn.Module):
    """The head's own parameters (see the module doc). :meth:`forward` maps parent features,
    token embeddings and levels to the guessed features of the nodes."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden, config.hidden, bias=False)
        self.level = nn.Embedding(config.levels, config.hidden)
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

    def forward(self, parent: torch.Tensor, embedded: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        """``parent``, ``embedded``: float ``[..., H]``; ``level``: int64 ``[...]`` (0-based level of
        the node's token, clamped to the table). Returns float ``[..., H]``."""
        u = self.fc(torch.cat((parent, embedded.to(parent.dtype)), dim=-1))
        u = u + self.level(level.clamp(0, self.config.levels - 1))
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

    def features(self, parent: torch.Tensor, tokens: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        """Guessed target features ``[..., H]`` of nodes with tokens ``tokens`` (int64 ``[...]``) at
        0-based identifier level ``level`` (int64 ``[...]``), under parents with features ``parent``
        ``[..., H]``."""
        embedded = self.target.get_input_embeddings()(tokens)
        return self.head(parent, embedded, level)

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


def save_head(path: Path, head: DraftHead, fingerprint: dict[str, str], info: dict[str, Any]) -> None:
    """Write the head folder ``path`` whole (weights, ``head.json`` with the config, ``fingerprint``
    and ``info``, checksums) under a temporary name."""
    from safetensors.torch import save_file

    with atomic_dir(path, overwrite=True) as tmp:
        save_file({name: value.detach().contiguous() for name, value in head.state_dict().items()},
                  str(tmp / HEAD_WEIGHTS))
        write_json_atomic(tmp / HEAD_CONFIG, {"format": HEAD_FORMAT, "config": asdict(head.config),
                                              "fingerprint": fingerprint, **info})
        record_checksums(tmp)


def is_head_dir(path: str | Path) -> bool:
    """Whether ``path`` (or its ``best/``) is a head folder."""
    path = Path(path)
    return (path / HEAD_CONFIG).is_file() or (path / "best" / HEAD_CONFIG).is_file()


def head_dir(path: str | Path) -> Path:
    """The head folder itself: ``path`` or, for a training folder, its ``best/``."""
    path = Path(path)
    return path if (path / HEAD_CONFIG).is_file() else path / "best"


def read_head_config(path: Path) -> dict[str, Any]:
    """``head.json`` of a head folder, its checksums checked first."""
    remedy = "train the head again (recspec align train --head)"
    if not (path / CHECKSUMS).is_file():
        raise RecspecError(f"{path}: not a head folder written by recspec (no {CHECKSUMS}); {remedy}")
    verify_checksums(path, remedy)
    meta = read_json(path / HEAD_CONFIG)
    if not isinstance(meta, dict) or meta.get("format") != HEAD_FORMAT:
        raise RecspecError(f"{path / HEAD_CONFIG}: not a {HEAD_FORMAT} head; {remedy}")
    return meta


def load_head(path: str | Path, fingerprint: dict[str, str], device: torch.device | str = "cpu") -> DraftHead:
    """The head saved in ``path`` (a head folder or a training folder), checked against the
    ``fingerprint`` of the target it is to draft for (same keys as saved)."""
    from safetensors.torch import load_file

    path = head_dir(path)
    meta = read_head_config(path)
    saved = meta.get("fingerprint", {})
    for key, value in fingerprint.items():
        if saved.get(key) != value:
            raise RecspecError(f"{path}: this head was trained for another target ({key.replace('_', ' ')} "
                               f"differs); train a head for this target with recspec align train --head")
    head = DraftHead(HeadConfig(**meta["config"]))
    weights = load_file(str(path / HEAD_WEIGHTS))
    missing = set(head.state_dict()) ^ set(weights)
    if missing:
        raise RecspecError(f"{path / HEAD_WEIGHTS}: weights do not match head.json ({sorted(missing)[:3]})")
    if not all(bool(torch.isfinite(value).all()) for value in weights.values()):
        raise RecspecError(f"{path / HEAD_WEIGHTS}: non-finite weights; train the head again")
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
