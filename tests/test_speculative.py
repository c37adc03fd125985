"""Speculative beam search (AtSpeed): strict verification returns exactly what beam search returns;
relaxed sampling verification samples the target's beam-sampling distribution (exactly, with
replacement; approximately, without) and exact sampling verification samples it exactly (both
ways), checked against distributions enumerated by hand."""

from __future__ import annotations

import copy

import itertools
import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from recspec.decoding import beam_search
from recspec.decoding.beam_search import sampling_beam_search
from recspec.decoding.speculative_beam import SpecConfig, speculative_beam_search
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie
from tests.test_beam import CONTROL, PAD, SETUPS, Setup, make_setup

pytestmark = pytest.mark.usefixtures("one_thread")

KS = (1, 3, 5, 10, 20)


def small_llama(vocab: int, seed: int, width: int = 32, init: float = 0.3, layers: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, initializer_range=init,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=sorted(SETUPS))
def setup(request) -> Setup:
    return SETUPS[request.param]()


# ----------------------------------------------------------------------------------- strict


@pytest.mark.parametrize("k", KS)
def test_strict_equals_beam_search(setup: Setup, k: int) -> None:
    """Same items, order and scores as beam search, for several N and gamma, batched or not, with
    a draft that disagrees with the target and with the target as its own draft."""
    reference = beam_search(setup.model, setup.prompts, setup.trie, k, PAD)
    draft = small_llama(setup.model.config.vocab_size, seed=11)
    longest = setup.trie.depth - 1
    for draft_model, n, gamma, batch in ((draft, k, None, None), (draft, 2 * k, 1, 3), (draft, max(k, 40), None, 1),
                                         (draft, 3 * k, longest, 4), (setup.model, k, None, None)):
        result = speculative_beam_search(setup.model, draft_model, setup.prompts, setup.trie, k, PAD,
                                         SpecConfig(draft_beams=n, gamma=gamma), batch_size=batch)
        assert torch.equal(result.topk.items, reference.items), (n, gamma, batch)
        torch.testing.assert_close(result.topk.scores, reference.scores, atol=1e-4, rtol=0)
        assert torch.equal(result.topk.tokens, reference.tokens)
        stats = result.stats
        assert torch.equal(stats.target_calls, stats.rounds)  # the prompt goes with the first round
        assert (stats.accepted_steps <= stats.rounds * longest).all()
    self_drafted = speculative_beam_search(setup.model, setup.model, setup.prompts, setup.trie, k, PAD,
                                           SpecConfig(draft_beams=k))
    assert (self_drafted.stats.target_calls == 1).all()  # a perfect draft: one target call per user
    assert (self_drafted.stats.accepted_steps == longest).all()


def test_strict_stats_count_calls_and_nodes() -> None:
    setup = SETUPS["L4"]()
    draft = small_llama(setup.model.config.vocab_size, seed=3)
    result = speculative_beam_search(setup.model, draft, setup.prompts[:1], setup.trie, 5, PAD,
                                     SpecConfig(draft_beams=8))
    stats = result.stats
    rounds = int(stats.rounds[0])
    assert rounds >= 1 and int(stats.target_calls[0]) == rounds
    # first round: draft prefill + 2 draft calls (levels 1, 2; level 3 comes from level 2's call);
    # later rounds also feed their pending beams
    assert int(stats.draft_calls[0]) >= 3
    assert int(stats.tree_nodes[0]) >= 8 * 3  # three drafted levels of N = 8 in the first round
    assert float(stats.verify_s[0]) > 0 and float(stats.draft_s[0]) > 0


