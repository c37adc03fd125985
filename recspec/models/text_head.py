"""A feature-level draft head for text (EAGLE-1, drafted in trees as EAGLE-2) over any Hugging
Face causal LM with rotary positions (SmolLM2-135M-Instruct first).

At text position ``t`` the target's last hidden state ``f_t`` (after its final norm, so that
``lm_head(f_t)`` are its logits for token ``x_{t+1}``) and the embedding of the next token
``e(x_{t+1})`` (the target's own, frozen) give the head's guess of the target's next feature::

    u_t = W_fc [f_t; e(x_{t+1})]
    u_t = u_t + Attn(norm(u_t))          causal self-attention over u_0 .. u_t, RoPE at position t
    h_t = u_t + MLP(norm(u_t))           SwiGLU, as Llama's
    h_t ~ f_{t+1}

and the target's output layer, restricted to the draft vocabulary ``D`` (a gathered ``[|D|, H]``
matrix built once at bind time, :class:`TextHeadDraft`), turns ``h_t`` into the draft's
distribution over ``x_{t+2}``: one Llama decoder layer (the target's attention geometry, its rope
theta and norm epsilon) between an input projection and the target's own output layer. There is no
norm after the layer (as EAGLE-1): at initialisation ``W_fc`` passes ``f_t`` through and the
attention and MLP outputs are zero, so an untrained head guesses ``f_{t+1} = f_t``.

The head keeps a KV cache of its own over the inputs it has read (:meth:`TextHead.forward` takes
the cached keys and values and returns those of the new inputs); input ``t`` sits at position
``t``. Deeper draft levels feed it its own ``h`` in place of the target's feature.

Fused input (EAGLE-3, optional): with ``fused_layers`` ``(l_1, ..., l_F)`` the head reads, in
place of ``f_t``, ``W_fuse [g_{l_1, t}; ...; g_{l_F, t}; f_t]``, where ``g_{l, t}`` is the target's
hidden state after its decoder layer ``l`` at position ``t``, normalised by the target's final norm
(:func:`layer_features`): low and middle layers carry what the top feature has already traded for
the next token. ``W_fuse`` starts as ``[0, ..., 0, I]``, so an untrained fused head is the plain
one. Only the target's features are fused (:meth:`TextHead.read`); deeper draft levels feed the
head its own ``h`` as before.

Reduced vocabulary: ``D`` is stored in the head (the ``vocab_ids`` buffer, int64, ascending) and
``draft_vocab = 0`` means the target's whole vocabulary; SmolLM2's output layer is 28M of its
135M parameters, so a draft token over the full vocabulary costs a fifth of a target call.

Saved as a head folder (:func:`~recspec.models.head.save_head` with :data:`TEXT_HEAD`):
``head.safetensors`` (the head's weights and ``vocab_ids``, never the target's), ``text_head.json``
(config, format tag, the sha256 of the target's weights) and checksums.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from recspec.accel import accelerate
from recspec.accel.int8 import int8_serves
from recspec.accel.small_rows import KeptWeight
from recspec.errors import RecspecError
from recspec.models.checkpoint import weights_fingerprint
from recspec.models.head import Block, HeadKind, RMSNorm, load_head


@dataclass(frozen=True)
class TextHeadConfig:
    """The target's shapes the head copies (``hidden``, ``intermediate``, attention ``heads``,
    ``kv_heads``, ``head_dim``, ``rope_theta``, norm ``eps``), its vocabulary size ``vocab_size``,
    ``draft_vocab``: the size of the draft vocabulary (0: the whole vocabulary), and
    ``fused_layers``: the target's decoder layers (1-based, ascending) whose normalised outputs the
    head reads beside its top feature (empty: the top feature alone; module doc)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    vocab_size: int
    draft_vocab: int
    fused_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fused_layers", tuple(int(layer) for layer in self.fused_layers))  # JSON: a list
        sizes = (self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.vocab_size)
        if min(sizes) < 1 or self.heads % self.kv_heads or self.head_dim % 2 or not 0 <= self.draft_vocab <= \
                self.vocab_size or not self.rope_theta > 0 or not self.eps > 0:
            raise RecspecError(f"a text head needs positive sizes, heads a multiple of kv_heads, an even head_dim "
                               f"and 0 <= draft_vocab <= vocab_size; got {self}")
        if not ordered_layers(self.fused_layers):
            raise RecspecError(f"fused layers must be distinct decoder layers counted from 1, ascending; got "
                               f"{self.fused_layers}")

    @property
    def input_width(self) -> int:
        """The width of the target features the head reads: ``(len(fused_layers) + 1) * hidden``."""
        return (len(self.fused_layers) + 1) * self.hidden


