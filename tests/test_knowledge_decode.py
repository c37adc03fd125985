"""Speculative knowledge generation on the real SmolLM2 and MovieLens: greedy LASER / ReSD return
the greedy decoding's tokens; relaxed LASER's tokens satisfy Eq. 8 (or are the greedy token)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from recspec.errors import RecspecError
from recspec.decoding.cost import CallCost
from recspec.decoding.text_rounds import Sessions, generate_texts, speculative_generate
from recspec.knowledge.decode import RetrievalDrafter, eos_ids, hf_generate
from recspec.knowledge.prompts import item_prompt_ids, user_prompt_ids
from recspec.knowledge.retrieval import RetrievalConfig
from recspec.knowledge.stream import stream_split
from recspec.knowledge.trie import TokenTrie
from recspec.knowledge.verify import Verification
from recspec.hub import returned_cache, with_cache

MAX_NEW = 20
NEAR_TIE = 1e-3  # top-2 logit gap below which float noise between batch shapes may flip the argmax


@pytest.fixture(scope="module")
def lm(smollm2_dir):
    from recspec.hub import load_tokenizer
    from recspec.models.hf import load_causal_lm

    torch.manual_seed(0)
    model, tokenizer = load_causal_lm(smollm2_dir), load_tokenizer(smollm2_dir)
    return model, tokenizer, eos_ids(model, tokenizer)


@pytest.fixture(scope="module")
def prompts(lm, ml100k) -> list[list[int]]:
    """10 item prompts and 2 user prompts (new part, as the job builds them)."""
    _, tokenizer, _ = lm
    split = stream_split(ml100k)
    items = [item_prompt_ids(tokenizer, ml100k, int(i), 1024) for i in split.new_items[:10]]
    users = [user_prompt_ids(tokenizer, ml100k, u, split.new[u], 10, 1024) for u in (0, 1)]
    return items + users


@pytest.fixture(scope="module")
def greedy(lm, prompts) -> list[list[int]]:
    """Plain greedy decoding (recspec's loop without drafts) of every prompt."""
    model, _, eos = lm
    return [speculative_generate(model, p, MAX_NEW, eos).tokens for p in prompts]


def top2_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """The target's top-2 logit gap after ``prompt + prefix`` (one full forward)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergences(model, prompts, outputs, references) -> list[tuple[int, int, float]]:
    """(prompt, position, top-2 gap of the reference there) for each output that differs."""
    found = []
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, references)):
        if out != ref:
            position = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            found.append((i, position, top2_gap(model, prompt, ref[:position])))
    return found


def assert_exact_up_to_near_ties(found: list[tuple[int, int, float]], total: int) -> None:
    """Every divergence must sit on a near-tie of the reference (counted, with its gap), and they
    must stay rare."""
    for prompt, position, gap in found:
        assert gap < NEAR_TIE, f"prompt {prompt} diverges at token {position} where the top-2 gap is {gap:.2e}"
    assert len(found) <= total // 6, f"{len(found)} of {total} outputs diverge (near-ties: {found})"
    if found:
        print(f"near-tie divergences: {found}")


def test_our_greedy_loop_matches_transformers_generate(lm, prompts, greedy) -> None:
    model, _, eos = lm
    hf = [hf_generate(model, [p], MAX_NEW, eos)[0].tokens for p in prompts[:4]]
    assert_exact_up_to_near_ties(divergences(model, prompts[:4], greedy[:4], hf), 4)
    assert all(len(t) == MAX_NEW or t[-1] in eos for t in greedy)


def test_batched_generate_is_greedy_decoding_per_text(lm, prompts, greedy) -> None:
    """A left-padded batch of prompts of different lengths: each row is its prompt's greedy text
    (up to near-ties), cut after its own end-of-sequence token, and the batch's time is shared."""
    model, _, eos = lm
    batch = prompts[-4:]  # two item prompts, two (longer) user prompts
    assert len({len(p) for p in batch}) > 1
    generations = hf_generate(model, batch, MAX_NEW, eos)
    assert [g.prompt_tokens for g in generations] == [len(p) for p in batch]
    assert_exact_up_to_near_ties(divergences(model, batch, greedy[-4:], [g.tokens for g in generations]), 4)
    for g in generations:
        assert g.calls == len(g.tokens) and g.accepted == 0
        assert all(t not in eos for t in g.tokens[:-1])
    assert len({round(g.wall_s, 9) for g in generations}) == 1
    short = hf_generate(model, batch[:2], 3, eos)
    assert [len(g.tokens) for g in short] == [3, 3]


@pytest.mark.parametrize(("nodes", "count"), [(8, 12), (64, 6)])
def test_greedy_speculative_decoding_is_greedy_decoding(lm, prompts, greedy, nodes, count) -> None:
    """ReSD / greedy LASER over a pool of the other prompts' texts: the greedy tokens, with drafts
    actually accepted (several tokens per target call) and rejected (small trees on every prompt,
    the largest on the first ``count``)."""
    model, _, eos = lm
    config = RetrievalConfig(max_nodes=nodes, max_depth=12, max_suffix=8)
    prompts = prompts[:count]
    outputs, calls, accepted, drafted = [], 0, 0, 0
    for i, prompt in enumerate(prompts):
        pool = TokenTrie(config.window)
        pool.add_all(g for j, g in enumerate(greedy) if j != i)
        generation = speculative_generate(model, prompt, MAX_NEW, eos, RetrievalDrafter(pool, config))
        outputs.append(generation.tokens)
        calls, accepted, drafted = calls + generation.calls, accepted + generation.accepted, drafted + generation.drafted
    assert_exact_up_to_near_ties(divergences(model, prompts, outputs, greedy[:count]), count)
    assert accepted > len(prompts) and drafted > accepted  # drafts were accepted and rejected
    assert sum(map(len, outputs)) / calls > 1.3


@pytest.fixture(scope="module")
def pooled(prompts, greedy) -> tuple[RetrievalDrafter, list[list[int]]]:
    """LASER's default drafter over a pool of the last prompts' greedy texts, and four prompts of
    different lengths (items and a user) to decode in one batch."""
    config = RetrievalConfig()
    pool = TokenTrie(config.window)
    pool.add_all(greedy[4:])
    chosen = [*prompts[:3], prompts[10]]
    assert len({len(prompt) for prompt in chosen}) > 1
    return RetrievalDrafter(pool, config), chosen


def test_laser_greedy_in_a_batch_writes_each_prompts_own_text(lm, pooled) -> None:
    """Four prompts of different lengths (left-padded) decoded together by LASER's greedy drafting
    in the text round loop write exactly the texts, target calls and drafts of each prompt decoded
    alone: every row drafts, verifies and keeps its own path."""
    model, _, eos = lm
    drafter, chosen = pooled
    alone = [speculative_generate(model, prompt, MAX_NEW, eos, drafter) for prompt in chosen]
    batched = generate_texts(model, chosen, MAX_NEW, eos, drafter.batch(chosen))
    assert [g.tokens for g in batched] == [g.tokens for g in alone]
    assert [(g.calls, g.drafted) for g in batched] == [(g.calls, g.drafted) for g in alone]
    assert sum(g.accepted for g in batched) > 0


def test_sized_trees_in_a_batch_write_the_greedy_texts_with_fewer_nodes(lm, pooled) -> None:
    """LASER's greedy trees cut each round to the batch's cost-sized node count (Sessions with a
    call cost) write the texts of unsized trees: a dear node cuts the trees to fewer drafted nodes,
    a free one keeps them whole (the same drafts, calls and texts)."""
    model, _, eos = lm
    drafter, chosen = pooled

    def run(cost: CallCost | None) -> list:
        return generate_texts(model, chosen, MAX_NEW, eos, Sessions([drafter.session(p) for p in chosen], cost))

    whole, free, dear = run(None), run(CallCost(0.05, 0.0)), run(CallCost(0.05, 0.004))
    assert [g.tokens for g in free] == [g.tokens for g in dear] == [g.tokens for g in whole]
    assert [(g.calls, g.drafted) for g in free] == [(g.calls, g.drafted) for g in whole]
    assert sum(g.drafted for g in dear) < sum(g.drafted for g in whole) and sum(g.accepted for g in dear) > 0


def test_the_cache_goes_under_the_keyword_the_installed_model_takes(lm, prompts, greedy) -> None:
    """transformers 5.24 renames forward's ``past_key_values`` to ``cache`` and drops the old name
    in 5.40, after which a model handed the old one would decode without its cache and say nothing.
    recspec hands the cache under the name the installed model's forward takes: a speculative
    decode (prefill, tree calls, cache compaction) raises no deprecation of the old name, turned
    into an error here, and still returns the greedy text."""
    model, _, eos = lm
    assert set(with_cache(model, None)) <= set(inspect.signature(model.forward).parameters)
    pool = TokenTrie(RetrievalConfig().window)
    pool.add_all(greedy[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        generation = speculative_generate(model, prompts[0], MAX_NEW, eos, RetrievalDrafter(pool, RetrievalConfig()))
    assert generation.accepted > 0  # the tree calls ran
    for _, position, gap in divergences(model, prompts[:1], [generation.tokens], greedy[:1]):
        assert gap < NEAR_TIE, f"diverges from greedy at token {position}, top-2 gap {gap:.2e}"


def test_relaxed_tokens_satisfy_eq8_or_are_greedy(lm, prompts, greedy) -> None:
    model, _, eos = lm
    verification = Verification("relaxed", 2, 0.1)
    config = RetrievalConfig(max_nodes=32)
    for i, prompt in enumerate(prompts[:6]):
        pool = TokenTrie(config.window)
        pool.add_all(g for j, g in enumerate(greedy) if j != i)
        drafter = RetrievalDrafter(pool, config)
        relaxed = speculative_generate(model, prompt, MAX_NEW, eos, drafter, verification.rule)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + relaxed.tokens])).logits[0, len(prompt) - 1:-1]
        probs = torch.softmax(logits.float(), dim=-1)
        tokens = torch.tensor(relaxed.tokens)
        token_probs = probs.gather(1, tokens[:, None])[:, 0]
        rank = (probs > token_probs[:, None] + 1e-6).sum(1)  # tokens clearly more probable
        is_greedy = token_probs >= probs.max(1).values - 1e-6
        eq8 = (rank < verification.top_k) & (token_probs > verification.min_prob - 1e-6)
        assert bool((eq8 | is_greedy).all()), f"prompt {i}: tokens {(~(eq8 | is_greedy)).nonzero()[:, 0].tolist()}"


