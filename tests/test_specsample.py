"""Speculative sampling (Leviathan et al.), its lenience, TopK-ImpSpecDec, warping and the text
decoders' plain sampling: output distributions against distributions enumerated from tiny
models, with chi-square tests at fixed seeds."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import numpy as np
from scipy.stats import chisquare

from recspec.decoding.acceptance import expected_speedup, expected_tokens_per_call, verify_chain
from recspec.decoding.text import TextOptions, generate, log_likelihood
from recspec.decoding.chains import importance_proposal
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from tests.test_speculative import goodness_of_fit, small_llama, total_variation

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, LENGTH = 6, 3
PROMPT = torch.tensor([1, 4, 2, 5])


@pytest.fixture(scope="module")
def models():
    """A random target over 6 tokens and a random draft that disagrees with it."""
    return small_llama(VOCAB, seed=0, width=16, init=0.5), small_llama(VOCAB, seed=1, width=16, init=0.5)


def next_table(model, length: int) -> dict[tuple[int, ...], torch.Tensor]:
    """Raw float64 log-probs of the next token after the prompt and every prefix shorter than
    ``length``, by plain forwards."""
    table = {}
    with torch.no_grad():
        for size in range(length):
            for prefix in itertools.product(range(VOCAB), repeat=size):
                ids = torch.cat((PROMPT, torch.tensor(prefix, dtype=torch.int64)))
                table[prefix] = torch.log_softmax(model(input_ids=ids[None]).logits[0, -1].double(), -1)
    return table


def sequence_distribution(step) -> dict[tuple[int, ...], float]:
    """Probability of every sequence of LENGTH tokens from a per-prefix distribution ``step``."""
    return {seq: math.prod(float(step(seq[:i])[seq[i]]) for i in range(LENGTH))
            for seq in itertools.product(range(VOCAB), repeat=LENGTH)}


def sampled(method: str, target, draft, options: TextOptions, draws: int) -> dict[tuple[int, ...], int]:
    result = generate(method, target, draft, [PROMPT] * draws, options, pad_token_id=0, eos=None)
    counts: dict[tuple[int, ...], int] = {}
    for tokens in result.tokens:
        assert len(tokens) == LENGTH
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


def fit(observed: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Chi-square p-value of the counts ``observed`` against ``probabilities`` (same shape, summing
    to 1 over the cells that are tested), in float64 so that the two totals agree exactly."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(probabilities, dtype=np.float64)
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


WARPS = [Warp(0.7), Warp(1.0), Warp(1.3, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("warp", WARPS, ids=["T0.7", "T1", "T1.3-k4-p0.9"])
def test_spec_sample_draws_the_target_distribution(models, warp: Warp) -> None:
    """Exactness (Theorem A.1) at several warpings: the sequences speculative sampling emits, and
    those plain sampling emits, follow the target's warped distribution, with a draft far from it."""
    target, draft = models
    table, draft_table = next_table(target, LENGTH), next_table(draft, LENGTH)
    exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    assert total_variation(exact, sequence_distribution(lambda prefix: warp(draft_table[prefix]).exp())) > 0.25
    options = TextOptions(max_new_tokens=LENGTH, warp=warp, gamma=2, seed=11)
    assert goodness_of_fit(sampled("spec-sample", target, draft, options, 6000), exact) > 1e-3
    assert goodness_of_fit(sampled("sample", target, None, options, 6000), exact) > 1e-3


def lenient(p: torch.Tensor, q: torch.Tensor, lenience: float) -> torch.Tensor:
    """P_l of specsample's module doc (a drafted position's output distribution)."""
    accept = torch.minimum(q, p / lenience).sum()
    return torch.minimum(q, p / lenience) + (1 - accept) * (p - lenience * q).clamp(min=0) / (1 - lenience * accept)


def test_lenience_bounds_every_token_by_p_over_l(models) -> None:
    """A.5 with l = 0.4: every drafted position follows P_l exactly (gamma >= the length, so no
    bonus token occurs), P_l never exceeds p / l, and it differs from p (lenience changes the
    output)."""
    target, draft = models
    lenience, warp = 0.4, Warp(1.0)
    table, draft_table = next_table(target, LENGTH), next_table(draft, LENGTH)
    steps = {prefix: lenient(warp(table[prefix]).exp(), warp(draft_table[prefix]).exp(), lenience) for prefix in table}
    for prefix, step in steps.items():
        p = warp(table[prefix]).exp()
        assert torch.all(step <= p / lenience + 1e-12) and abs(float(step.sum()) - 1) < 1e-9
    exact = sequence_distribution(steps.__getitem__)
    counts = sampled("spec-sample", target, draft, TextOptions(max_new_tokens=LENGTH, warp=warp, gamma=LENGTH,
                                                             lenience=lenience, seed=5), 6000)
    assert goodness_of_fit(counts, exact) > 1e-3
    target_exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    assert total_variation(exact, target_exact) > 0.1
    total = sum(counts.values())
    first = torch.zeros(VOCAB, dtype=torch.float64)
    for seq, count in counts.items():
        first[seq[0]] += count / total
    bound = warp(table[()]).exp() / lenience
    assert torch.all(first <= bound + 4 * (bound / total).sqrt())  # empirically too, within sampling noise