def test_bad_settings_fail_before_any_work() -> None:
    setup = SETUPS["L3"]()
    draft = small_llama(setup.model.config.vocab_size, seed=1)
    cases = [(SpecConfig(draft_beams=4), 5, "must be at least k=5"),
             (SpecConfig(gamma=0), 2, r"gamma=0 is outside \[1, 2\]"),
             (SpecConfig(gamma=3), 2, r"gamma=3 is outside \[1, 2\]"),
             (SpecConfig(verify="relaxed", temperature=0.0), 2, "temperature must be a positive number"),
             (SpecConfig(verify="lenient"), 2, "unknown verification")]
    for config, k, message in cases:
        with pytest.raises(RecspecError, match=message):
            speculative_beam_search(setup.model, draft, setup.prompts, setup.trie, k, PAD, config)
    other = small_llama(setup.model.config.vocab_size + 3, seed=1)
    with pytest.raises(RecspecError, match="vocabulary"):
        speculative_beam_search(setup.model, other, setup.prompts, setup.trie, 2, PAD)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_strict_on_cuda() -> None:
    setup = SETUPS["L4-gqa"]()
    model = setup.model.cuda()
    draft = small_llama(model.config.vocab_size, seed=2).cuda()
    reference = beam_search(model, setup.prompts, setup.trie, 5, PAD)
    result = speculative_beam_search(model, draft, setup.prompts, setup.trie, 5, PAD, SpecConfig(draft_beams=10))
    assert torch.equal(result.topk.items.cpu(), reference.items.cpu())


# ---------------------------------------------------------------------------------- relaxed


TEMPERATURES = (0.7, 1.0)


@pytest.fixture(scope="module")
def tiny() -> tuple[LlamaForCausalLM, LlamaForCausalLM, ItemTrie, torch.Tensor]:
    """A 3-level trie of 2 x 2 x 3 = 12 items over a 12-token vocabulary, a random target and a
    random draft that disagrees with it, and one prompt."""
    first, second, third = [4, 5], [6, 7], [8, 9, 10]
    codes = torch.tensor(list(itertools.product(first, second, third)))
    vocab = 12
    target = small_llama(vocab, seed=0, width=16, init=0.5)
    draft = small_llama(vocab, seed=1, width=16, init=0.5)
    return target, draft, ItemTrie(codes, vocab), torch.tensor([1, 2, 3, 11, 2])


def step_table(model, prompt: torch.Tensor, trie: ItemTrie) -> dict[tuple[int, ...], torch.Tensor]:
    """log p(next token | prompt + prefix) for every prefix of the trie (float64 [V]), by plain
    forwards."""
    table, prefixes = {}, [()]
    with torch.no_grad():
        for _ in range(trie.depth):
            for prefix in prefixes:
                ids = torch.cat((prompt, torch.tensor(prefix, dtype=torch.int64)))
                table[prefix] = torch.log_softmax(model(input_ids=ids[None]).logits[0, -1].double(), -1)
            prefixes = [prefix + (t,) for prefix in prefixes for t in children_of(trie, prefix)]
    return table


def children_of(trie: ItemTrie, prefix: tuple[int, ...]) -> list[int]:
    tokens, real = trie.children(trie.walk(torch.tensor([prefix], dtype=torch.int64)))
    return [int(t) for t, r in zip(tokens[0], real[0]) if r]


def exact_beam_sampling(table, trie: ItemTrie, k: int, temperature: float, replacement: bool) -> dict:
    """Probability of each output multiset of k items (sorted tuple of item tokens) under beam
    sampling with ``k`` beams, by enumerating every sequence of draws."""
    outcomes: Counter = Counter()

    def step(beams: list[tuple[tuple[int, ...], float]], depth: int, probability: float) -> None:
        if depth == trie.depth:
            outcomes[tuple(sorted(prefix for prefix, _ in beams))] += probability
            return
        cands = [(prefix + (t,), score + float(table[prefix][t])) for prefix, score in beams
                 for t in children_of(trie, prefix)]
        logits = torch.tensor([score for _, score in cands], dtype=torch.float64) / temperature
        weights = torch.softmax(logits, 0).tolist()
        for picks in itertools.product(range(len(cands)), repeat=k):
            if replacement:
                p = math.prod(weights[i] for i in picks)
            else:
                if len(set(picks)) < k:
                    continue
                p, left = 1.0, 1.0
                for i in picks:
                    p *= weights[i] / left
                    left -= weights[i]
            step([cands[i] for i in picks], depth + 1, probability * p)

    step([((), 0.0)], 0, 1.0)
    return outcomes


