"""Tests for recspec.decoding: beam_search and tree_beam_search return exactly what transformers'
generate beam search (hf_beam_search) returns, plus the tree-mask and KV-cache utilities.

The models are small randomly initialised Llamas with a large ``initializer_range`` so that their
next-token distributions are far from uniform and item scores are well separated: exact ties are
measure-zero, and scores closer than float32 noise (about 1e-6; HF and we run different batch
shapes and attention layouts) are rare. Where two of HF's results are that close, the order may
legitimately differ: :func:`assert_same_ranking` accepts exactly that (a swap of two adjacent
results, or a different K-th result, whose scores differ by less than ``TIE_GAP``) and counts it.
"""

from __future__ import annotations

from functools import partial

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from recspec.decoding import TopK, beam_search, hf_beam_search, tree_beam_search
from recspec.decoding.beam_search import beam_steps, root_prefill
from recspec.decoding.beams import Beams, select_top_k
from recspec.decoding.prompts import left_pad
from recspec.decoding.cache import drop_tail, gather_positions, require_full_attention, select_rows
from recspec.decoding.scorer import score_tree
from recspec.decoding.tree import (
    ancestor_matrix,
    child_rows,
    node_depths,
    tree_attention_mask,
    tree_position_ids,
)
from recspec.errors import RecspecError
from recspec.accel.packed_attention import additive_mask
from recspec.itemids.trie import ItemTrie
from recspec.hub import returned_cache, with_cache

pytestmark = pytest.mark.usefixtures("one_thread")

CONTROL = 4  # token ids 0..3 are control tokens; 0 is the pad token
PAD = 0
TIE_GAP = 1e-5  # HF scores closer than this may come out in either order
SCORE_ATOL = 1e-4
KS = (1, 5, 10, 20)
# tree-beam+root: the prompt's call also scores the whole first level (RootTreeCache), one call fewer
OURS = {"beam": beam_search, "tree-beam": tree_beam_search, "tree-beam+root": partial(tree_beam_search, root=True)}
DECODERS = {"hf": hf_beam_search, **OURS}
SWAPS = {"compared": 0, "swapped": 0}  # results compared with HF / near-tie differences accepted


@dataclass(frozen=True)
class Setup:
    """A random target, its items' trie and a batch of prompts of different lengths."""

    model: LlamaForCausalLM
    trie: ItemTrie
    prompts: list[torch.Tensor]


def random_codes(
    generator: torch.Generator, per_level: list[int], count: int
) -> tuple[torch.Tensor, int]:
    """``count`` distinct identifiers as model tokens ``[count, L]`` and the vocabulary size:
    level ``l`` draws from ``per_level[l]`` codes, mapped to consecutive token ids after the
    control tokens."""
    sizes = torch.tensor(per_level)
    flat = torch.randperm(int(sizes.prod()), generator=generator)[:count]
    strides = torch.cat((sizes.flip(0).cumprod(0).flip(0)[1:], torch.ones(1, dtype=torch.int64)))
    digits = flat[:, None] // strides % sizes
    offsets = CONTROL + torch.cat((torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]))
    return digits + offsets, CONTROL + int(sizes.sum())


def make_setup(seed: int, per_level: list[int], items: int, kv_heads: int, users: int) -> Setup:
    generator = torch.Generator().manual_seed(seed)
    codes, vocab = random_codes(generator, per_level, items)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, initializer_range=0.3,
        max_position_embeddings=64, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    lengths = torch.randint(1, 30, (users,), generator=generator)
    prompts = [torch.randint(1, vocab, (int(n),), generator=generator) for n in lengths]
    return Setup(model, ItemTrie(codes, vocab), prompts)


SETUPS = {
    # L = 3, 300 of 512 items, multi-head attention.
    "L3": lambda: make_setup(1, [8, 8, 8], 300, kv_heads=4, users=12),
    # L = 4, 400 of 1296 items, grouped-query attention (2 key/value heads for 4 query heads).
    "L4-gqa": lambda: make_setup(2, [6, 6, 6, 6], 400, kv_heads=2, users=10),
    # L = 4, 600 of 4096 items, multi-head attention, another seed.
    "L4": lambda: make_setup(6, [8, 8, 8, 8], 600, kv_heads=4, users=10),
    # Only 3 first tokens: for K > 3 the first step has fewer than K candidates.
    "narrow-root": lambda: make_setup(3, [3, 10, 10], 250, kv_heads=4, users=8),
}


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request) -> Setup:
    return SETUPS[request.param]()