def ordered_layers(layers: Sequence[int]) -> bool:
    """Whether ``layers`` can be a head's fused layers: distinct, counted from 1, ascending."""
    return all(layer >= 1 for layer in layers) and list(layers) == sorted(set(layers))


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary positions as Llama applies them: ``x`` ``[B, heads, T, d]`` at int64 ``positions``
    ``[B, T]``, ``inv_freq`` ``[d / 2]``; returns ``[B, heads, T, d]``."""
    angles = positions[:, None, :, None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos().to(x.dtype) + turned * angles.sin().to(x.dtype)


class TextHead(nn.Module):
    """The head's own parameters (see the module doc) and its draft vocabulary ``vocab_ids``."""

    def __init__(self, config: TextHeadConfig) -> None:
        super().__init__()
        self.config = c = config
        self.fuse = nn.Linear(c.input_width, c.hidden, bias=False) if c.fused_layers else None
        self.fc = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.attn_norm = RMSNorm(c.hidden, c.eps)
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.mlp = Block(c.hidden, c.intermediate, c.eps)
        self.register_buffer("vocab_ids", torch.zeros(c.draft_vocab, dtype=torch.int64))
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def initialise(self, generator: torch.Generator) -> None:
        """Llama's normal(0, 0.02) weights from ``generator``, then: ``W_fc`` passes the feature
        through, the attention and MLP outputs are zero (the head starts as ``h_t = f_t``) and
        ``W_fuse`` is ``[0, ..., 0, I]`` (it starts by reading the top feature alone)."""
        hidden = self.config.hidden
        with torch.no_grad():
            for linear in (self.fc, self.q, self.k, self.v, self.mlp.gate, self.mlp.up):
                linear.weight.normal_(0.0, 0.02, generator=generator)
            self.fc.weight[:, :hidden] += torch.eye(hidden)
            self.o.weight.zero_()
            self.mlp.down.weight.zero_()
            if self.fuse is not None:
                self.fuse.weight.zero_()
                self.fuse.weight[:, -hidden:] = torch.eye(hidden)

    def decoder_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The linear layers of the head's decoder layer (attention and MLP), the ones a draft may
        compute in int8, grouped by the input they read (q, k, v; o; gate, up; down: siblings of
        one input are one product, :mod:`recspec.accel.fused`); not the input projections ``fc``
        and ``fuse``, whose inputs join features and embeddings of different scales
        (:mod:`recspec.accel.int8`)."""
        return (self.q, self.k, self.v), (self.o,), (self.mlp.gate, self.mlp.up), (self.mlp.down,)

    def decoder_linears(self) -> tuple[nn.Linear, ...]:
        """:meth:`decoder_groups`' layers, in order."""
        return tuple(layer for group in self.decoder_groups() for layer in group)

    def read(self, target_features: torch.Tensor) -> torch.Tensor:
        """The head's input feature ``[..., H]`` from the target's ``[..., input_width]`` (the
        normalised fused layers, then the top feature; :func:`layer_features`): ``W_fuse`` applied,
        or the top feature itself without fused layers."""
        return target_features if self.fuse is None else self.fuse(target_features)

    def forward(self, features: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``T`` new inputs per row after ``S`` cached ones: ``features`` and ``embedded`` float
        ``[B, T, H]`` (``f`` or a guess of it, and ``e`` of the next token), int64 ``positions``
        ``[B, T]``, bool ``visible`` ``[B, T, S + T]`` (what each input attends to: cached inputs,
        then the new ones; each must see itself), ``past``: the cached keys and values
        ``[B, kv_heads, S, d]`` (None: ``S = 0``). Returns the guessed next features ``[B, T, H]``
        and the new inputs' keys and values ``[B, kv_heads, T, d]``."""
        c = self.config
        batch, count = features.shape[:2]
        u = self.fc(torch.cat((features, embedded.to(features.dtype)), dim=-1))
        y = self.attn_norm(u)
        q = rotate(self.q(y).view(batch, count, c.heads, c.head_dim).transpose(1, 2), positions, self.inv_freq)
        k = rotate(self.k(y).view(batch, count, c.kv_heads, c.head_dim).transpose(1, 2), positions, self.inv_freq)
        v = self.v(y).view(batch, count, c.kv_heads, c.head_dim).transpose(1, 2)
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2))
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], enable_gqa=True)
        u = u + self.o(attended.transpose(1, 2).reshape(batch, count, c.heads * c.head_dim))
        return self.mlp(u), k, v


