"""A text head (:mod:`recspec.models.text_head`) as the draft of the chain text decoders
(:mod:`recspec.decoding.chains`): speculative sampling with a head draws the target's
distribution (chi-square at fixed seeds, random heads over the whole or a reduced vocabulary and a
briefly trained one, on a tiny random Llama), TopK-ImpSpecDec with a head samples its own
distribution built from the head's ``q``, the head's cache after a run is the teacher-forced one
over the text's true features, rows of different lengths batch together; and a smoke run of the
commands on the real SmolLM2's first layers."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from recspec.decoding import text
from recspec.accel.int8 import int8_serves
from recspec.decoding.chains import ChainStats, HeadChainDraft, importance_proposal
from recspec.decoding.prompts import Prompts
from recspec.decoding.text import TextOptions, generate
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.models.text_head import TextHead, TextHeadDraft, new_text_head
from tests.test_speculative import goodness_of_fit, small_llama
from tests.test_specsample import LENGTH, PROMPT, VOCAB, next_table, sampled, sequence_distribution
from tests.test_text_head import teacher_cache, teacher_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    """test_specsample's random target over 6 tokens."""
    return small_llama(VOCAB, seed=0, width=16, init=0.5).requires_grad_(False)


def scrambled_head(target, vocab_ids: torch.Tensor | None, seed: int) -> TextHead:
    """A random head whose attention and MLP outputs are not zero (so it guesses far from
    ``f_{t+1} = f_t``)."""
    head = new_text_head(target, vocab_ids, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear in (head.o, head.mlp.down):
            linear.weight.normal_(0.0, 0.5, generator=generator)
    return head.eval()


def trained_head(target, seed: int) -> TextHead:
    """A head trained for a few seconds on the target's features over random texts (forward KL of
    the next token but one, plus EAGLE's feature regression), teacher-forced."""
    head = new_text_head(target, None, seed)
    bound = TextHeadDraft(head, target)
    texts = torch.randint(0, VOCAB, (256, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target(input_ids=texts, output_hidden_states=True)
    features, log_p = out.hidden_states[-1], torch.log_softmax(out.logits, dim=-1)
    count = texts.shape[1] - 1
    positions = torch.arange(count).expand(len(texts), -1)
    causal = torch.ones(count, count, dtype=torch.bool).tril().expand(len(texts), -1, -1)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(150):
        guessed, _, _ = bound.step(features[:, :-1], texts[:, 1:], positions, causal)
        log_q = bound.log_probs(guessed)
        kl = (log_p[:, 1:].exp() * (log_p[:, 1:] - log_q)).sum(-1).mean()
        loss = kl + (guessed - features[:, 1:]).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def heads(target) -> dict[str, TextHeadDraft]:
    trained = trained_head(target, seed=3)
    return {"scrambled": TextHeadDraft(scrambled_head(target, None, seed=1), target),
            "reduced": TextHeadDraft(scrambled_head(target, torch.tensor([0, 2, 3, 5]), seed=2), target),
            "trained": TextHeadDraft(trained, target), "trained-int8": TextHeadDraft(trained, target, int8=True)}


def acceptance(stats: ChainStats) -> float:
    """Leviathan's ``alpha`` estimated over a run: the mean acceptance rate at the tried positions."""
    return float(stats.alpha_sum.sum() / stats.tried.sum())


@pytest.mark.parametrize(("which", "warp"), [("scrambled", Warp(1.0)), ("reduced", Warp(1.0)),
                                             ("trained", Warp(1.0)), ("trained-int8", Warp(1.0)),
                                             ("reduced", Warp(1.3, top_k=4, top_p=0.9))],
                         ids=["scrambled", "reduced", "trained", "trained-int8", "reduced-T1.3-k4-p0.9"])
def test_spec_sample_with_a_head_draws_the_target_distribution(target, heads, which: str, warp: Warp) -> None:
    """Theorem A.1 with a head as the draft (lenience 1): the emitted sequences follow the target's
    warped distribution, for a head far from it, one whose ``q`` is zero on two of the six tokens,
    a trained one that agrees with it more, and the trained one with int8 logits."""
    table = next_table(target, LENGTH)
    exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    options = TextOptions(max_new_tokens=LENGTH, warp=warp, gamma=2, seed=13)
    assert goodness_of_fit(sampled("spec-sample", target, heads[which], options, 6000), exact) > 1e-3
    stats = generate("spec-sample", target, heads[which], [PROMPT] * 500, options, pad_token_id=0, eos=None).stats
    assert 0.2 < acceptance(stats) < 0.95  # the draft differs from the target: the residual matters
    assert bool((stats.accepted_steps > 0).any())


def test_a_trained_head_agrees_more(target, heads) -> None:
    options = TextOptions(max_new_tokens=8, gamma=3, seed=2)
    rates = {which: acceptance(generate("spec-sample", target, heads[which], [PROMPT] * 300, options, 0, None).stats)
             for which in ("scrambled", "trained")}
    assert rates["trained"] > rates["scrambled"] + 0.1, rates


def head_q(target, head: TextHeadDraft, prefix: tuple[int, ...], warp: Warp) -> torch.Tensor:
    """The head's warped ``q`` after ``PROMPT + prefix`` read with the target's true features,
    float64 ``[VOCAB]``."""
    ids = torch.cat((PROMPT, torch.tensor(prefix, dtype=torch.int64)))[None]
    count = ids.shape[1] - 1
    with torch.no_grad():
        features = target(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        guessed, _, _ = head.step(features[:, :-1], ids[:, 1:], torch.arange(count)[None],
                                  torch.ones(count, count, dtype=torch.bool).tril()[None])
        log_q = torch.full((VOCAB,), -torch.inf).scatter_(0, head.ids, head.log_probs(guessed[0, -1]))
    return warp(log_q.double()).exp()


def test_topk_imp_with_a_head_samples_its_own_distribution(target, heads) -> None:
    """TopK-ImpSpecDec with a head and ``gamma = 1``: every drafted token is drawn from the head's
    ``q`` over the true features of its prefix, reweighted (drafters' module doc), so the text is
    a Markov chain over (prefix, whether the next token is drafted or the bonus) that can be
    enumerated: after an accepted draft the bonus comes from ``p``, after a rejection the next
    token is drafted again."""
    head, warp, k = heads["reduced"], Warp(1.0), 3
    table = next_table(target, LENGTH)

    @functools.cache
    def step(prefix: tuple[int, ...], drafted: bool) -> tuple[tuple[torch.Tensor, bool], ...]:
        """The next token's probabilities, split by whether the token after it is drafted."""
        p = warp(table[prefix]).exp()
        if not drafted:
            return ((p, True),)
        q = head_q(target, head, prefix, warp)
        r = importance_proposal(q[None].float(), p[None].float(), k)[0].double()
        accepted = r * torch.clamp(p / q, max=1).nan_to_num(0.0)
        residual = (p - q).clamp(min=0)
        return (accepted, False), ((1 - accepted.sum()) * residual / residual.sum(), True)

    def probability(rest: tuple[int, ...], prefix: tuple[int, ...], drafted: bool) -> float:
        if not rest:
            return 1.0
        return sum(float(part[rest[0]]) * probability(rest[1:], prefix + rest[:1], after)
                   for part, after in step(prefix, drafted))

    exact = {seq: probability(seq, (), True) for seq in itertools.product(range(VOCAB), repeat=LENGTH)}
    assert math.isclose(sum(exact.values()), 1.0, abs_tol=1e-9)
    options = TextOptions(max_new_tokens=LENGTH, warp=warp, gamma=1, candidates=k, seed=4)
    counts = sampled("topk-imp", target, head, options, 6000)
    assert goodness_of_fit(counts, exact) > 1e-3
    target_exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    assert goodness_of_fit(counts, target_exact) < 1e-6


class Recording(HeadChainDraft):
    """A head's chain draft that keeps, for every row leaving the batch, its cached keys and values
    at the positions it sees (its inputs, in order): ``final[row]``, ``[kv_heads, count, d]`` each."""

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        super().start(prompts, features)
        self.rows = list(range(len(prompts.lengths)))
        self.final: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def select(self, rows: torch.Tensor) -> None:
        cached = self.cache.text
        assert cached is not None
        layer, kept = cached.cache.layers[0], set(rows.tolist())
        for i, row in enumerate(self.rows):
            if i not in kept:
                seen = cached.visible[i]
                assert int(seen.sum()) == int(cached.count[i])
                self.final[row] = layer.keys[i][:, seen], layer.values[i][:, seen]
        self.rows = [self.rows[i] for i in rows.tolist()]
        super().select(rows)


def run_recorded(monkeypatch, method: str, target, head: TextHeadDraft, prompts: list[torch.Tensor],
                 options: TextOptions, eos: int | None) -> tuple[text.Generated, Recording]:
    """``generate`` with the head's chain draft recorded."""
    recording = Recording(head)
    monkeypatch.setattr(text, "chain_draft", lambda draft: recording)
    return generate(method, target, head, prompts, options, pad_token_id=0, eos=eos), recording


def assert_true_inputs(target, head: TextHeadDraft, prompts: list[torch.Tensor], tokens: list[list[int]],
                       recording: Recording) -> None:
    """Every row's head cache is the teacher-forced one over its text (as far as the text goes: a
    row may have kept tokens past the limit or its end token)."""
    assert sorted(recording.final) == list(range(len(prompts)))
    for row, (prompt, generated) in enumerate(zip(prompts, tokens)):
        words = prompt.tolist() + generated
        keys, values = recording.final[row]
        assert keys.shape[1] >= len(words) - 1
        expected_keys, expected_values = teacher_cache(target, head, words)
        torch.testing.assert_close(keys[:, :len(words) - 1], expected_keys[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values[:, :len(words) - 1], expected_values[0], rtol=1e-4, atol=1e-4)


PROMPTS = [PROMPT, PROMPT[:3], torch.tensor([3, 3, 1, 2, 4, 5, 0, 1, 4])]


def test_a_dynamic_draft_length_draws_the_target_distribution(target, heads) -> None:
    """spec-sample with ``draft_stop``: each row's chain ends where the head's probability of it
    falls below the stop, so rows of one batch draft chains of different lengths in a round, and
    the emitted sequences still follow the target's distribution (chi-square; the 6000 draws are one
    batch, so a row's tokens past its own end are drafted for others and never verified for it)."""
    warp = Warp(1.0)
    table = next_table(target, LENGTH)
    exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    options = TextOptions(max_new_tokens=LENGTH, warp=warp, gamma=3, draft_stop=0.5, seed=13)
    assert goodness_of_fit(sampled("spec-sample", target, heads["trained"], options, 6000), exact) > 1e-3
    stats = generate("spec-sample", target, heads["trained"], [PROMPT] * 500, options, pad_token_id=0, eos=None).stats
    own = stats.drafted_steps / stats.rounds  # each row's mean chain length
    assert 1.0 < float(own.mean()) < 3.0 and float(own.min()) < float(own.max())
    assert bool((stats.tried <= stats.drafted_steps).all())


@pytest.mark.parametrize(("method", "gamma", "stop"), [("spec-sample", 3, None), ("topk-imp", 2, None),
                                                       ("spec-sample", 1, None), ("spec-sample", 4, 0.4)])
def test_head_cache_holds_the_true_features_of_the_text(monkeypatch, target, heads, method: str, gamma: int,
                                                        stop: float | None) -> None:
    """Rows of different lengths in one batch, ending at the limit or at their end token: after
    the run each row's head cache holds exactly its text's inputs with the target's true features
    (the drafted inputs dropped, the accepted ones re-read), as if read in one teacher-forced call,
    also where rounds draft chains of different lengths (``stop``); the counters add up."""
    head = heads["trained"]
    options = TextOptions(max_new_tokens=12, gamma=gamma, draft_stop=stop, candidates=3, seed=7)
    prompts = PROMPTS * 4
    result, recording = run_recorded(monkeypatch, method, target, head, prompts, options, eos=0)
    assert_true_inputs(target, head, prompts, result.tokens, recording)
    stats = result.stats
    assert stats is not None and float(stats.accepted_steps.sum()) > 0
    assert any(len(tokens) < 12 for tokens in result.tokens) and any(len(tokens) == 12 for tokens in result.tokens)
    assert torch.equal(stats.tokens, torch.tensor([float(len(tokens)) for tokens in result.tokens]))
    if stop is None:
        assert torch.equal(stats.draft_calls, stats.rounds * gamma + 1)
    else:  # shorter rounds, the batch's longest chain drafted
        assert bool((stats.drafted_steps + 1 <= stats.draft_calls).all())
        assert float(stats.draft_calls.sum()) < float((stats.rounds * gamma + 1).sum())
    calls_per_round = 1 if method == "spec-sample" else gamma + 1
    assert torch.equal(stats.target_calls, stats.rounds * calls_per_round + 1)


@pytest.fixture(scope="module")
def fused() -> tuple:
    """A two-layer random target over the six tokens and a scrambled head reading its layer 1
    beside its top feature, W_fuse random (EAGLE-3's fused input)."""
    deep = small_llama(VOCAB, seed=0, width=16, init=0.5, layers=2).requires_grad_(False)
    head = new_text_head(deep, None, seed=8, fused_layers=(1,))
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for linear in (head.o, head.mlp.down, head.fuse):
            linear.weight.normal_(0.0, 0.5, generator=generator)
    return deep, TextHeadDraft(head.eval(), deep)


def test_spec_sample_with_a_fused_head_draws_the_target_distribution(fused) -> None:
    """Theorem A.1 with a head reading fused layers as the draft: the sequences follow the target's."""
    deep, head = fused
    table = next_table(deep, LENGTH)
    exact = sequence_distribution(lambda prefix: Warp(1.0)(table[prefix]).exp())
    options = TextOptions(max_new_tokens=LENGTH, gamma=2, seed=13)
    assert goodness_of_fit(sampled("spec-sample", deep, head, options, 6000), exact) > 1e-3


@pytest.mark.parametrize("method", ["spec-sample", "topk-imp"])
def test_a_fused_heads_cache_holds_the_true_features_of_the_text(monkeypatch, fused, method: str) -> None:
    """The chain decoders hand a fused head the target's layers with its top feature: its cache
    ends as the teacher-forced one over each row's text, fused input read."""
    deep, head = fused
    options = TextOptions(max_new_tokens=12, gamma=2, candidates=3, seed=7)
    result, recording = run_recorded(monkeypatch, method, deep, head, PROMPTS * 2, options, eos=0)
    assert_true_inputs(deep, head, PROMPTS * 2, result.tokens, recording)
    assert result.stats is not None and float(result.stats.accepted_steps.sum()) > 0


def test_a_head_only_drafts_for_its_target(target, heads) -> None:
    other = small_llama(VOCAB, seed=0, width=16, init=0.5)
    for method in ("spec-sample", "dsbd"):
        with pytest.raises(RecspecError, match="bound to another model"):
            generate(method, other, heads["trained"], [PROMPT], TextOptions(), pad_token_id=0, eos=None)


@pytest.mark.parametrize("vocab", [None, (0, 2, 3), (0, 2), (1,)], ids=["whole", "reduced", "no-end", "one-token"])
def test_dsbd_with_a_head_samples_the_targets_beam_sampling(vocab) -> None:
    """dsbd.txt Theorem 3.1 with a text head drafting the forest: the output beam pairs follow the
    enumerated text beam sampling (W = 2, end token absorbing), for a head over the whole
    vocabulary and heads whose ``q`` is zero on some tokens (drafted over their support,
    :mod:`recspec.decoding.support`): on one, on the end token (which the draft space adds), on
    all but one."""
    from collections import Counter

    from recspec.decoding.dsbd import dsbd_batch
    from recspec.decoding.prompts import left_pad
    from recspec.decoding.space import FreeText
    from tests.test_dsbd import DEPTH, EOS, PAD, TEXT_VOCAB, canonical, exact_text_beam_sampling

    small = small_llama(TEXT_VOCAB, seed=4, width=16, init=0.5).requires_grad_(False)
    head = TextHeadDraft(scrambled_head(small, None if vocab is None else torch.tensor(vocab), seed=6), small)
    prompt, warp = torch.tensor([1, 2, 0, 1]), Warp(1.0)
    exact = exact_text_beam_sampling(small, prompt, 2, warp)
    prompts = left_pad([prompt] * 4000, PAD, torch.device("cpu"))
    config = TextOptions(max_new_tokens=DEPTH, gamma=2, beams=2, draft_width=3).dsbd()
    with torch.inference_mode():
        result = dsbd_batch(small, head, prompts, FreeText(TEXT_VOCAB, DEPTH, EOS), 2, config,
                            torch.Generator().manual_seed(3), ends=FreeText(TEXT_VOCAB, DEPTH, EOS))
    counts = Counter(tuple(sorted(canonical(beam) for beam in row)) for row in result.tokens[:, :2].tolist())
    assert goodness_of_fit(counts, exact) > 1e-3
    assert float(result.stats.accepted_steps.sum()) > 0 and float(result.stats.drafted_steps.sum()) > 0


@pytest.mark.parametrize(("one_cache", "which", "slack"),
                         [(False, "trained", 0), (True, "trained", None), (False, "fused", None)],
                         ids=["beams-compacted", "one-cache", "fused"])
def test_dsbd_head_cache_holds_the_true_features_of_every_beam(monkeypatch, target, heads, fused, one_cache: bool,
                                                                which: str, slack: int | None) -> None:
    """After every round, each beam's view of the head's tree cache (the prompt and its ancestors)
    holds exactly the inputs of its text with the target's true features, as one teacher-forced
    call over that text computes them (column 0, the placeholder, aside), and the input of its
    pending token, computed ahead in the round's last head call, is that call's next input (guess,
    key and value); rows of different prompt lengths in one batch; the run is DSBD's with the head
    drafting (also one reading fused layers), its caches compacted after every round (``slack`` 0)
    or left uncompacted (the default slack, which 8 new tokens never exceed)."""
    from recspec.decoding import frontier, rounds

    from recspec.decoding.draft_sources import TextTreeDraft

    target, head = fused if which == "fused" else (target, heads["trained"])
    source = TextTreeDraft(head)  # unpacks a frontier's state
    checked: list[int] = []
    settle = rounds.settle_frontier
    if slack is not None:
        monkeypatch.setattr(frontier, "SLACK", slack)
    widths: set[int] = set()

    def checking(front, caches, compacted):
        front, compacted = settle(front, caches, compacted)
        widths.add(caches[0].layers[0].keys.shape[2] - front.visible.shape[2])
        keys, values = caches[1].layers[0].keys, caches[1].layers[0].values
        for b in range(len(front.users)):
            prompt = PROMPTS[int(front.users[b]) % len(PROMPTS)]
            for k in range(front.visible.shape[1]):
                if int(front.beams.nodes[b, k]) < 0:
                    continue
                columns = front.visible[b, k].nonzero()[:, 0]
                text = prompt.tolist() + front.paths[b, k, :int(front.depth[b])].tolist()  # the pending token last
                assert len(columns) == len(text) - 1
                expected = teacher_inputs(target, head, text)
                torch.testing.assert_close(keys[b][:, columns[1:]], expected[1][0, :, :-1], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(values[b][:, columns[1:]], expected[2][0, :, :-1], rtol=1e-4, atol=1e-4)
                ahead = source.unpacked(front)
                for got, want in zip(ahead, (expected[0][0, -1], expected[1][0, :, -1], expected[2][0, :, -1])):
                    torch.testing.assert_close(got[b, k] if got.dim() == 3 else got[b, :, k], want, rtol=1e-4,
                                               atol=1e-4)
                checked.append(len(text))
        return front, compacted

    monkeypatch.setattr(rounds, "settle_frontier", checking)
    options = TextOptions(max_new_tokens=8, gamma=2, beams=2, draft_width=3, one_cache=one_cache, seed=6)
    result = generate("dsbd", target, head, PROMPTS * 2, options, pad_token_id=0, eos=None)
    assert len(checked) > 20 and max(checked) > len(PROMPTS[2]) + 4
    assert widths == {0}  # the beams' view spans the target's cache, compacted or not
    assert result.stats is not None and float(result.stats.accepted_steps.sum()) > 0


def test_spec_sample_with_a_head_on_smollm2(monkeypatch, smollm2_dir) -> None:
    """The real SmolLM2 with an untrained head over a reduced vocabulary: a batch of two prompts of
    different lengths runs, its counters are sane, and the head's cache ends on the true features."""
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    model, tokenizer = load_causal_lm(smollm2_dir), load_tokenizer(smollm2_dir)
    prompts = [torch.tensor(tokenizer.encode(words)) for words in
               ("The film is a quiet drama about", "Tell me about a science fiction movie set on a ship where")]
    assert len(prompts[0]) != len(prompts[1])
    head = TextHeadDraft(new_text_head(model, torch.arange(4096), seed=5).eval(), model)
    options, gamma = TextOptions(max_new_tokens=12, gamma=3, seed=1), 3
    result, recording = run_recorded(monkeypatch, "spec-sample", model, head, prompts, options,
                                     eos=tokenizer.eos_token_id)
    assert all(1 <= len(tokens) <= 12 for tokens in result.tokens)
    stats = result.stats
    assert stats is not None and bool((stats.accepted_steps <= stats.drafted_steps).all())
    assert bool((stats.alpha_sum <= stats.tried).all()) and 0 < acceptance(stats) < 1
    assert torch.equal(stats.draft_calls, stats.rounds * gamma + 1)
    assert torch.equal(stats.target_calls, stats.rounds + 1)
    assert_true_inputs(model, head, prompts, result.tokens, recording)


def test_generate_cli_and_bench_sampling_take_a_head_folder(smollm2_dir, tmp_path, capsys) -> None:
    """`recspec generate --draft HEAD`: a head folder is loaded against the target and drafts for
    spec-sample and dsbd; `bench sampling --draft HEAD` measures every drafted method with the head
    (its step's cost ratio c well below a target call). The target: SmolLM2's first 4 layers, its
    norm and output layer, saved as a model folder (the commands' paths are those of the whole
    model, at a seventh of its calls' cost)."""
    import json

    from recspec.cli import main
    from recspec.hub import load_tokenizer
    from recspec.models.head import save_head
    from recspec.models.hf import load_causal_lm
    from recspec.models.layer_draft import keep_first_layers
    from recspec.models.text_head import TEXT_HEAD, text_head_fingerprint

    target_dir = tmp_path / "smollm2-4"
    model = load_causal_lm(smollm2_dir)
    keep_first_layers(model, 4)
    model.save_pretrained(target_dir)
    load_tokenizer(smollm2_dir).save_pretrained(target_dir)
    save_head(tmp_path / "head" / "best", new_text_head(model, torch.arange(0, 2000), seed=1),
              text_head_fingerprint(target_dir), {}, TEXT_HEAD)
    out = tmp_path / "g.jsonl"
    common = ["generate", "--out", str(out), "--target", str(target_dir), "--draft", str(tmp_path / "head"),
              "--count", "1", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit) as exit_info:
        main(common + ["--decoder", "spec-sample"])
    assert exit_info.value.code == 0 and "with spec-sample" in capsys.readouterr().out
    assert json.loads(out.read_text())["tokens"] >= 1
    with pytest.raises(SystemExit) as exit_info:
        main(common + ["--decoder", "dsbd", "--gamma", "2", "--overwrite"])
    assert exit_info.value.code == 0 and "with dsbd" in capsys.readouterr().out
    from recspec.bench.sampling import MOST_DRAFTED, TEXT_METHODS, bench_text, decode_ms_per_token, text_methods

    # T = F + n d from the medians: (11 s - 2 s) over 100 - 10 tokens; nothing where the cut runs are not shorter
    assert decode_ms_per_token([10.0, 12.0, 11.0], 100, [2.0, 3.0, 2.0], 10) == pytest.approx(100.0)
    assert decode_ms_per_token([1.0], 10, [1.5], 4) is None and decode_ms_per_token([2.0], 4, [1.0], 4) is None

    base = TextOptions(max_new_tokens=4, gamma=2)
    # one row of each kind the bench treats apart (the decoders themselves are tested above, each with a head)
    chosen = ["spec-sample-dynamic", "dsbd-one-cache", "spec-sample-tree", "spec-sample-fp32"]
    result = bench_text(str(target_dir), "0,3", ("0,3",), 1, base, 0.7, 1, str(tmp_path / "head"), chosen)
    rows = {row["method"]: row for row in result["rows"]}
    assert list(rows) == ["sample", "spec-sample-dynamic", "beam-sample", "dsbd-one-cache", "spec-sample-tree",
                          "spec-sample-fp32"]
    assert all("decode_ms_per_token" in row and (row["decode_speed_ratio"] is None or row["decode_speed_ratio"] > 0)
               for row in rows.values())
    assert set(result["head_acceptance"]) == ({"float32", "int8"} if int8_serves("cpu") else {"float32"})
    assert all(0 < value <= 1 for value in result["head_acceptance"].values())
    # the same head, side by side in both precisions
    assert rows["spec-sample-dynamic"]["head_int8"] is int8_serves("cpu")
    assert rows["spec-sample-fp32"]["head_int8"] is False
    dynamic = rows["spec-sample-dynamic"]
    assert 1 <= dynamic["drafted_per_round"] <= MOST_DRAFTED and "predicted_speedup" not in dynamic
    assert rows["spec-sample-tree"]["tokens_per_target_call"] >= 1 and "steps_per_round" in rows["dsbd-one-cache"]
    assert 0 < result["c"] < 0.5 and result["drafts"][-1]["layers"] == f"distilled: {tmp_path / 'head'}"
    assert 0.5 < result["verify_ratio"] < 5  # the 3-token verifying call, in one-token calls
    assert list(text_methods(["dsbd-dynamic"])) == ["beam-sample", "dsbd-dynamic"]  # a method comes with its baseline
    with pytest.raises(RecspecError, match="unknown sampling method 'greedy'"):
        text_methods(["spec-sample", "greedy"])
    assert list(text_methods(None)) == list(TEXT_METHODS)  # the float32 rows only on request
    assert list(text_methods(["dsbd-one-cache-fp32"])) == ["beam-sample", "dsbd-one-cache-fp32"]