@pytest.fixture(scope="module")
def hf_results(setup) -> dict[int, TopK]:
    return {k: hf_beam_search(setup.model, setup.prompts, setup.trie, k, PAD) for k in KS}


def eager_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert eager.config._attn_implementation == "eager"
    return eager


def assert_same_ranking(ours: TopK, ref: TopK) -> int:
    """Same items in the same order and scores within ``SCORE_ATOL``, except where ``ref``'s
    scores are near-tied (closer than ``TIE_GAP``): then two adjacent results may be swapped, or
    the K-th result may be a different item with a near-equal score. Returns how many such
    near-tie differences it accepted."""
    assert ours.items.shape == ref.items.shape
    torch.testing.assert_close(ours.scores, ref.scores, atol=SCORE_ATOL, rtol=0)
    batch, k = ref.items.shape
    accepted = 0
    for b in range(batch):
        mine, theirs, scores = ours.items[b].tolist(), ref.items[b].tolist(), ref.scores[b].tolist()
        i = 0
        while i < k:
            if mine[i] == theirs[i]:
                i += 1
                continue
            swapped = (i + 1 < k and mine[i : i + 2] == theirs[i : i + 2][::-1]
                       and abs(scores[i] - scores[i + 1]) < TIE_GAP)
            last = i == k - 1 and abs(float(ours.scores[b, i]) - scores[i]) < TIE_GAP
            assert swapped or last, (
                f"user {b}: rank {i} is item {mine[i]} ({float(ours.scores[b, i]):.7f}), "
                f"HF has item {theirs[i]} ({scores[i]:.7f})\nours {mine}\nhf   {theirs}")
            accepted += 1
            i += 2
    return accepted


def test_assert_same_ranking_accepts_only_near_ties() -> None:
    ref = TopK(torch.tensor([[3, 1, 2]]), torch.tensor([[-1.0, -2.0, -2.000001]]),
               torch.zeros(1, 3, 2, dtype=torch.int64))
    swapped = TopK(torch.tensor([[3, 2, 1]]), ref.scores, ref.tokens)
    other_last = TopK(torch.tensor([[3, 1, 7]]), ref.scores, ref.tokens)
    assert assert_same_ranking(swapped, ref) == 1
    assert assert_same_ranking(other_last, ref) == 1
    assert assert_same_ranking(ref, ref) == 0
    with pytest.raises(AssertionError):
        assert_same_ranking(TopK(torch.tensor([[1, 3, 2]]), ref.scores, ref.tokens), ref)
    with pytest.raises(AssertionError):
        assert_same_ranking(TopK(torch.tensor([[3, 7, 2]]), ref.scores, ref.tokens), ref)


def test_select_top_k_margin_is_the_smallest_kept_minus_dropped_gap() -> None:
    """Two users, one beam each over a 4-way trie: the margin is the K-th minus the (K+1)-th
    candidate score, and stays at the smallest such gap over steps."""
    trie = ItemTrie(torch.tensor([[4, 8], [5, 8], [6, 8], [7, 8]]), 9)
    beams = Beams.start(2, trie)
    log_probs = torch.full((2, 1, 9), -50.0)
    log_probs[0, 0, 4:8] = torch.tensor([-1.0, -1.5, -1.75, -3.0])
    log_probs[1, 0, 4:8] = torch.tensor([-2.0, -1.0, -2.0 - 1e-6, -4.0])
    beams = select_top_k(beams, log_probs, trie, 2)
    torch.testing.assert_close(beams.margin, torch.tensor([0.25, 1e-6]), atol=1e-7, rtol=0)
    after = select_top_k(beams, torch.zeros(2, 2, 9), trie, 2)  # one child each: nothing dropped
    assert torch.equal(after.margin, beams.margin)