def sampled_outcomes(decode, draws: int, batch: int) -> Counter:
    counts: Counter = Counter()
    for _ in range(draws // batch):
        result = decode(batch)
        for row in result.tokens.tolist():
            counts[tuple(sorted(tuple(t) for t in row))] += 1
    return counts


def goodness_of_fit(counts: Counter, exact: dict) -> float:
    """Chi-square p-value of ``counts`` against ``exact`` probabilities, pooling outcomes whose
    expected count is below 5 into one cell."""
    total = sum(counts.values())
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for outcome, p in exact.items():
        if p * total >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(p * total)
        else:
            pooled_o += counts.get(outcome, 0)
            pooled_e += p * total
    assert sum(counts[o] for o in counts if o not in exact) == 0, "an outcome the enumeration excludes"
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    return float(chisquare(observed, expected).pvalue)


def relaxed(target, draft, trie, prompt, k, temperature, replacement, seed):
    def decode(batch: int):
        nonlocal seed
        seed += 1
        config = SpecConfig(verify="relaxed", temperature=temperature, replacement=replacement, seed=seed)
        return speculative_beam_search(target, draft, [prompt] * batch, trie, k, PAD, config).topk
    return decode


def target_sampling(target, trie, prompt, k, temperature, replacement, seed):
    def decode(batch: int):
        nonlocal seed
        seed += 1
        return sampling_beam_search(target, [prompt] * batch, trie, k, PAD, temperature, seed, replacement)
    return decode


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_relaxed_k1_samples_the_target_distribution(tiny, temperature: float) -> None:
    """K = 1: relaxed speculative sampling and the target's own sampling both follow the exact
    item distribution (product of the tempered, trie-renormalised step distributions)."""
    target, draft, trie, prompt = tiny
    table = step_table(target, prompt, trie)
    exact = exact_beam_sampling(table, trie, 1, temperature, replacement=True)
    draft_exact = exact_beam_sampling(step_table(draft, prompt, trie), trie, 1, temperature, replacement=True)
    assert 0.5 * sum(abs(exact[o] - draft_exact.get(o, 0)) for o in exact) > 0.2  # a draft worth verifying
    spec = sampled_outcomes(relaxed(target, draft, trie, prompt, 1, temperature, True, 100), 6000, 500)
    own = sampled_outcomes(target_sampling(target, trie, prompt, 1, temperature, True, 200), 6000, 500)
    assert goodness_of_fit(spec, exact) > 1e-3
    assert goodness_of_fit(own, exact) > 1e-3


def test_relaxed_k2_with_replacement_is_exact(tiny) -> None:
    """K = 2, independent draws: every output slot is one draw from the target's step
    distribution, so the output multisets follow the target's with-replacement beam sampling."""
    target, draft, trie, prompt = tiny
    exact = exact_beam_sampling(step_table(target, prompt, trie), trie, 2, 1.0, replacement=True)
    spec = sampled_outcomes(relaxed(target, draft, trie, prompt, 2, 1.0, True, 300), 8000, 500)
    own = sampled_outcomes(target_sampling(target, trie, prompt, 2, 1.0, True, 400), 8000, 500)
    assert goodness_of_fit(spec, exact) > 1e-3
    assert goodness_of_fit(own, exact) > 1e-3


def total_variation(a: dict, b: dict) -> float:
    """TVD between two distributions given as outcome -> probability or count."""
    total_a, total_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(o, 0) / total_a - b.get(o, 0) / total_b) for o in set(a) | set(b))


@pytest.mark.parametrize("temperature", (1.0, 2.0))
def test_relaxed_k2_without_replacement_approximates(tiny, temperature: float) -> None:
    """K = 2, distinct items (the default). The target's own beam sampling without replacement
    follows its exact distribution. Relaxed verification (atspeed.txt Alg. 2) returns distinct
    items and departs from that distribution: on this 12-item trie, where the with-replacement
    approximation is at its weakest (the exact with- and without-replacement distributions are
    0.57 / 0.46 apart in TVD at T = 1 / 2), Alg. 2 is 0.12 / 0.07 away (sampling noise ~0.01):
    within a quarter of the gap the approximation assumes away, and closer as p spreads out."""
    target, draft, trie, prompt = tiny
    table = step_table(target, prompt, trie)
    exact = exact_beam_sampling(table, trie, 2, temperature, replacement=False)
    independent = exact_beam_sampling(table, trie, 2, temperature, replacement=True)
    own = sampled_outcomes(target_sampling(target, trie, prompt, 2, temperature, False, 500), 8000, 500)
    assert goodness_of_fit(own, exact) > 1e-3
    spec = sampled_outcomes(relaxed(target, draft, trie, prompt, 2, temperature, False, 600), 8000, 500)
    assert all(len(set(outcome)) == 2 for outcome in spec)  # distinct items, always
    departure = total_variation(spec, exact)
    assert 0.03 < departure < 0.25 * total_variation(independent, exact), departure