def text_head_config(target, draft_vocab: int, fused_layers: Sequence[int] = ()) -> TextHeadConfig:
    """The config of a head for ``target`` (a transformers causal LM with default rotary positions)
    over ``draft_vocab`` tokens (0: all), reading its decoder layers ``fused_layers`` beside its top
    feature (each below the last layer, whose output the top feature is)."""
    config = target.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        raise RecspecError(f"a text head needs a target with default rotary positions; this one has {rope or 'none'}")
    layers = config.num_hidden_layers
    if any(not 1 <= layer < layers for layer in fused_layers):
        raise RecspecError(f"fused layers must lie in [1, {layers - 1}] (the target has {layers} decoder layers, the "
                           f"last one's output is the top feature); got {list(fused_layers)}")
    heads = config.num_attention_heads
    return TextHeadConfig(hidden=config.hidden_size, intermediate=config.intermediate_size, heads=heads,
                          kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                          head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                          rope_theta=float(rope["rope_theta"]), eps=float(getattr(config, "rms_norm_eps", 1e-6)),
                          vocab_size=target.get_output_embeddings().weight.shape[0], draft_vocab=draft_vocab,
                          fused_layers=tuple(fused_layers))


def layer_features(target, hidden_states: Sequence[torch.Tensor], fused_layers: Sequence[int]) -> torch.Tensor:
    """What a head with ``fused_layers`` reads of the target at some positions: the outputs of
    those decoder layers, each normalised by the target's final norm, then the top feature, joined
    ``[..., (len(fused_layers) + 1) * H]``; ``hidden_states`` as transformers returns them with
    ``output_hidden_states`` (the embeddings, then each layer's output, the last one after the
    final norm), each ``[..., H]``."""
    if not fused_layers:
        return hidden_states[-1]
    norm = getattr(target.get_decoder(), "norm", None)
    if norm is None:
        raise RecspecError("a head with fused layers needs a target whose decoder ends in a final norm (.norm)")
    return torch.cat([norm(hidden_states[layer]) for layer in fused_layers] + [hidden_states[-1]], dim=-1)


def new_text_head(target, vocab_ids: torch.Tensor | None, seed: int, fused_layers: Sequence[int] = ()) -> TextHead:
    """An untrained head for ``target`` (:meth:`TextHead.initialise`, seeded) over the draft
    vocabulary ``vocab_ids`` (int64 ``[D]``, distinct ids; None: the whole vocabulary), reading the
    target's layers ``fused_layers`` beside its top feature."""
    ids = torch.empty(0, dtype=torch.int64) if vocab_ids is None else torch.unique(vocab_ids.long())
    head = TextHead(text_head_config(target, len(ids), fused_layers))
    if len(ids) and not 0 <= int(ids[0]) <= int(ids[-1]) < head.config.vocab_size:
        raise RecspecError(f"draft vocabulary ids must lie in [0, {head.config.vocab_size})")
    head.vocab_ids.copy_(ids)
    head.initialise(torch.Generator().manual_seed(seed))
    return head


TEXT_HEAD = HeadKind("text_head.json", "recspec-text-head/1", lambda config: TextHead(TextHeadConfig(**config)),
                     "recspec distill --head")


def text_head_fingerprint(target_dir: Path) -> dict[str, str]:
    """What a text head is tied to: the sha256 of its target's weights (``target_dir``: the
    target's model folder)."""
    return {"target_weights_sha256": weights_fingerprint(Path(target_dir))}


