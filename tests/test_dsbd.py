"""DSBD: the layer verification samples p_beam i.i.d. (Theorem 3.1), the acceptance-count
recursion (Eq. 2-4) and widths (Eq. 5-7), and whole decodes over an item trie and over free text
against beam-sampling distributions enumerated from tiny models."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from recspec.decoding.dsbd import DSBDConfig, dsbd_beam_search
from recspec.decoding.acceptance import acceptance_counts, layer_widths, verify_layer
from recspec.decoding.support import DraftSupport
from recspec.decoding.text import TextOptions, generate
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from tests.test_specsample import fit
from tests.test_speculative import (PAD, exact_beam_sampling, goodness_of_fit, sampled_outcomes,
                                    small_llama, step_table, tiny, total_variation)

__all__ = ["tiny"]  # fixture: the 12-item trie
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- one layer, synthetic

P = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])


def drafts_from(q: torch.Tensor, rows: int, slots: int, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(q.expand(rows, -1), slots, replacement=True, generator=generator)


def test_layer_outputs_are_iid_draws_from_p_beam() -> None:
    """Theorem 3.1 for one layer, 100,000 rows: W = 2 output beams from 3 drafts are independent
    draws from p (their joint is p x p over 36 cells), whichever way they came out."""
    generator = torch.Generator().manual_seed(0)
    rows = 100_000
    choice = drafts_from(Q, rows, 3, generator)
    verdict = verify_layer(P.expand(rows, -1), Q.expand(rows, -1), choice, torch.ones(rows, 3, dtype=torch.bool),
                           torch.full((rows,), 2), 2, generator)
    pairs = verdict.chosen[:, 0] * 6 + verdict.chosen[:, 1]
    assert fit(torch.bincount(pairs, minlength=36), (P[:, None] * P[None, :]).flatten()) > 1e-3
    assert 0 < float((verdict.accepted >= 2).float().mean()) < 1  # both paths (accepted, redrawn) occur


def test_dead_parents_need_the_renormalised_proposal() -> None:
    """Drafts whose parent was rejected are dropped; the survivors are draws from q restricted to
    the live candidates and renormalised. Verified against that, the outputs follow p exactly;
    verified against the unrenormalised q (the released code's shortcut) they do not."""
    generator = torch.Generator().manual_seed(1)
    rows = 100_000
    live = torch.tensor([True, True, True, False, False, True])  # candidates of the surviving parents
    p = torch.where(live, P, 0.0) / torch.where(live, P, 0.0).sum()
    restricted = torch.where(live, Q, 0.0) / torch.where(live, Q, 0.0).sum()
    choice = drafts_from(Q, rows, 4, generator)
    survive = live[choice]
    counts = {}
    for name, q in (("renormalised", restricted), ("raw", torch.where(live, Q, 0.0))):
        verdict = verify_layer(p.expand(rows, -1), q.expand(rows, -1), choice, survive, torch.ones(rows, dtype=torch.long),
                               1, generator)
        counts[name] = torch.bincount(verdict.chosen[:, 0], minlength=6).numpy()
    assert fit(counts["renormalised"][live.numpy()], p[live]) > 1e-3
    assert fit(counts["raw"][live.numpy()], p[live]) < 1e-6


def test_verifying_over_a_drafts_support_decides_as_over_the_whole_layout() -> None:
    """A draft over 2 of 5 tokens a beam (2 beams): verified over its support plus the other column
    (:class:`DraftSupport`), the same uniforms accept the same drafts in the same slots as over the
    whole layout, with the same residual chain, and the output beams (redraws that leave the
    support included) are independent draws from p, 100,000 rows."""
    generator = torch.Generator().manual_seed(2)
    rows, beams, vocab = 100_000, 2, 5
    tokens = torch.tensor([1, 3])
    support = DraftSupport.of(tokens, beams, vocab)
    p = torch.tensor([0.05, 0.20, 0.05, 0.15, 0.05, 0.10, 0.05, 0.10, 0.20, 0.05])
    q_support = torch.tensor([0.10, 0.40, 0.30, 0.20])  # over the drafted layout [beam 0: 1, 3; beam 1: 1, 3]
    q = torch.zeros(beams * vocab).index_copy_(0, support.columns, q_support)
    drafted = drafts_from(q_support, rows, 3, generator)
    survive, width = torch.ones(rows, 3, dtype=torch.bool), torch.full((rows,), 2)
    state = generator.get_state()
    whole = verify_layer(p.expand(rows, -1), q.expand(rows, -1), support.columns[drafted], survive, width, 2, generator)
    generator.set_state(state)
    projected, outside = support.project(p.expand(rows, -1))
    assert torch.allclose(projected[0, -1], p.masked_fill(support.inside, 0.0).sum())
    verdict = verify_layer(projected, torch.nn.functional.pad(q_support, (0, 1)).expand(rows, -1), drafted, survive,
                           width, 2, generator)
    assert torch.equal(verdict.accepted, whole.accepted) and torch.equal(verdict.slot, whole.slot)
    assert torch.allclose(verdict.alpha, whole.alpha)
    chosen = support.expand(verdict.chosen, outside, generator)
    from_drafts = verdict.slot >= 0
    assert torch.equal(chosen[from_drafts], whole.chosen[from_drafts])
    assert bool((verdict.chosen == len(support.columns)).any())  # some redraws leave the support
    pairs = chosen[:, 0] * 10 + chosen[:, 1]
    assert fit(torch.bincount(pairs, minlength=100), (p[:, None] * p[None, :]).flatten()) > 1e-3


def test_acceptance_counts_match_the_verification() -> None:
    """Eq. 2-4: the distribution of the number of accepted drafts among m (no width cap) is what
    the verification does, for m = 4 and, in the same batch, m = 2."""
    generator = torch.Generator().manual_seed(2)
    rows = 60_000
    choice = drafts_from(Q, rows, 4, generator)
    m = torch.where(torch.arange(rows) % 2 == 0, 4, 2)
    survive = torch.arange(4)[None, :] < m[:, None]
    verdict = verify_layer(P.expand(rows, -1), Q.expand(rows, -1), choice, survive, torch.full((rows,), 10), 10,
                           generator)
    for size in (4, 2):
        rows_m = m == size
        predicted = acceptance_counts(verdict.alpha[rows_m][:1], torch.tensor([size]))[0, :size + 1]
        observed = torch.bincount(verdict.accepted[rows_m], minlength=size + 1).numpy()
        assert abs(float(predicted.sum()) - 1) < 1e-5
        assert fit(observed, predicted) > 1e-3


def test_layer_widths() -> None:
    """Eq. 5-7: fixed width without a threshold; with one, the largest K reached with probability
    t (at least W_min, at most the number of drafts)."""
    certain = acceptance_counts(torch.ones(1, 5), torch.tensor([4]))  # a perfect draft: all 4 accepted
    assert torch.allclose(certain[0, :5], torch.tensor([0.0, 0, 0, 0, 1]))
    hopeless = acceptance_counts(torch.zeros(1, 5), torch.tensor([4]))
    assert layer_widths(certain, torch.tensor([4]), None, 2).item() == 2
    assert layer_widths(certain, torch.tensor([4]), 0.9, 1).item() == 4
    assert layer_widths(hopeless, torch.tensor([4]), 0.9, 1).item() == 1
    half = acceptance_counts(torch.full((1, 5), 0.5), torch.tensor([4]))
    at_least = half[0].flip(0).cumsum(0).flip(0)
    for t in (0.1, 0.5, 0.9):
        width = layer_widths(half, torch.tensor([4]), t, 1).item()
        assert at_least[width] >= t and (width == 4 or at_least[width + 1] < t)
    assert layer_widths(half, torch.tensor([4]), 0.0, 1).item() == 4  # t = 0: every draft


# ------------------------------------------------------------------------------- item trie


@pytest.mark.parametrize("temperature", (0.7, 1.0))
def test_dsbd_on_a_trie_samples_the_targets_beam_sampling(tiny, temperature: float) -> None:
    """Fixed width K = 2, W_S = 3: the K items DSBD returns follow the target's with-replacement beam
    sampling exactly (enumerated), with a draft whose own beam sampling is far from it."""
    target, draft, trie, prompt = tiny
    exact = exact_beam_sampling(step_table(target, prompt, trie), trie, 2, temperature, replacement=True)
    drafted = exact_beam_sampling(step_table(draft, prompt, trie), trie, 2, temperature, replacement=True)
    assert total_variation(exact, drafted) > 0.3
    seed = 100

    def decode(batch: int):
        nonlocal seed
        seed += 1
        config = DSBDConfig(gamma=2, draft_width=3, min_width=2, warp=Warp(temperature), seed=seed)
        return dsbd_beam_search(target, draft, [prompt] * batch, trie, 2, PAD, config)[0]

    assert goodness_of_fit(sampled_outcomes(decode, 6000, 3000), exact) > 1e-3


def test_dsbd_with_its_own_target_as_draft_accepts_everything(tiny) -> None:
    """A perfect draft: every layer accepted, one target call per user, the target's exact scores."""
    target, _, trie, prompt = tiny
    prompts = [prompt, prompt[:3], prompt[1:]]
    topk, stats = dsbd_beam_search(target, target, prompts, trie, 3, PAD, DSBDConfig(draft_width=5, min_width=3))
    assert (stats.target_calls == 1).all() and (stats.accepted_steps == trie.depth - 1).all()
    for user, row in enumerate(prompts):
        table = step_table(target, row, trie)
        for tokens, score in zip(topk.tokens[user].tolist(), topk.scores[user].tolist()):
            exact = sum(float(table[tuple(tokens[:i])][tokens[i]]) for i in range(trie.depth))
            assert math.isclose(score, exact, abs_tol=1e-4)


def test_dynamic_width_and_one_cache(tiny) -> None:
    """With a threshold the widths follow the draft's agreement (wide with the target itself,
    narrower with a random draft); one-KV-cache mode keeps one beam between rounds and still
    returns K real items."""
    target, draft, trie, prompt = tiny
    config = DSBDConfig(gamma=1, draft_width=4, min_width=1, threshold=0.5)
    _, perfect = dsbd_beam_search(target, target, [prompt] * 50, trie, 2, PAD, config)
    _, random = dsbd_beam_search(target, draft, [prompt] * 50, trie, 2, PAD, config)
    inner = lambda s: (s.width_sum - 2) / (s.steps - 1)  # noqa: E731  mean width before the last layer
    assert (inner(perfect) == 4).all() and float(inner(random).mean()) < 4 and bool((inner(random) < 4).any())
    one = DSBDConfig(gamma=1, draft_width=4, min_width=2, one_cache=True)
    topk, stats = dsbd_beam_search(target, draft, [prompt] * 50, trie, 2, PAD, one)
    assert (topk.items >= 0).all()
    # the first round feeds the prompt and one drafted layer of 4; every later round one input beam and
    # the layers it drafts
    assert torch.equal(stats.tree_nodes, 4 + (stats.rounds - 1) + 4 * (stats.drafted_steps - 1))
    _, full = dsbd_beam_search(target, draft, [prompt] * 50, trie, 2, PAD, DSBDConfig(gamma=1, draft_width=4))
    assert bool((full.tree_nodes > 4 + (full.rounds - 1) + 4 * (full.drafted_steps - 1)).any())


def test_text_dsbd_drafts_as_many_beams_a_layer_as_it_keeps_unless_told() -> None:
    """W_S defaults to W (the fastest with a text head on a CPU, where every drafted node costs
    the target a row); an explicit W_S stands."""
    assert TextOptions(beams=3).dsbd().draft_width == 3
    assert TextOptions(beams=3, draft_width=5).dsbd().draft_width == 5


def test_bad_dsbd_settings_fail_before_any_work(tiny) -> None:
    target, draft, trie, prompt = tiny
    for config, message in ((DSBDConfig(draft_width=1, min_width=2), "W_S=1 is below W_min=2"),
                            (DSBDConfig(threshold=-0.1), r"threshold t must lie in \[0, 1\]"),
                            (DSBDConfig(gamma=0), r"gamma=0 is outside \[1, 2\]"),
                            (DSBDConfig(warp=Warp(0.0)), "temperature must be a positive number")):
        with pytest.raises(RecspecError, match=message):
            dsbd_beam_search(target, draft, [prompt], trie, 2, PAD, config)


# ------------------------------------------------------------------------------- free text

TEXT_VOCAB, EOS, DEPTH = 4, 3, 3


def exact_text_beam_sampling(model, prompt: torch.Tensor, width: int, warp: Warp) -> dict:
    """Probability of each multiset of ``width`` texts (:func:`canonical`) under text beam sampling
    over TEXT_VOCAB for up to DEPTH steps: a text that ended (with EOS) continues with EOS at
    probability 1, and sampling stops once every beam has ended. Enumerated step by step."""
    cache = {}

    def log_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix and prefix[-1] == EOS:
            return torch.tensor([-math.inf] * EOS + [0.0], dtype=torch.float64)
        if prefix not in cache:
            with torch.no_grad():
                ids = torch.cat((prompt, torch.tensor(prefix, dtype=torch.int64)))
                cache[prefix] = torch.log_softmax(model(input_ids=ids[None]).logits[0, -1].double(), -1)
        return cache[prefix]

    states: Counter = Counter({((),): 1.0})
    scores = {(): 0.0}
    for _ in range(DEPTH):
        following: Counter = Counter()
        for beams, probability in states.items():
            if all(EOS in beam for beam in beams):
                following[beams] += probability
                continue
            cands = [prefix + (t,) for prefix in beams for t in range(TEXT_VOCAB)]
            for cand in cands:
                scores[cand] = scores[cand[:-1]] + float(log_probs(cand[:-1])[cand[-1]])
            weights = warp(torch.tensor([scores[c] for c in cands], dtype=torch.float64)).double().exp().tolist()
            for picks in itertools.product(range(len(cands)), repeat=width):
                following[tuple(sorted(cands[i] for i in picks))] += probability * math.prod(weights[i] for i in picks)
        states = following
    exact: Counter = Counter()
    for beams, probability in states.items():
        exact[tuple(sorted(canonical(beam) for beam in beams))] += probability
    return dict(exact)


def canonical(beam: Sequence[int]) -> tuple[int, ...]:
    """A text cut after its first EOS, padded with EOS to DEPTH tokens."""
    beam = list(beam)
    if EOS in beam:
        beam = beam[:beam.index(EOS) + 1]
    return tuple(beam + [EOS] * (DEPTH - len(beam)))


def test_text_dsbd_and_beam_sampling_match_the_enumeration() -> None:
    """Text beam sampling (W = 2, end token absorbing) and DSBD over the free vocabulary both
    sample the enumerated distribution of output beam pairs."""
    target = small_llama(TEXT_VOCAB, seed=4, width=16, init=0.5)
    draft = small_llama(TEXT_VOCAB, seed=5, width=16, init=0.5)
    prompt = torch.tensor([1, 2, 0, 1])
    warp = Warp(1.0)
    exact = exact_text_beam_sampling(target, prompt, 2, warp)
    assert sum(p for beams, p in exact.items() if any(b[1] == EOS for b in beams)) > 0.1  # early ends matter
    from recspec.decoding.prompts import left_pad
    from recspec.decoding.dsbd import dsbd_batch
    from recspec.decoding.space import FreeText
    from recspec.decoding.text import beam_sample

    space = FreeText(TEXT_VOCAB, DEPTH, EOS)
    prompts = left_pad([prompt] * 5000, PAD, torch.device("cpu"))
    outcomes = {}
    with torch.inference_mode():
        _, tokens = beam_sample(target, prompts, space, 2, warp, torch.Generator().manual_seed(0))
        outcomes["beam-sample"] = tokens
        config = TextOptions(max_new_tokens=DEPTH, gamma=2, beams=2, draft_width=3).dsbd()
        outcomes["dsbd"] = dsbd_batch(target, draft, prompts, space, 2, config, torch.Generator().manual_seed(1),
                                      ends=space).tokens[:, :2]
    for name, tokens in outcomes.items():
        counts = Counter(tuple(sorted(canonical(beam) for beam in row)) for row in tokens.tolist())
        assert goodness_of_fit(counts, exact) > 1e-3, name
    text = generate("dsbd", target, draft, [prompt] * 3, TextOptions(max_new_tokens=DEPTH, gamma=2, beams=2,
                                                                     draft_width=3), PAD, EOS)
    assert all(1 <= len(tokens) <= DEPTH for tokens in text.tokens)