def test_relaxed_accepts_more_with_a_closer_draft(tiny) -> None:
    """A draft equal to the target is always accepted; a random one is not."""
    target, draft, trie, prompt = tiny
    config = SpecConfig(verify="relaxed", temperature=1.0, seed=7)
    same = speculative_beam_search(target, target, [prompt] * 200, trie, 2, PAD, config).stats
    other = speculative_beam_search(target, draft, [prompt] * 200, trie, 2, PAD, config).stats
    assert (same.accepted_steps == trie.depth - 1).all() and (same.target_calls == 1).all()
    assert float(other.accepted_steps.mean()) < float(same.accepted_steps.mean())


def test_relaxed_matches_beam_sampling_quality_on_a_random_model() -> None:
    """Relaxed output is real, distinct items, best first, scored by the target."""
    setup = make_setup(4, [6, 6, 6], 150, kv_heads=2, users=6)
    draft = small_llama(setup.model.config.vocab_size, seed=9)
    result = speculative_beam_search(setup.model, draft, setup.prompts, setup.trie, 5, PAD,
                                     SpecConfig(verify="relaxed", temperature=0.5)).topk
    assert (result.items >= 0).all() and all(len(set(row)) == 5 for row in result.items.tolist())
    assert (result.scores[:, :-1] >= result.scores[:, 1:]).all()
    assert (result.tokens >= CONTROL).all()


@pytest.mark.parametrize("verify", ("relaxed", "sample"))
def test_sampling_verification_batches_users_on_nodes_of_different_fan_out(verify: str) -> None:
    """A batch whose users leave a round at different steps, on trie nodes of different fan-out:
    the drafted proposals and the target's candidates are laid out with different widths, and
    every user still gets real, distinct items (a regression: this used to fail on shapes)."""
    setup = make_setup(4, [3, 30, 4, 4], 300, kv_heads=2, users=32)  # fan-out 30 at depth 1, 4 below
    draft = copy.deepcopy(setup.model)  # the target, perturbed: some users pass step 1, others not
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(5)))
    for seed, replacement in ((0, False), (1, True), (2, False)):
        config = SpecConfig(verify=verify, draft_beams=4, temperature=1.0, seed=seed, replacement=replacement)
        result = speculative_beam_search(setup.model, draft, setup.prompts, setup.trie, 3, PAD, config)
        assert (result.topk.items >= 0).all()
        assert replacement or all(len(set(row)) == 3 for row in result.topk.items.tolist())
        assert len(set(result.stats.accepted_steps.tolist())) > 1  # users did leave rounds at different steps


def test_sampling_decoders_over_a_level_narrower_than_k(tiny) -> None:
    """K = 3 over a first level of 2 codes: beam sampling without replacement, relaxed speculative
    search (drafting N = 6 distinct beams) and DSBD keep both first codes and a dead third beam,
    then fill it at the next level: every user gets 3 distinct real items, each with the score
    of its path (they used to fail drawing more distinct candidates than the level has)."""
    from recspec.decoding.dsbd import DSBDConfig, dsbd_beam_search

    target, draft, trie, prompt = tiny
    prompts = [prompt] * 8
    results = {
        "beam-sample": sampling_beam_search(target, prompts, trie, 3, PAD, 1.0, 5, False),
        "spec-relaxed": speculative_beam_search(target, draft, prompts, trie, 3, PAD,
                                                SpecConfig(draft_beams=6, verify="relaxed", seed=5)).topk,
        "spec-beam-sample": speculative_beam_search(target, draft, prompts, trie, 3, PAD,
                                                    SpecConfig(draft_beams=3, verify="sample", seed=5)).topk,
        "dsbd": dsbd_beam_search(target, draft, prompts, trie, 3, PAD, DSBDConfig(draft_width=6, min_width=3))[0],
    }
    exact = beam_search(target, [prompt], trie, 12, PAD)  # every item's score, exactly
    score_of = dict(zip(exact.items[0].tolist(), exact.scores[0].tolist()))
    for name, topk in results.items():
        assert topk.items.shape == (8, 3), name
        for items, scores in zip(topk.items.tolist(), topk.scores.tolist()):
            if name == "dsbd":  # independent draws: repeats allowed, all real
                assert min(items) >= 0, (name, items)
            else:
                assert min(items) >= 0 and len(set(items)) == 3, (name, items)
            assert scores == pytest.approx([score_of[i] for i in items], abs=1e-4), name