def assert_valid(result: TopK, setup: Setup, k: int) -> None:
    """Real, distinct items whose tokens lead to them in the trie, best first."""
    batch = len(setup.prompts)
    assert result.items.shape == (batch, k) and result.items.dtype == torch.int64
    assert result.scores.shape == (batch, k) and result.scores.dtype == torch.float32
    assert result.tokens.shape == (batch, k, setup.trie.depth)
    assert (result.items >= 0).all()
    walked = setup.trie.items(setup.trie.walk(result.tokens.reshape(-1, setup.trie.depth)))
    assert torch.equal(walked.view(batch, k), result.items)
    assert all(len(set(row.tolist())) == k for row in result.items)
    assert (result.scores.diff(dim=1) <= 0).all()
    assert torch.isfinite(result.scores).all()


# ------------------------------------------------------------------------ exactness vs HF


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", list(OURS))
def test_matches_hf(setup, hf_results, name, k) -> None:
    ours = OURS[name](setup.model, setup.prompts, setup.trie, k, PAD)
    assert_valid(hf_results[k], setup, k)
    assert_valid(ours, setup, k)
    SWAPS["compared"] += ours.items.numel()
    SWAPS["swapped"] += assert_same_ranking(ours, hf_results[k])
    # Near-ties within float noise must stay rare (none occur with these seeds on x86 CPUs).
    assert SWAPS["swapped"] <= max(1, SWAPS["compared"] // 200), SWAPS


@pytest.mark.parametrize("name", list(OURS))
def test_eager_attention_matches_hf(setup, hf_results, name) -> None:
    """Tree attention's additive 4D mask and beam search's 2D mask are right under eager too."""
    eager = eager_copy(setup.model)
    for k in (5, 20):
        assert_same_ranking(OURS[name](eager, setup.prompts, setup.trie, k, PAD), hf_results[k])


@pytest.mark.parametrize("name", list(OURS))
def test_batches_equal_single_users(setup, hf_results, name) -> None:
    k = 10
    whole = OURS[name](setup.model, setup.prompts, setup.trie, k, PAD)
    singles = OURS[name](setup.model, setup.prompts, setup.trie, k, PAD, batch_size=1)
    uneven = OURS[name](setup.model, setup.prompts, setup.trie, k, PAD, batch_size=4)
    for result in (singles, uneven):
        assert_same_ranking(result, whole)
        assert_same_ranking(result, hf_results[k])


def test_scores_are_sums_of_log_probs(setup) -> None:
    """Brute force: one plain forward of prompt + identifier per result, no cache, no padding."""
    k = 5
    for name, decoder in DECODERS.items():
        result = decoder(setup.model, setup.prompts, setup.trie, k, PAD)
        for b, prompt in enumerate(setup.prompts):
            sequences = torch.cat((prompt.expand(k, -1), result.tokens[b]), dim=1)
            with torch.no_grad():
                logits = setup.model(input_ids=sequences).logits.float()
            log_probs = torch.log_softmax(logits[:, len(prompt) - 1 : -1], dim=-1)
            expected = log_probs.gather(2, result.tokens[b][:, :, None]).sum(dim=(1, 2))
            torch.testing.assert_close(result.scores[b], expected, atol=SCORE_ATOL, rtol=0,
                                       msg=f"{name}, user {b}")


def test_root_level_lets_the_children_log_probs_go_after_the_first_step(setup) -> None:
    """The prefill's ``[B, F, V]`` log-probs after the root's children are read by the first step
    only: the state lets them go there, and reading them twice is refused."""
    batch = left_pad(setup.prompts, PAD, torch.device("cpu"))
    with torch.no_grad():
        log_probs, state = root_prefill(setup.model, batch, setup.trie, 5)
        assert state.child_log_probs is not None
        assert state.child_log_probs.shape[:2] == (len(setup.prompts), len(setup.trie.first_tokens()))
        beams = beam_steps(log_probs, state, setup.trie, 5)
    assert state.child_log_probs is None
    assert beams.tokens.shape[2] == setup.trie.depth
    with pytest.raises(AssertionError, match="once"):
        state.extend(beams, 0)


def test_k_equals_number_of_items(small) -> None:
    """All items of a 12-item trie, ranked: the first step has only 2 candidates for 12 beams."""
    codes, _ = random_codes(torch.Generator().manual_seed(7), [2, 2, 3], 12)
    trie = ItemTrie(codes, small.model.config.vocab_size)
    ref = hf_beam_search(small.model, small.prompts, trie, 12, PAD)
    assert sorted(ref.items[0].tolist()) == list(range(12))
    for decoder in OURS.values():
        assert_same_ranking(decoder(small.model, small.prompts, trie, 12, PAD), ref)


def test_prompt_order_and_padding_do_not_matter(setup) -> None:
    """A user's result does not depend on the other users of its batch (padding, order)."""
    k = 5
    result = tree_beam_search(setup.model, setup.prompts, setup.trie, k, PAD)
    flipped = tree_beam_search(setup.model, setup.prompts[::-1], setup.trie, k, PAD)
    assert_same_ranking(TopK(flipped.items.flip(0), flipped.scores.flip(0),
                             flipped.tokens.flip(0)), result)


# ---------------------------------------------------------------------- candidate selection


def test_select_top_k_ties_and_fillers() -> None:
    """Exact ties go to the better parent, then the smaller token; missing candidates are dead."""
    trie = ItemTrie(torch.tensor([[4, 5, 6], [4, 5, 7], [4, 8, 6], [9, 5, 6]]), 10)
    beams = Beams.start(1, trie)
    first = torch.full((1, 1, 10), -5.0)
    first[0, 0, [4, 9]] = -1.0  # tie between the only two first tokens
    beams = select_top_k(beams, first, trie, 3)
    assert beams.tokens[:, :, 0].tolist() == [[4, 9, 0]]
    assert beams.scores[0, :2].tolist() == [-1.0, -1.0] and beams.scores[0, 2] == -torch.inf
    assert beams.nodes[0, 2] == -1 and beams.parents.tolist() == [[0, 0, 0]]
    second = torch.full((1, 3, 10), -7.0)
    second[0, 0, 5], second[0, 0, 8], second[0, 1, 5] = -2.0, -3.0, -2.0  # [4, 5] ties [9, 5]
    beams = select_top_k(beams, second, trie, 3)
    assert beams.tokens.tolist() == [[[4, 5], [9, 5], [4, 8]]]
    assert beams.scores.tolist() == [[-3.0, -3.0, -4.0]] and beams.parents.tolist() == [[0, 1, 0]]
    assert beams.nodes.tolist() == trie.walk(beams.tokens[0]).view(1, 3).tolist()


# ------------------------------------------------------------------------------ validation


@pytest.fixture(scope="module")
def small() -> Setup:
    return SETUPS["L3"]()


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k=0), "k must be a positive integer"),
        (dict(k=301), "exceeds the number of items"),
        (dict(prompts=[torch.tensor([5, 6]), torch.tensor([], dtype=torch.int64)]),
         "prompt 1 is empty"),
        (dict(prompts=[]), "no prompts"),
        (dict(prompts=[torch.tensor([[5, 6]])]), "1-D tensor of integer token ids"),
        (dict(prompts=[torch.tensor([5.0, 6.0])]), "1-D tensor of integer token ids"),
        (dict(prompts=[torch.tensor([5, 1000])]), "prompt token ids must lie"),
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(pad_token_id=-1), "pad_token_id"),
    ],
)
def test_invalid_input(small, name, change, message) -> None:
    args = dict(model=small.model, prompts=small.prompts, trie=small.trie, k=5, pad_token_id=PAD)
    with pytest.raises(RecspecError, match=message):
        DECODERS[name](**{**args, **change})