def test_empty_prompt_and_bad_budget_are_refused(lm) -> None:
    model, _, eos = lm
    with pytest.raises(RecspecError, match="empty prompt"):
        speculative_generate(model, [], MAX_NEW, eos)
    with pytest.raises(RecspecError, match="max_new_tokens"):
        hf_generate(model, [[1, 2]], 0, eos)


def test_compact_tail_equals_gathering_the_prefix_and_the_path() -> None:
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from recspec.decoding.cache import compact_tail, gather_positions

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    with torch.inference_mode():
        gathered = returned_cache(model(input_ids=torch.randint(50, (1, 12)), use_cache=True))
        compacted = copy.deepcopy(gathered)
        path = torch.tensor([[7, 9, 11]])
        gather_positions(gathered, torch.cat((torch.arange(7), path[0]))[None])
        compact_tail(compacted, 7, path)
        for a, b in zip(gathered.layers, compacted.layers):
            assert a.keys.shape == b.keys.shape == (1, 2, 10, 8)
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        step = torch.tensor([[3]])
        logits = [model(input_ids=step, position_ids=torch.tensor([[10]]), **with_cache(model, cache)).logits
                  for cache in (gathered, compacted)]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("lead", [0, 5, 12])
def test_compact_copies_only_past_what_every_row_keeps_and_equals_a_gather(lead: int) -> None:
    """``compact`` keeps, row by row, what one gather of every kept position keeps (fills at
    position 0 included), whether the rows all keep a leading run of positions (copied from its
    end on) or not."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from recspec.decoding.cache import compact, gather_positions

    torch.manual_seed(lead)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    keep = torch.rand(3, 12) < 0.5
    keep[:, :lead] = True
    keep[0, lead:lead + 1] = False  # a drop right after the run (none when every row keeps all)
    keep[1, -1] = True
    with torch.inference_mode():
        cache = returned_cache(model(input_ids=torch.randint(50, (3, 12)), use_cache=True))
        gathered = copy.deepcopy(cache)
        positions, filled = compact([cache], keep)
        gather_positions(gathered, positions)
    assert positions.shape == (3, int(keep.sum(1).max()))
    assert all(torch.equal(positions[b, filled[b]], keep[b].nonzero()[:, 0]) for b in range(3))
    for a, b in zip(gathered.layers, cache.layers):
        assert a.keys.shape == b.keys.shape and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
