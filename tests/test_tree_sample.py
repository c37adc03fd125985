"""Exact speculative sampling over a text head's draft trees (:mod:`recspec.knowledge.sampled`,
sampling verification of :mod:`recspec.knowledge.verify`): the texts follow the target's warped
distribution (chi-square at fixed seeds, on a tiny random Llama with heads far from it, over a
reduced vocabulary and briefly trained), they are token for token the texts of plain sampling
with the same seed whatever the trees (the tiny target, and the real SmolLM2 with a head and with
drafts that are always right), and ``recspec generate --tree`` writes them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.decoding.acceptance import SampledAcceptance, chosen_accept
from recspec.decoding.text_rounds import generate_texts, speculative_generate
from recspec.decoding.head_trees import HeadDrafter, HeadTreeConfig
from recspec.knowledge.job import KnowledgeConfig
from recspec.knowledge.sampled import sample_texts
from recspec.knowledge.verify import Verification
from recspec.models.text_head import TextHeadDraft, new_text_head
from tests.test_cli import recspec
from tests.test_speculative import goodness_of_fit
from tests.test_specsample import LENGTH, PROMPT, next_table, sequence_distribution
from tests.test_text_head import MAX_NEW, OracleDrafter, greedy_prompts, lm  # noqa: F401 (a fixture)
from tests.test_text_head_chain import heads, target  # noqa: F401 (fixtures: the tiny target and its heads)

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = HeadTreeConfig(width=2, depth=3, nodes=5, sized=False)


def texts(target, head: TextHeadDraft | None, warp: Warp, draws: int, seed: int) -> tuple[list[tuple[int, ...]], int]:
    """``draws`` texts of LENGTH tokens after PROMPT, and the target calls they took."""
    generations = sample_texts(target, [PROMPT.tolist()] * draws, LENGTH, frozenset(), warp, seed,
                               None if head is None else HeadDrafter(head, TREE))
    assert all(len(generation.tokens) == LENGTH for generation in generations)
    return [tuple(generation.tokens) for generation in generations], sum(g.calls for g in generations)


@pytest.mark.parametrize(("which", "warp"), [("scrambled", Warp(1.0)), ("reduced", Warp(1.0)),
                                             ("trained", Warp(1.0)), ("trained", Warp(1.3, top_k=4, top_p=0.9))],
                         ids=["scrambled", "reduced", "trained", "trained-T1.3-k4-p0.9"])
def test_tree_sampling_draws_the_target_distribution(target, heads, which: str, warp: Warp) -> None:
    """The texts follow the target's warped distribution over all 216 sequences, drafts are
    accepted (fewer calls than tokens), and every text is the one plain sampling draws with the
    same seed (checked on the first 500: one generator runs through the texts in turn, and each
    text takes one uniform per position whatever the tree, so a shorter run draws the same first
    texts)."""
    table = next_table(target, LENGTH)
    exact = sequence_distribution(lambda prefix: warp(table[prefix]).exp())
    drawn, calls = texts(target, heads[which], warp, 2000, seed=11)
    assert goodness_of_fit(Counter(drawn), exact) > 1e-3
    assert calls < 0.8 * 2000 * LENGTH  # drafts are accepted
    plain, plain_calls = texts(target, None, warp, 500, seed=11)
    assert plain_calls == 500 * LENGTH and drawn[:500] == plain


def test_a_wrong_draft_distribution_would_be_caught(target, heads) -> None:
    """The chi-square test has power here: texts drawn at another temperature fail it."""
    table = next_table(target, LENGTH)
    exact = sequence_distribution(lambda prefix: Warp(1.0)(table[prefix]).exp())
    drawn, _ = texts(target, heads["trained"], Warp(0.8), 2000, seed=11)
    assert goodness_of_fit(Counter(drawn), exact) < 1e-3


def test_the_target_draws_each_node_at_its_positions_uniform() -> None:
    """``choices``: the inverse transform of each node's warped distribution at its uniform; a node
    is accepted when its token is its parent's choice."""
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]]]))  # [1, 3, 3]
    uniforms = torch.tensor([[0.55, 0.15, 0.95]], dtype=torch.float64)
    verification = Verification("sample")
    sample = verification.rule
    assert sample.choices(logits, uniforms).tolist() == [[1, 1, 2]]
    assert Verification("greedy").rule.choices(logits, None).tolist() == [[0, 2, 0]]
    tokens, parents = torch.tensor([[7, 1, 2]]), torch.tensor([[-1, 0, 1]])
    choices = sample.choices(logits, uniforms)
    assert chosen_accept(tokens, parents, choices).tolist() == [[True, True, False]]
    assert sample.accept(tokens, parents, logits, choices).tolist() == [[True, True, False]]
    assert "T=1" in verification.describe()
    with pytest.raises(ValueError, match="uniforms"):
        sample.choices(logits, None)
    with pytest.raises(RecspecError, match="temperature"):
        Verification("sample", warp=Warp(0.0))
    with pytest.raises(RecspecError, match="knowledge jobs verify greedy or relaxed"):
        KnowledgeConfig(method="ar", verification=verification)