def importance_step(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """topk_imp's module doc: the output distribution of a drafted position."""
    r = importance_proposal(q[None].float(), p[None].float(), k)[0].double()
    accepted = r * torch.clamp(p / q, max=1)
    residual = (p - q).clamp(min=0)
    return accepted + (1 - accepted.sum()) * residual / residual.sum()


def test_topk_imp_samples_its_own_distribution_not_the_targets(models) -> None:
    """TopK-ImpSpecDec as the paper specifies it samples P (topk_imp module doc), measurably away
    from the target's distribution, and accepts more drafted tokens than speculative sampling."""
    target, draft = models
    warp, k = Warp(1.0), 3
    table, draft_table = next_table(target, LENGTH), next_table(draft, LENGTH)
    exact = sequence_distribution(
        lambda prefix: importance_step(warp(table[prefix]).exp(), warp(draft_table[prefix]).exp(), k))
    options = TextOptions(max_new_tokens=LENGTH, warp=warp, gamma=LENGTH, candidates=k, seed=3)
    result = generate("topk-imp", target, draft, [PROMPT] * 6000, options, pad_token_id=0, eos=None)
    counts: dict[tuple[int, ...], int] = {}
    for tokens in result.tokens:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert goodness_of_fit(counts, exact) > 1e-3
    target_exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    assert goodness_of_fit(counts, target_exact) < 1e-6
    spec = generate("spec-sample", target, draft, [PROMPT] * 2000, options, pad_token_id=0, eos=None).stats
    imp = result.stats
    assert float(imp.accepted_steps.sum() / imp.drafted_steps.sum()) > float(
        spec.accepted_steps.sum() / spec.drafted_steps.sum())
    assert (imp.target_calls >= imp.rounds * (options.gamma + 1)).all()  # one target call per drafted token


def test_verify_chain_per_position() -> None:
    """The verifier alone, 200,000 rows at once: the first emitted token follows p (l = 1), the
    number of accepted tokens is capped geometric in the acceptance rate, and ``alpha`` is
    sum min(p, q)."""
    generator = torch.Generator().manual_seed(0)
    rows, gamma = 200_000, 2
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    drafts = torch.multinomial(q.expand(rows, -1), gamma, replacement=True, generator=generator)
    verdict = verify_chain(drafts, q.expand(rows, gamma, -1), p.expand(rows, gamma + 1, -1), generator)
    first = torch.where(verdict.accepted > 0, drafts[:, 0], verdict.token)
    assert fit(torch.bincount(first, minlength=4), p) > 1e-3
    alpha = float(torch.minimum(p, q).sum())
    assert torch.allclose(verdict.alpha, torch.tensor(alpha))
    counts = torch.bincount(verdict.accepted, minlength=gamma + 1).numpy()
    assert fit(counts, torch.tensor([1 - alpha, alpha * (1 - alpha), alpha ** 2])) > 1e-3


def test_verify_chain_with_a_shorter_chain_per_row() -> None:
    """Rows whose own chain is shorter than the batch's (``lengths``): at most that many drafts
    are accepted, and a row that accepts all of its own draws the next token from the target's
    distribution after them (not the residual): the second token follows ``p2`` (l = 1)."""
    generator = torch.Generator().manual_seed(1)
    rows, gamma = 200_000, 3
    p1, p2 = torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.1, 0.1, 0.2, 0.6])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    drafts = torch.multinomial(q.expand(rows, -1), gamma, replacement=True, generator=generator)
    p = torch.stack((p1, p2, p2, p2))  # after the prefix, then after each drafted prefix
    lengths = torch.where(torch.arange(rows) % 2 == 0, 1, gamma)
    verdict = verify_chain(drafts, q.expand(rows, gamma, -1), p.expand(rows, gamma + 1, -1), generator,
                           lengths=lengths)
    short = lengths == 1
    assert int(verdict.accepted[short].max()) == 1 and int(verdict.accepted[~short].max()) == gamma
    accepted_one = short & (verdict.accepted == 1)
    assert fit(torch.bincount(verdict.token[accepted_one], minlength=4), p2) > 1e-3
    first = torch.where(verdict.accepted[short] > 0, drafts[short, 0], verdict.token[short])
    assert fit(torch.bincount(first, minlength=4), p1) > 1e-3


