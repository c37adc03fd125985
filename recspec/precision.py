"""The dtype a model is loaded in (``--dtype`` / ``--draft-dtype``): the one place a name becomes a
torch dtype, checked before any work.

Names: ``auto``, ``float32``, ``bfloat16``, ``float16``. ``auto`` keeps the dtype a checkpoint was
saved in (``dtype`` / ``torch_dtype`` in its ``config.json``, read once the folder's checksums are
checked: :func:`saved_dtype`) on CUDA, where 16-bit products are what the hardware is built for,
and is float32 on a CPU: recspec's CPU acceleration (:mod:`recspec.accel`) is float32-only, and
float32 is the precision whose answers equal transformers' within 1e-6 (docs/precision.md for what
16-bit agrees to). Every resolution says in one line which dtype was chosen and why
(:attr:`Precision.note`, logged on ``recspec.precision``).

Refused before any weight is read, each in one line: an unknown name, a 16-bit dtype the device
cannot compute (bfloat16 on a GPU without it; a torch build whose CPU kernels lack the dtype's
products), and a draft dtype other than the target's for a draft that runs on the target's own
weights and features (a head, the target's layers, a prior: it has no dtype of its own). A draft
*model* may run in any dtype: every verifier compares float32 log-probabilities of the draft and
the target (:func:`~recspec.decoding.scorer.next_log_probs`), so the draft's precision changes
its acceptance, never the answers.
"""

from __future__ import annotations

import functools
import math
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from recspec.errors import RecspecError
from recspec.hub import CONFIG_FILE, model_json, resolve_model_dir

log = logging.getLogger("recspec.precision")

AUTO = "auto"
#: The dtypes a model may be loaded in, by name.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Every name ``--dtype`` takes.
CHOICES = (AUTO, *DTYPES)
#: A model folder's checked loader: the folder of a path once its files are checked against their
#: checksums (:func:`~recspec.hub.resolve_model_dir` for a Hugging Face folder,
#: :func:`~recspec.models.checkpoint.trained_model_dir` for a trained one, whose ``best/`` it is).
CheckedFolder = Callable[[str | Path], Path]


@dataclass(frozen=True)
class Precision:
    """A resolved dtype and the one line saying which and why (``note``); ``shown``: worth
    printing (``auto`` on CUDA, where it follows the checkpoint; elsewhere it is logged only)."""

    dtype: torch.dtype
    note: str
    shown: bool = False

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``, ``bfloat16`` or ``float16`` (the name ``--dtype`` takes) of ``dtype``."""
    return str(dtype).removeprefix("torch.")


def check_name(name: str, option: str = "--dtype") -> str:
    """``name`` if ``option`` takes it (:data:`CHOICES`), else one line listing them."""
    if name not in CHOICES:
        raise RecspecError(f"{option} {name!r}: choose {', '.join(CHOICES)}")
    return name


def saved_dtype(folder: str | Path | None, checked: CheckedFolder = resolve_model_dir) -> torch.dtype | None:
    """The dtype a model folder's weights were saved in (``config.json``'s ``dtype``, or
    ``torch_dtype`` of older transformers), or None where it records none of :data:`DTYPES` (or
    there is no folder). ``config.json`` is read from the folder its ``checked`` loader returns,
    once that has checked the folder's files against their checksums: a tampered config.json is
    refused before its dtype is used."""
    if folder is None:
        return None
    config = model_json(checked(folder) / CONFIG_FILE)
    saved = config.get("dtype", config.get("torch_dtype"))
    return DTYPES.get(saved) if isinstance(saved, str) else None


@functools.cache
def cannot_compute(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why ``device`` cannot run a model in ``dtype`` (None where it can): bfloat16 on a GPU
    without it; on a CPU, a torch build whose kernels lack the dtype's products, softmax or
    attention (tried once per process on a few rows: what a decoder's call computes)."""
    if dtype == torch.float32:
        return None
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(device)} does not compute bfloat16; use float16 or float32"
        return None
    try:
        x = torch.randn(1, 1, 4, 8, device=device).to(dtype)
        mask = torch.zeros(1, 1, 4, 4, device=device, dtype=dtype)
        attended = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        out = torch.log_softmax(torch.nn.functional.linear(attended, torch.ones(8, 8, device=device, dtype=dtype)), -1)
    except RuntimeError as err:
        return f"this torch build cannot compute {dtype_name(dtype)} on the {device.type} ({str(err).splitlines()[0]})"
    if not bool(torch.isfinite(out).all()):
        return f"this torch build computes {dtype_name(dtype)} wrongly on the {device.type} (non-finite results)"
    return None


