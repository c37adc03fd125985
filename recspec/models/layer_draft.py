"""A draft made of a subset of the target's own decoder layers (self-speculative drafting).

The draft is the target with most of its middle layers skipped: its token embeddings, the chosen
decoder layers in order, its final norm and output layer, all sharing the target's weight tensors
(no copy, no training). Keeping the first few layers *and* the last one or two usually agrees
with the target far better than an early exit, because the last layers map the residual stream
onto the output vocabulary; `recspec bench sampling` reports the measured acceptance of the
layer sets it was chosen from.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

from recspec.errors import RecspecError
from recspec.models.head import is_head_dir
from recspec.models.text_head import TEXT_HEAD, TextHeadDraft, load_text_head

#: The layers of SmolLM2-135M-Instruct (30 layers) that `recspec generate` drafts with by default.
DEFAULT_DRAFT_LAYERS = "0-5,29"


def parse_layers(spec: str, count: int) -> list[int]:
    """Layer indices from ``"0-5,29"`` (ranges inclusive)."""
    layers: list[int] = []
    try:
        for part in spec.split(","):
            low, dash, high = part.strip().partition("-")
            layers += list(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        raise RecspecError(f"draft layers {spec!r}: give indices and ranges like 0-5,29") from None
    if not layers or any(not 0 <= layer < count for layer in layers) or len(set(layers)) != len(layers):
        raise RecspecError(f"draft layers {spec!r}: need distinct layers in [0, {count}) of the target")
    return layers


def select_layers(config, layers: Sequence[int]) -> None:
    """Make the transformers ``config`` describe its model's decoder ``layers`` alone, in that
    order (the layer count, and the per-layer attention types where the config has them)."""
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in layers]
    config.num_hidden_layers = len(layers)


def keep_first_layers(model, count: int) -> None:
    """Cut ``model`` (a transformers decoder-only model with ``model.model.layers``) to its first
    ``count`` decoder layers, in place: the embeddings, final norm and output layer stay, the
    layers after ``count`` are dropped (their weights freed)."""
    total = len(model.model.layers)
    if not 0 < count <= total:
        raise RecspecError(f"cannot keep {count} of the model's {total} decoder layers")
    model.model.layers = model.model.layers[:count]
    select_layers(model.config, range(count))


def layer_draft(model, layers: Sequence[int]):
    """A causal LM of the same class as ``model`` (a transformers decoder-only model with
    ``model.model.layers``) over ``layers`` of it, sharing every weight tensor with it."""
    config = copy.deepcopy(model.config)
    select_layers(config, layers)
    draft = type(model)(config).to(model.device, model.dtype).eval()
    shared = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) in layers:
                shared[f"model.layers.{layers.index(int(index))}.{rest}"] = tensor
        else:
            shared[name] = tensor
    draft.load_state_dict(shared, assign=True)
    return draft


def text_draft_model(model, draft: str | None, layers: str | None = None, target_dir: Path | None = None,
                     int8: bool = True, dtype: torch.dtype | None = None):
    """The draft of the text decoders: a text head folder ``draft`` (`recspec distill --head`,
    bound to ``model``; ``target_dir``: the model's folder, whose weights the head must have been
    trained on; with ``int8`` its draft logits and decoder layer in int8 on the CPU,
    :mod:`recspec.accel.int8`), the
    causal-LM folder or asset ``draft`` (e.g. `recspec distill`'s ``OUT/best``; in ``dtype``, None:
    the target's, :func:`~recspec.precision.text_precisions`), else ``layers``
    of ``model`` (default :data:`DEFAULT_DRAFT_LAYERS`) as :func:`layer_draft`."""
    if draft is not None and is_head_dir(draft, TEXT_HEAD):
        if target_dir is None:
            raise RecspecError(f"{draft}: a text head is checked against its target's folder; none was given")
        return TextHeadDraft(load_text_head(draft, target_dir, model.device), model, int8)
    if draft is not None:
        from recspec.models.hf import load_causal_lm

        return load_causal_lm(draft, device=model.device, dtype=dtype or model.dtype)
    return layer_draft(model, parse_layers(layers or DEFAULT_DRAFT_LAYERS, model.config.num_hidden_layers))