def test_theorem_3_8() -> None:
    assert expected_tokens_per_call(0.0, 4) == 1.0 and expected_tokens_per_call(1.0, 4) == 5.0
    assert math.isclose(expected_tokens_per_call(0.5, 2), 1.75)
    assert math.isclose(expected_speedup(0.8, 3, 0.05), (1 - 0.8 ** 4) / (0.2 * 1.15))
    assert math.isclose(expected_speedup(0.8, 3, 0.05, verify_ratio=1.4), (1 - 0.8 ** 4) / (0.2 * 1.55))


def test_warp_top_k_top_p() -> None:
    log_probs = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]]))
    assert torch.allclose(Warp(top_k=1)(log_probs).exp(), torch.tensor([[1.0, 0, 0, 0]]))
    assert torch.allclose(Warp(top_k=2)(log_probs).exp(), torch.tensor([[5 / 9, 2 / 9, 2 / 9, 0]]))  # ties kept
    assert torch.allclose(Warp(top_p=0.6)(log_probs).exp(), torch.tensor([[5 / 7, 2 / 7, 0, 0]]))
    assert torch.allclose(Warp(2.0)(log_probs).exp().sum(), torch.tensor(1.0))


class Untouchable:
    """A model whose use fails the test: errors must come before any work."""

    def __init__(self, vocab: int) -> None:
        self.config = small_llama(vocab, seed=0).config
        self.device = torch.device("cpu")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the model ran before the settings were checked")


@pytest.mark.parametrize(("method", "options", "message"), [
    ("spec-sample", TextOptions(gamma=0), "gamma must be a positive integer"),
    ("topk-imp", None, "needs a draft model"),
    ("sample", TextOptions(warp=Warp(0.0)), "temperature must be a positive number"),
    ("spec-sample", TextOptions(warp=Warp(-1.0)), "temperature must be a positive number"),
    ("beam-sample", TextOptions(warp=Warp(top_p=0.0)), r"top-p must lie in \(0, 1\]"),
    ("dsbd", TextOptions(warp=Warp(top_p=1.5)), r"top-p must lie in \(0, 1\]"),
    ("sample", TextOptions(warp=Warp(top_k=0)), "top-k must be a positive integer"),
    ("spec-sample", TextOptions(lenience=0.0), r"lenience must lie in \(0, 1\]"),
    ("dsbd", TextOptions(beams=3, draft_width=2), "draft width W_S=2 is below W_min=3"),
    ("dsbd", TextOptions(threshold=1.5), r"threshold t must lie in \[0, 1\]"),
    ("dsbd", TextOptions(gamma=0), "gamma must be a positive integer"),
    ("topk-imp", TextOptions(candidates=0), "top-K candidates must be positive"),
    ("spec-sample", TextOptions(max_new_tokens=1), "max_new_tokens must be an integer of at least 2"),
    ("nucleus", TextOptions(), "unknown decoder"),
])
def test_bad_settings_fail_before_any_work(method: str, options: TextOptions, message: str) -> None:
    model = Untouchable(VOCAB)
    with pytest.raises(RecspecError, match=message):
        generate(method, model, model if options else None, [PROMPT], options or TextOptions(), pad_token_id=0,
                 eos=None)


def test_end_token_stops_and_log_likelihood(models) -> None:
    """Every method stops a text at its first end token; the log-likelihood is the mean of the
    target's log-probs of the emitted tokens."""
    target, draft = models
    eos = 2
    options = TextOptions(max_new_tokens=8, gamma=3, beams=2, draft_width=3, seed=1)
    for method in ("sample", "spec-sample", "topk-imp", "beam-sample", "dsbd"):
        result = generate(method, target, draft, [PROMPT] * 40, options, pad_token_id=0, eos=eos)
        for tokens in result.tokens:
            assert 1 <= len(tokens) <= 8 and eos not in tokens[:-1]
            assert tokens[-1] == eos or len(tokens) == 8
        assert any(tokens[-1] == eos for tokens in result.tokens), method
    tokens = result.tokens[0]
    expected = []
    with torch.no_grad():
        for i, token in enumerate(tokens):
            ids = torch.cat((PROMPT, torch.tensor(tokens[:i], dtype=torch.int64)))
            expected.append(float(torch.log_softmax(target(input_ids=ids[None]).logits[0, -1], -1)[token]))
    scored = log_likelihood(target, [PROMPT, PROMPT[:3]], [tokens, tokens[:2]], pad_token_id=0)
    assert math.isclose(float(scored[0]), sum(expected) / len(expected), abs_tol=1e-4)