def test_trie_larger_than_vocabulary(small) -> None:
    trie = ItemTrie(torch.tensor([[5, 6, 7], [5, 6, 8]]), small.model.config.vocab_size + 1)
    with pytest.raises(RecspecError, match="larger than the model's"):
        beam_search(small.model, small.prompts, trie, 1, PAD)


def test_left_pad() -> None:
    batch = left_pad([torch.tensor([7, 8, 9]), torch.tensor([5])], pad_token_id=1, device="cpu")
    assert batch.input_ids.tolist() == [[7, 8, 9], [1, 1, 5]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.lengths.tolist() == [3, 1]


# ------------------------------------------------------------------------------ tree masks


def brute_ancestors(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    rows = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            rows[i][j] = True
            j = parents[j]
    return rows


@st.composite
def forests(draw) -> list[int]:
    """Parent lists of random forests in a random node order."""
    n = draw(st.integers(1, 24))
    parents_in_order = [draw(st.integers(-1, i - 1)) for i in range(n)]
    order = draw(st.permutations(range(n)))  # node i is stored at order[i]
    parents = [-1] * n
    for i, p in enumerate(parents_in_order):
        parents[order[i]] = order[p] if p >= 0 else -1
    return parents


@settings(max_examples=60, deadline=None)
@given(st.lists(forests(), min_size=1, max_size=3))
def test_ancestor_matrix_matches_brute_force(trees) -> None:
    n = max(len(t) for t in trees)
    # Rows of one batch share N: pad smaller trees with extra roots.
    padded = [t + [-1] * (n - len(t)) for t in trees]
    ancestors = ancestor_matrix(torch.tensor(padded))
    assert ancestors.tolist() == [brute_ancestors(t) for t in padded]
    depths = [[sum(row) - 1 for row in brute_ancestors(t)] for t in padded]
    assert node_depths(ancestors).tolist() == depths


def test_tree_attention_mask_and_positions() -> None:
    #   prefix (2 real tokens after 1 pad) -> a(0) -> b(1), c(2); c -> d(3)
    parents = torch.tensor([[-1, 0, 0, 2]])
    ancestors = ancestor_matrix(parents)
    mask = tree_attention_mask(torch.tensor([[False, True, True]]), ancestors, torch.float32)
    low = torch.finfo(torch.float32).min
    visible = [[0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0],
               [0, 1, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 1, 1]]
    expected = torch.tensor(visible, dtype=torch.bool)
    assert mask.shape == (1, 1, 4, 7)
    assert torch.equal(mask[0, 0], torch.where(expected, 0.0, low))
    positions = tree_position_ids(torch.tensor([2]), node_depths(ancestors))
    assert positions.tolist() == [[2, 3, 3, 4]]


def test_child_rows_equal_whole_tree_mask() -> None:
    """Growing a layered tree layer by layer gives the rows of the whole-tree mask."""
    generator = torch.Generator().manual_seed(0)
    batch, width, layers, dtype = 3, 4, 3, torch.float32
    prefix = torch.rand(batch, 5, generator=generator) > 0.3
    rows = prefix[:, None, :]
    all_parents, previous = [], None
    for layer in range(layers):
        choice = torch.randint(0, 1 if layer == 0 else width, (batch, width), generator=generator)
        rows = child_rows(rows, choice)
        all_parents.append(choice + previous if layer else torch.full((batch, width), -1))
        previous = layer * width
    whole = tree_attention_mask(prefix, ancestor_matrix(torch.cat(all_parents, dim=1)), dtype)
    assert torch.equal(additive_mask(rows, dtype), whole[:, 0, -width:])


def test_tree_forward_equals_path_forwards() -> None:
    """One forward of a whole tree after a cached prompt gives, at every node, the logits of a
    plain forward of prompt + the node's path, under sdpa and eager (with padding and GQA)."""
    setup = make_setup(4, [6, 6, 6], 100, kv_heads=2, users=2)
    prompts = [torch.tensor([5, 9, 7, 11, 6]), torch.tensor([8, 12])]
    parents = torch.tensor([[-1, 0, 0, 2, -1, 4], [-1, -1, 1, 0, 2, 4]])
    tokens = torch.tensor([[10, 13, 7, 9, 21, 5], [6, 6, 14, 19, 8, 16]])
    ancestors = ancestor_matrix(parents)
    for model in (setup.model, eager_copy(setup.model)):
        batch = left_pad(prompts, PAD, "cpu")
        with torch.no_grad():
            cache = returned_cache(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=True))
            tree = model(
                input_ids=tokens, **with_cache(model, cache), use_cache=True,
                attention_mask=tree_attention_mask(batch.attention_mask.bool(), ancestors,
                                                   model.dtype),
                position_ids=tree_position_ids(batch.lengths, node_depths(ancestors)),
            ).logits
            for b, prompt in enumerate(prompts):
                for node in range(tokens.shape[1]):
                    path = tokens[b][ancestors[b, node]]  # ancestors precede nodes here
                    plain = model(input_ids=torch.cat((prompt, path))[None]).logits[0, -1]
                    torch.testing.assert_close(tree[b, node], plain, atol=1e-4, rtol=0)


def test_score_tree_over_cached_beams_equals_path_forwards() -> None:
    """score_tree with per-node past visibility: two cached beams share a prompt row, a new tree
    hangs off each of them, and every node's logits equal a plain forward of its whole path."""
    setup = make_setup(6, [6, 6, 6], 100, kv_heads=2, users=1)
    model = setup.model
    prompt = torch.tensor([5, 9, 7, 11])
    with torch.no_grad():
        cache = returned_cache(model(input_ids=prompt[None], use_cache=True))
        # Cache the beams as a tree: 13 (pos 4) -> 14 (pos 5); 15 (pos 4).
        cached = ancestor_matrix(torch.tensor([[-1, 0, -1]]))
        score_tree(model, cache, torch.tensor([[13, 14, 15]]), cached, torch.ones(1, 4, dtype=torch.bool),
                   torch.tensor([4]))
        # New nodes: 16 after beam a, 17 under 16, 18 after beam b; plus a padding node (3).
        parents = torch.tensor([[-1, 0, -1, -1]])
        beam_rows = torch.tensor([[True] * 4 + [True, True, False], [True] * 4 + [False, False, True]])
        root_beam = torch.tensor([0, 0, 1, 1])
        past = beam_rows[root_beam][None]
        past[0, 3] = False  # the padding node sees nothing of the past
        root_positions = torch.tensor([[6, 6, 5, 5]])
        logits = score_tree(model, cache, torch.tensor([[16, 17, 18, PAD]]), ancestor_matrix(parents), past,
                            root_positions)
        paths = [[13, 14, 16], [13, 14, 16, 17], [15, 18]]
        for node, path in enumerate(paths):
            plain = model(input_ids=torch.cat((prompt, torch.tensor(path)))[None]).logits[0, -1]
            torch.testing.assert_close(logits[0, node], plain, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ KV cache


def test_select_rows_and_gather_positions() -> None:
    """select_rows copies whole rows; gather_positions and drop_tail drop cached positions exactly:
    after dropping appended junk, the next token's logits equal a plain forward of the text."""
    setup = make_setup(5, [6, 6, 6], 100, kv_heads=2, users=2)
    model = setup.model
    prompt = torch.tensor([[5, 9, 7, 11]])
    with torch.no_grad():
        cache = returned_cache(model(input_ids=prompt, use_cache=True))
        keys = cache.layers[0].keys.clone()
        select_rows(cache, torch.tensor([0, 0, 0]))
        assert cache.layers[0].keys.shape[0] == 3
        assert torch.equal(cache.layers[0].keys[2], keys[0])
        model(input_ids=torch.tensor([[13, 14]] * 3), use_cache=True, **with_cache(model, cache),
              position_ids=torch.tensor([[4, 5]] * 3))  # junk at positions 4, 5
        gather_positions(cache, torch.arange(4).expand(3, 4))
        assert cache.get_seq_length() == 4
        logits = model(input_ids=torch.tensor([[16]] * 3), **with_cache(model, cache), use_cache=True,
                       position_ids=torch.tensor([[4]] * 3)).logits[:, -1]
        plain = model(input_ids=torch.tensor([[5, 9, 7, 11, 16]])).logits[0, -1]
        model(input_ids=torch.tensor([[17, 18, 19]] * 3), use_cache=True, **with_cache(model, cache),
              position_ids=torch.tensor([[5, 6, 7]] * 3))  # junk at positions 5..7, then cut off
        drop_tail(cache, 3)
        assert cache.get_seq_length() == 5
        after = model(input_ids=torch.tensor([[20]] * 3), **with_cache(model, cache), use_cache=True,
                      position_ids=torch.tensor([[5]] * 3)).logits[:, -1]
        longer = model(input_ids=torch.tensor([[5, 9, 7, 11, 16, 20]])).logits[0, -1]
    torch.testing.assert_close(logits, plain.expand(3, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(after, longer.expand(3, -1), atol=1e-4, rtol=0)


def test_tree_attention_refuses_sliding_window_layers() -> None:
    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    with pytest.raises(RecspecError, match="full-attention"):
        require_full_attention(cache)