# ---------------------------------------------------------------------- exact sampling (cover)


def covered(target, draft, trie, prompt, k, temperature, replacement, seed, n):
    def decode(batch: int):
        nonlocal seed
        seed += 1
        config = SpecConfig(verify="sample", draft_beams=n, temperature=temperature, replacement=replacement,
                            seed=seed)
        return speculative_beam_search(target, draft, [prompt] * batch, trie, k, PAD, config).topk
    return decode


@pytest.mark.parametrize(("temperature", "replacement"), ((1.0, False), (2.0, False), (0.7, True)))
def test_exact_sampling_follows_the_target_beam_sampling(tiny, temperature: float, replacement: bool) -> None:
    """K = 2 with a random draft and a tree of N = 2 sequences a level, so that rounds end at every
    step: the output multisets follow the target's exact beam-sampling distribution, without
    replacement too (where Alg. 2 departs from it, the test above)."""
    target, draft, trie, prompt = tiny
    exact = exact_beam_sampling(step_table(target, prompt, trie), trie, 2, temperature, replacement)
    spec = sampled_outcomes(covered(target, draft, trie, prompt, 2, temperature, replacement, 700, 2), 8000, 500)
    assert goodness_of_fit(spec, exact) > 1e-3
    assert replacement or all(len(set(outcome)) == 2 for outcome in spec)


def test_exact_sampling_accepts_what_the_tree_covers(tiny) -> None:
    """A tree holding every node (N = 4 covers the 2 x 2 first levels) accepts every step, one
    target call a user; with N = K = 2 from a random draft some steps are not covered; either way
    Alg. 2 with the same draft accepts less than the full tree."""
    target, draft, trie, prompt = tiny
    stats = {n: speculative_beam_search(target, draft, [prompt] * 200, trie, 2, PAD,
                                        SpecConfig(verify="sample", draft_beams=n, seed=3)).stats for n in (2, 4)}
    assert (stats[4].accepted_steps == trie.depth - 1).all() and (stats[4].target_calls == 1).all()
    assert 0 < float(stats[2].accepted_steps.mean()) < trie.depth - 1
    relaxed = speculative_beam_search(target, draft, [prompt] * 200, trie, 2, PAD,
                                      SpecConfig(verify="relaxed", seed=3)).stats
    assert float(relaxed.accepted_steps.mean()) < trie.depth - 1


def test_exact_sampling_needs_n_of_at_least_k(tiny) -> None:
    target, draft, trie, prompt = tiny
    with pytest.raises(RecspecError, match="sample verification accepts a step only when all k"):
        speculative_beam_search(target, draft, [prompt], trie, 3, PAD, SpecConfig(verify="sample", draft_beams=2))


@pytest.mark.parametrize("replacement", (False, True))
def test_beam_sampling_with_the_root_level_in_the_prompt_call_draws_the_same(replacement: bool) -> None:
    """``beam-sample`` with ``root`` (the first level scored in the prompt's call) takes the same
    steps from the same log-probs with the same generator: the same draws, batched or not, on a
    trie whose first level is narrower than K (dead beams at the first step)."""
    wide, narrow = make_setup(4, [6, 6, 6], 150, kv_heads=2, users=9), make_setup(5, [3, 5, 5], 60, kv_heads=2, users=7)
    for setup, k in ((wide, 5), (narrow, 8)):
        for batch in (None, 2):
            plain = sampling_beam_search(setup.model, setup.prompts, setup.trie, k, PAD, 1.0, 11, replacement, batch)
            root = sampling_beam_search(setup.model, setup.prompts, setup.trie, k, PAD, 1.0, 11, replacement, batch,
                                        root=True)
            assert torch.equal(plain.items, root.items) and torch.equal(plain.tokens, root.tokens)
            torch.testing.assert_close(plain.scores, root.scores, atol=1e-4, rtol=0)