def test_sampling_with_a_head_on_smollm2_is_plain_sampling(lm, ml100k) -> None:
    """The real SmolLM2 and a head (over a reduced vocabulary): four knowledge prompts, the same
    tokens as plain sampling with the same seed, at temperature 1 and warped."""
    model, tokenizer, eos = lm
    prompts = greedy_prompts(tokenizer, ml100k)
    head = TextHeadDraft(new_text_head(model, torch.arange(4096), seed=3).eval(), model)
    drafter = HeadDrafter(head, HeadTreeConfig(width=3, depth=4, nodes=10))
    for warp in (Warp(1.0), Warp(0.8, top_k=50, top_p=0.95)):
        plain = sample_texts(model, prompts, MAX_NEW, eos, warp, seed=5)
        tree = sample_texts(model, prompts, MAX_NEW, eos, warp, seed=5, drafter=drafter)
        assert [g.tokens for g in tree] == [g.tokens for g in plain]
        assert sum(g.drafted for g in tree) > 0


def test_tree_sampling_in_a_batch_draws_each_prompts_own_text(lm, ml100k) -> None:
    """Four prompts sampled together over a head's trees in the text round loop (left-padded, each
    row its own uniforms, drawn row after row) draw exactly the texts of the prompts decoded one
    after another from the same generator."""
    model, tokenizer, eos = lm
    prompts = greedy_prompts(tokenizer, ml100k)
    head = TextHeadDraft(new_text_head(model, torch.arange(4096), seed=3).eval(), model)
    drafter = HeadDrafter(head, HeadTreeConfig(width=3, depth=4, nodes=10))
    alone = sample_texts(model, prompts, MAX_NEW, eos, Warp(1.0), seed=5, drafter=drafter)
    batched = generate_texts(model, prompts, MAX_NEW, eos, drafter.batch(prompts),
                             SampledAcceptance(Warp(1.0)), torch.Generator().manual_seed(5))
    assert [g.tokens for g in batched] == [g.tokens for g in alone]
    assert [(g.calls, g.drafted) for g in batched] == [(g.calls, g.drafted) for g in alone]


def test_branches_that_are_right_are_accepted_whole(lm, ml100k) -> None:
    """Drafts that hold the text plain sampling draws (each level with a wrong sibling beside it)
    are accepted several tokens per call, and the text is still plain sampling's: every node
    draws with the uniform of its own text position."""
    model, tokenizer, eos = lm
    prompt = greedy_prompts(tokenizer, ml100k)[0]
    warp = Warp(1.0)
    reference = sample_texts(model, [prompt], MAX_NEW, eos, warp, seed=9)[0].tokens
    bound = TextHeadDraft(new_text_head(model, None, seed=4).eval(), model)

    generator = torch.Generator().manual_seed(9)
    drafter = OracleDrafter(bound, prompt=prompt, reference=reference, right_second=True)
    generation = speculative_generate(model, prompt, MAX_NEW, eos, drafter, Verification("sample", warp=warp).rule,
                                      generator)
    assert generation.tokens == reference and generation.calls <= MAX_NEW // 3


def test_generate_tree_cli_writes_plain_samplings_texts(smollm2_dir, tmp_path: Path) -> None:
    """`recspec generate --tree`: spec-sample with a head folder writes the texts of sample --tree
    at the same seed; settings the tree loop cannot serve are refused before any work."""
    from recspec.models.head import save_head
    from recspec.models.hf import load_causal_lm
    from recspec.models.text_head import TEXT_HEAD, text_head_fingerprint

    model = load_causal_lm(smollm2_dir)
    save_head(tmp_path / "head" / "best", new_text_head(model, torch.arange(0, 4000), seed=1),
              text_head_fingerprint(smollm2_dir), {}, TEXT_HEAD)
    common = ["generate", "--target", str(smollm2_dir), "--count", "2", "--max-new-tokens", "8", "--tree",
              "--seed", "3"]
    outs = {}
    head = ["--draft", str(tmp_path / "head")]
    for name, method, extra in (("sample", "sample", []), ("spec-sample", "spec-sample", head),
                                ("spec-sample-batch", "spec-sample", [*head, "--batch-size", "2"])):
        outs[name] = tmp_path / f"{name}.jsonl"
        done = recspec(*common, "--decoder", method, "--out", str(outs[name]), *extra)
        assert done.returncode == 0, done.stderr
        assert "tokens per target call" in done.stdout and f"with {method}" in done.stdout
    rows = {name: [json.loads(line) for line in out.read_text().splitlines()] for name, out in outs.items()}
    assert [row["text"] for row in rows["spec-sample"]] == [row["text"] for row in rows["sample"]]
    assert [row["text"] for row in rows["spec-sample-batch"]] == [row["text"] for row in rows["sample"]]
    assert len(rows["sample"]) == 2 and all(1 <= row["tokens"] <= 8 for row in rows["sample"])
    for extra, message in ((["--decoder", "dsbd"], "--tree decodes sample or spec-sample"),
                           (["--decoder", "spec-sample"], "pass --draft HEAD"),
                           (["--decoder", "spec-sample", "--draft-stop", "0.3"], "--draft-stop sizes chains")):
        refused = recspec(*common, *extra, "--out", str(tmp_path / "refused.jsonl"))
        assert refused.returncode != 0 and message in refused.stderr
        assert not (tmp_path / "refused.jsonl").exists()
