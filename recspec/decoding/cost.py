"""What one model call costs on this device: a fixed part plus a part per fed token.

On a CPU a call of a decoder-only model costs about ``F + r * n`` seconds for ``n`` tokens fed over
a cached prompt: ``F`` streams the weights once (matrix products over few rows are bound by
reading them), ``r`` is the arithmetic per token. Speculative decoding pays only where that
shape lets one call over many tree nodes cost little more than a call over a few: the draft tree
should be sized from ``F`` and ``r`` of the target and the draft, not from a fixed width.

:func:`measure_call_cost` times one call shape (median of repeated calls);
:func:`measure_cost_model` times calls of 1 to 64 tokens over a cached prompt and fits ``F`` and
``r`` by least squares (:func:`fit_call_cost`); :class:`CallCost` predicts the cost of a call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from recspec.accel import CallShape
from recspec.accel.lean_forward import forward_of
from recspec.decoding.cache import gather_positions
from recspec.errors import RecspecError
from recspec.hub import keep_logits_at, with_cache
from recspec.models.head import HeadDraft

#: Tokens fed per timed call of :func:`measure_cost_model` (one row over a cached prompt).
COST_SIZES = (1, 4, 16, 64)


@dataclass(frozen=True)
class CallCost:
    """``fixed_s`` + ``per_token_s`` * tokens: the seconds of one call feeding that many tokens
    (summed over the rows of a batch) over a cached prompt; ``samples``: the measured
    ``(tokens, seconds)`` pairs the fit came from; ``padded``: the model computes a call over more
    rows than it is fed (accel's :class:`~recspec.accel.CallShape`), so a call may feed up to that
    many tokens at the cost of the tokens it feeds (:meth:`free_tokens`)."""

    fixed_s: float
    per_token_s: float
    samples: tuple[tuple[int, float], ...] = ()
    padded: bool = False

    def call_s(self, tokens: int | torch.Tensor) -> float | torch.Tensor:
        """Predicted seconds of one call that feeds ``tokens`` tokens (or of calls, a tensor of counts)."""
        return self.fixed_s + self.per_token_s * tokens

    def free_tokens(self, tokens: int) -> int:
        """The most tokens (at least ``tokens``) a call may feed for the computation of ``tokens``."""
        return CallShape(self.padded).rows(tokens)

    def to_json(self) -> dict:
        return {**asdict(self), "samples": [list(pair) for pair in self.samples]}

    @classmethod
    def from_json(cls, values: dict) -> CallCost:
        return cls(float(values["fixed_s"]), float(values["per_token_s"]),
                   tuple((int(n), float(s)) for n, s in values["samples"]), bool(values.get("padded", False)))


def batch_nodes(chances: torch.Tensor, cost: CallCost) -> int:
    """The draft nodes per row, ``n`` in ``0 .. N``, that a batch's round verifies at the highest
    expected tokens per second: ``chances`` float ``[B, N]``, each row's nodes' estimated chances of
    acceptance in tree order (0 past its last node; a prefix of a row's nodes is a tree). A round
    of ``n`` nodes per row emits ``B + sum_b sum_{i < n} chances[b, i]`` tokens (every row's own
    token after its accepted path) and feeds ``B * (n + 1)`` (the roots too) at ``cost``."""
    rows, width = chances.shape
    emitted = rows + torch.cat((chances.new_zeros(1), chances.sum(dim=0).cumsum(dim=0))).double()
    fed = rows * torch.arange(1, width + 2, dtype=torch.float64)
    return int(torch.argmax(emitted / cost.call_s(fed)))


def fit_call_cost(tokens: Sequence[int], seconds: Sequence[float]) -> CallCost:
    """Least-squares ``F + r * n`` through the measured ``(tokens, seconds)`` pairs (at least two
    distinct token counts), with ``F`` and ``r`` kept non-negative (a fit whose slope comes out
    negative, timing noise on a flat curve, becomes the mean with ``r = 0``; one whose intercept
    does becomes a line through the origin)."""
    if len(set(tokens)) < 2 or len(tokens) != len(seconds):
        raise RecspecError("a call-cost fit needs timings at two or more token counts")
    n = torch.tensor(tokens, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    slope = float(((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum())
    fixed = float(t.mean()) - slope * float(n.mean())
    if slope < 0:
        slope, fixed = 0.0, float(t.mean())
    elif fixed < 0:
        fixed, slope = 0.0, float((n * t).sum() / (n * n).sum())
    return CallCost(fixed, slope, tuple(zip((int(x) for x in tokens), (float(s) for s in seconds))))


@torch.inference_mode()
def measure_call_cost(model, batch: int, seq_len: int, repeats: int = 20, past_len: int = 0,
                      warmup: int = 3, last_logits: bool = False) -> float:
    """Median wall time (seconds) of one forward call on ``batch`` x ``seq_len`` new tokens
    (``last_logits``: the output layer for the last position only, as a prefill computes it).

    With ``past_len`` > 0 the call runs over a KV cache of ``past_len`` tokens (built once, not
    timed, cropped back after each call), as a verification or draft step does. Runs on the
    model's device with its dtype, in eval mode; random token ids (the cost does not depend on them).
    """
    if batch < 1 or seq_len < 1 or repeats < 1 or past_len < 0:
        raise ValueError("batch, seq_len and repeats must be positive and past_len non-negative")
    from transformers import DynamicCache

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    new = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)
    cache = None
    if past_len:
        past = torch.randint(0, vocab, (batch, past_len), generator=generator).to(device)
        cache = DynamicCache(config=model.config)
        forward_of(model)(input_ids=past, **with_cache(model, cache), use_cache=True)
    kept = torch.arange(past_len, device=device)[None, :].expand(batch, past_len)
    keep = keep_logits_at(model, 1) if last_logits else {}
    positions = torch.arange(past_len, past_len + seq_len, device=device)[None, :].expand(batch, seq_len)
    mask = torch.ones(batch, past_len + seq_len, dtype=torch.long, device=device)

    def call() -> None:
        forward_of(model)(input_ids=new, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                          use_cache=cache is not None, **keep)
        if cache is not None:  # drop the new tokens again, through the layers' keys / values
            gather_positions(cache, kept)

    seconds = median_seconds(call, device, repeats, warmup)
    model.train(was_training)
    return seconds


def median_seconds(call: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``call()`` over ``repeats`` timed calls after ``warmup`` untimed ones,
    waiting for ``device`` before and after each."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cost_model(model, prompt_len: int, repeats: int = 10, sizes: Sequence[int] = COST_SIZES) -> CallCost:
    """``F`` and ``r`` of ``model`` on its device: one row feeding each of ``sizes`` tokens over a
    cached prompt of ``prompt_len`` tokens, median of ``repeats`` calls each, fitted by
    :func:`fit_call_cost`. Time it alone: another busy process on the same cores distorts it."""
    seconds = [measure_call_cost(model, 1, n, repeats, past_len=prompt_len) for n in sizes]
    return fit_call_cost(list(sizes), seconds)


@torch.inference_mode()
def measure_head_cost(head: HeadDraft, repeats: int = 10, sizes: Sequence[int] = COST_SIZES,
                      prompt_len: int = 64) -> CallCost:
    """``F`` and ``r`` of one drafting step of a head (:class:`~recspec.models.head.HeadDraft`):
    guessed features and log-probs for ``n`` nodes of one row, for each of ``sizes`` (over a
    prompt of ``prompt_len`` features for a head that attends)."""
    hidden = head.head.config.hidden
    context = ((torch.randn(1, prompt_len, hidden, device=head.device),
                torch.ones(1, prompt_len, dtype=torch.bool, device=head.device)) if head.attends else None)
    seconds = []
    for n in sizes:
        parent = torch.randn(1, n, hidden, device=head.device)
        tokens = head.token_ids[torch.arange(n, device=head.device) % len(head.token_ids)][None]
        level = torch.zeros(1, n, dtype=torch.int64, device=head.device)
        seconds.append(median_seconds(lambda: head.log_probs(head.features(parent, tokens, level, context)),
                                      head.device, repeats))
    return fit_call_cost(list(sizes), seconds)