def resolve_dtype(name: str, device: str | torch.device, folder: str | Path | None = None,
                  what: str = "the target", option: str = "--dtype",
                  checked: CheckedFolder = resolve_model_dir) -> Precision:
    """The dtype ``name`` stands for when ``what`` (saved in ``folder``, which ``checked`` checks
    before its dtype is read: :func:`saved_dtype`) runs on ``device`` (module doc), its note
    logged; a name the device cannot compute is one line naming ``option``."""
    device = torch.device(device)
    if check_name(name, option) == AUTO:
        # the CPU never reads the folder here (its files are checked when the model loads)
        saved = saved_dtype(folder, checked) if device.type == "cuda" else None
        if device.type != "cuda":
            chosen, why = torch.float32, (f"on the {device.type}: recspec's CPU acceleration is float32-only; "
                                          f"pass {option} bfloat16 for 16-bit")
        elif saved is None:
            chosen, why = torch.float32, f"on {device}, no saved dtype recorded"
        elif cannot_compute(saved, device):
            why = f"on {device}, not its saved {dtype_name(saved)}: {cannot_compute(saved, device)}"
            chosen = torch.float32
        else:
            chosen, why = saved, f"on {device}, the dtype it was saved in"
        precision = Precision(chosen, f"{option} auto: {what} in {dtype_name(chosen)} ({why})", device.type == "cuda")
    else:
        dtype = DTYPES[name]
        reason = cannot_compute(dtype, device)
        if reason is not None:
            raise RecspecError(f"{option} {name}: {reason}")
        precision = Precision(dtype, f"{option} {name}: {what} in {name}")
    log.info(precision.note)
    return precision


@dataclass(frozen=True)
class Precisions:
    """The target's and the draft's resolved dtypes (the draft's is the target's without a draft
    model)."""

    target: Precision
    draft: Precision

    def notes(self) -> list[str]:
        """The lines worth printing (:attr:`Precision.shown`) saying what was chosen, the draft's
        where it is its own."""
        chosen = [self.target] + ([self.draft] if self.draft is not self.target else [])
        return [precision.note for precision in chosen if precision.shown]


def resolve_pair(dtype: str, draft_dtype: str | None, device: str | torch.device, target: str | Path | None = None,
                 draft_model: str | Path | None = None, tied: str | None = None,
                 checked: CheckedFolder = resolve_model_dir) -> Precisions:
    """The dtypes of a target (saved in ``target``) and its draft on ``device``: ``draft_dtype``
    None is the target's; a draft model (``draft_model``) may take its own; a draft with no
    weights of its own (``tied``: what it is, e.g. ``a head``; None: no draft model either) is
    refused any dtype but the target's (``tied`` names it, e.g. ``a head or prior``). ``checked``:
    the folders' checked loader (:func:`saved_dtype`)."""
    chosen = resolve_dtype(dtype, device, target, checked=checked)
    if draft_dtype is None:
        return Precisions(chosen, chosen)
    if draft_model is None:
        draft = resolve_dtype(draft_dtype, device, target, "the draft", "--draft-dtype", checked)
        if draft.dtype != chosen.dtype:
            runs = f"the draft ({tied}) runs" if tied else "no draft model is loaded: the decoder runs"
            raise RecspecError(f"--draft-dtype {draft_dtype}: {runs} in the target's dtype ({chosen.name}); only a "
                               f"draft model takes --draft-dtype")
        return Precisions(chosen, chosen)
    return Precisions(chosen, resolve_dtype(draft_dtype, device, draft_model, "the draft", "--draft-dtype", checked))


def text_precisions(dtype: str, draft_dtype: str | None, device: str | torch.device, target: Path,
                    draft: str | None = None, drafted: bool = False) -> Precisions:
    """The dtypes of a text target (its folder ``target``) and of the draft a ``drafted`` decoder
    uses: the causal LM ``draft`` (a folder or asset) in its own, a text head (``recspec distill
    --head``) or the target's layers (no ``draft``) in the target's. A text head drafts beside a
    float32 target only: its products are recspec's float32 and int8 CPU kernels, never checked in
    16-bit."""
    from recspec.models.head import is_head_dir
    from recspec.models.text_head import TEXT_HEAD

    head = drafted and draft is not None and is_head_dir(draft, TEXT_HEAD)
    model = resolve_model_dir(draft) if drafted and draft is not None and not head else None
    tied = "a text head" if head else "the target's layers" if drafted else None
    precisions = resolve_pair(dtype, draft_dtype, device, target, model, tied)
    if head and precisions.target.dtype != torch.float32:
        raise RecspecError(f"--dtype {dtype}: a text head drafts beside a float32 target only (its products are "
                           f"float32 / int8 CPU kernels); draft with the target's layers or a draft model, or use "
                           f"--dtype float32")
    return precisions


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype``'s numbers at ``magnitude``: its rounding unit there."""
    return 2.0 ** math.floor(math.log2(max(magnitude, torch.finfo(torch.float32).tiny))) * torch.finfo(dtype).eps


def tie_bound(dtype: torch.dtype, magnitude: float, levels: int) -> float:
    """How close two item scores of a model computing in ``dtype`` may be and still be ordered
    either way by two computations of one beam search (tree calls, transformers' sequential calls
    over other batch shapes): each score sums ``levels`` log-probabilities, each a difference of
    logits the model rounds to ``dtype`` and computes from hidden states rounded there, off by
    about one rounding unit (:func:`ulp`) of the logits' ``magnitude``; two candidates are
    compared, so ``2 * levels`` units. A top-K whose beam-search margin
    (:attr:`~recspec.decoding.TopK.margin`) exceeds it is decided by the model's scores, not by
    rounding (docs/precision.md has what was measured against it)."""
    return 2 * levels * ulp(dtype, magnitude)