def load_text_head(path: str | Path, target_dir: Path, device: torch.device | str = "cpu") -> TextHead:
    """The text head saved in ``path`` (a head folder or a training folder), refused unless it was
    trained for the target in ``target_dir``."""
    head = load_head(path, text_head_fingerprint(target_dir), device, TEXT_HEAD)
    assert isinstance(head, TextHead)
    return head


class TextHeadDraft:
    """A text head bound to its loaded target: the target's input embeddings (shared, frozen) and
    the rows of its output layer for the draft vocabulary (``weight`` ``[D, H]``, gathered once;
    the output layer itself for the whole vocabulary), the draft logits computed by :attr:`output`,
    a linear layer over them. ``ids``: int64 ``[D]``, the draft tokens' ids in the target's
    vocabulary (ascending). Binding accelerates the head's layers and :attr:`output` as a draft
    (:func:`~recspec.accel.accelerate`: on the CPU their one to a few rows run through the
    small-row products, the whole output layer sharing the target's kept copy of it). With
    ``int8`` (decoding on the CPU; never for training, whose products need gradients) the draft
    logits and the head's decoder layer (:meth:`TextHead.decoder_groups`) are int8 products
    (:mod:`recspec.accel.int8`): ``int8`` holds whether they are, where the device, the build and
    accel's switch allow it; an int8 binding computes with its own copy of ``head``
    (:attr:`head`)."""

    def __init__(self, head: TextHead, target, int8: bool = False) -> None:
        expected = text_head_config(target, head.config.draft_vocab, head.config.fused_layers)
        if expected != head.config:
            raise RecspecError(f"this text head was built for another model (its shapes {head.config} are not the "
                               f"target's {expected})")
        layer = target.get_output_embeddings()
        output = layer.weight.detach()
        self.int8 = int8 and int8_serves(output.device)
        if self.int8:  # on a copy: the head module, and other bindings of it, keep their float32 layers
            head = copy.deepcopy(head)
        self.head, self.embed = head, target.get_input_embeddings()
        if head.config.draft_vocab:
            self.ids = head.vocab_ids.to(output.device)
            self.weight = output.index_select(0, self.ids)
        else:
            self.ids, self.weight = torch.arange(output.shape[0], device=output.device), output
        self.output = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=False, device="meta")
        self.output.weight = nn.Parameter(self.weight.to(head.fc.weight.dtype), requires_grad=False)  # no copy
        accelerate(nn.ModuleList((head, self.output)), output.device,
                   int8=(*head.decoder_groups(), (self.output,)) if self.int8 else ())

    @property
    def pack(self) -> KeptWeight | None:
        """The copy of the output rows their products keep (the target's own for the whole
        vocabulary; None where accel gives them none)."""
        return getattr(self.output.forward, "pack", None)

    @property
    def fused_layers(self) -> tuple[int, ...]:
        """The target's layers the head reads beside its top feature (what a target call must
        return for it: :func:`layer_features`)."""
        return self.head.config.fused_layers

    def read(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input ``[..., H]`` from the target's features ``[..., input_width]`` as
        :func:`layer_features` gives them for :attr:`fused_layers` (:meth:`TextHead.read`)."""
        return self.head.read(features)

    def step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
             past: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`TextHead.forward` with the next tokens (int64 ``[B, T]``) embedded by the target."""
        return self.head(features, self.embed(tokens), positions, visible, past)

    def logits(self, guessed: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., D]``: the target's output layer over the draft vocabulary at features
        ``guessed`` ``[..., H]``."""
        return self.output(guessed).float()

    def log_probs(self, guessed: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., D]``: the draft distribution (log-softmax of :meth:`logits`)."""
        return torch.log_softmax(self.logits(guessed), dim=-1)

    def vocabulary_log_probs(self, guessed: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., V]``: :meth:`log_probs` over the target's whole vocabulary, ``-inf`` on
        every token outside the draft vocabulary."""
        log_q = torch.full((*guessed.shape[:-1], self.head.config.vocab_size), -torch.inf, device=guessed.device)
        return log_q.index_copy_(-1, self.ids, self.log_probs(guessed))
