"""Tests for recspec.itemids.trie: a hand-checked example, brute-force properties, errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recspec.itemids.trie import ItemTrie

# Five items, L = 3, V = 10. Prefix [1, 0] and [1, 5] are adjacent nodes and [1, 5] has child
# token 0, so key arithmetic without range checks would accept token 10 after [1, 0] and token -1
# after [1, 5].
V = 10
CODES = [[3, 5, 0], [3, 5, 7], [3, 6, 0], [1, 5, 0], [1, 0, 9]]
# Every prefix with its sorted next tokens.
NEXT = {
    (): [1, 3],
    (1,): [0, 5],
    (3,): [5, 6],
    (1, 0): [9],
    (1, 5): [0],
    (3, 5): [0, 7],
    (3, 6): [0],
    **{tuple(code): [] for code in CODES},
}


@pytest.fixture
def trie() -> ItemTrie:
    return ItemTrie(torch.tensor(CODES), V)


def node(trie: ItemTrie, prefix: tuple[int, ...]) -> int:
    return int(trie.walk(torch.tensor([prefix], dtype=torch.long).view(1, len(prefix)))[0])


def nodes_of(trie: ItemTrie, prefixes: list[tuple[int, ...]]) -> torch.Tensor:
    return torch.tensor([node(trie, p) if p is not None else -1 for p in prefixes])


def mask_rows(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool)
    for row, tokens in enumerate(allowed):
        mask[row, tokens] = True
    return mask


# ---------------------------------------------------------------------------- hand example


def test_sizes_and_documented_numbering(trie: ItemTrie) -> None:
    assert (trie.depth, trie.num_items, trie.num_nodes, trie.vocab_size, trie.root) == (
        3, 5, 12, 10, 0,
    )
    # Breadth-first, lexicographic within a depth.
    in_order = sorted(NEXT, key=lambda p: (len(p), p))
    assert [node(trie, p) for p in in_order] == list(range(12))


def test_walk_depth_and_items(trie: ItemTrie) -> None:
    assert trie.walk(torch.zeros(3, 0, dtype=torch.long)).tolist() == [0, 0, 0]
    full = trie.walk(torch.tensor(CODES))
    assert trie.items(full).tolist() == [0, 1, 2, 3, 4]
    assert trie.node_depth(full).tolist() == [3] * 5
    inner = nodes_of(trie, [(), (3,), (1, 5), None])
    assert trie.items(inner).tolist() == [-1, -1, -1, -1]
    assert trie.node_depth(inner).tolist() == [0, 1, 2, -1]
    # Unknown tokens anywhere in the prefix give -1, and -1 propagates.
    bad = torch.tensor([[3, 5, 1], [2, 5, 0], [3, 0, 0], [1, 0, 0], [1, 0, 10]])
    assert trie.walk(bad).tolist() == [-1] * 5


def test_parent_and_last_token_invert_step(trie: ItemTrie) -> None:
    prefixes = [(), (3,), (1, 5), (3, 5, 7), (1, 0, 9)]
    nodes = nodes_of(trie, prefixes + [None])
    parents = trie.parent(nodes)
    assert parents.tolist() == [-1] + [node(trie, p[:-1]) for p in prefixes[1:]] + [-1]
    assert trie.last_token(nodes).tolist() == [-1] + [p[-1] for p in prefixes[1:]] + [-1]
    assert torch.equal(trie.step(parents[1:5], trie.last_token(nodes)[1:5]), nodes[1:5])


def test_step(trie: ItemTrie) -> None:
    n1, n10, n15, n35 = (node(trie, p) for p in [(1,), (1, 0), (1, 5), (3, 5)])
    nodes = torch.tensor([0, 0, n1, n35, n35, n10, n15, n10, n15, -1, -1, 0, 0])
    tokens = torch.tensor([3, 2, 5, 7, 6, 9, 0, 10, -1, 3, 0, -5, 10**9])
    expected = [node(trie, (3,)), -1, n15, node(trie, (3, 5, 7)), -1, node(trie, (1, 0, 9)),
                node(trie, (1, 5, 0)), -1, -1, -1, -1, -1, -1]
    assert trie.step(nodes, tokens).tolist() == expected
    leaf = node(trie, (3, 6, 0))
    assert trie.step(torch.tensor([leaf] * 3), torch.tensor([0, 1, 3])).tolist() == [-1] * 3
    empty = torch.zeros(0, dtype=torch.long)
    assert trie.step(empty, empty).shape == (0,)


def test_allowed_mask_and_children(trie: ItemTrie) -> None:
    prefixes = [*NEXT, None]
    nodes = nodes_of(trie, prefixes)
    allowed = [NEXT[p] if p is not None else [] for p in prefixes]
    assert torch.equal(trie.allowed_mask(nodes), mask_rows(allowed, V))

    tokens, real = trie.children(nodes_of(trie, [(), (3, 5), (1, 0), (3, 6, 0), None]))
    assert tokens.tolist() == [[1, 3], [0, 7], [9, 0], [0, 0], [0, 0]]
    assert real.tolist() == [[True, True], [True, True], [True, False], [False, False],
                             [False, False]]
    tokens, real = trie.children(nodes_of(trie, [(1, 5, 0), None]))
    assert tokens.shape == real.shape == (2, 0)
    tokens, real = trie.children(torch.zeros(0, dtype=torch.long))
    assert tokens.shape == real.shape == (0, 0)
    assert trie.allowed_mask(torch.zeros(0, dtype=torch.long)).shape == (0, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_additive_mask_values(trie: ItemTrie, dtype: torch.dtype) -> None:
    nodes = torch.tensor([*range(trie.num_nodes), -1])
    allowed = trie.allowed_mask(nodes)
    additive = trie.additive_mask(nodes, dtype=dtype)
    assert additive.dtype == dtype and additive.shape == (len(nodes), V)
    assert torch.equal(additive == 0, allowed)
    assert not torch.signbit(additive[allowed]).any()  # +0.0, not -0.0
    assert (additive[~allowed] == torch.finfo(dtype).min).all()
    assert trie.additive_mask(nodes).dtype == torch.float32


def test_child_edges_lead_where_step_goes(trie: ItemTrie) -> None:
    """``child_edges`` gives ``children``' tokens and, for every real child, the node ``step``
    reaches with its token (over every node, leaves and ``-1`` included)."""
    nodes = torch.tensor([*range(trie.num_nodes), -1])
    tokens, real, children = trie.child_edges(nodes)
    assert torch.equal(tokens, trie.children(nodes)[0]) and torch.equal(real, trie.children(nodes)[1])
    stepped = trie.step(nodes[:, None].expand_as(tokens).reshape(-1), tokens.reshape(-1)).view(tokens.shape)
    assert torch.equal(children[real], stepped[real]) and bool((stepped[real] > 0).all())
    assert int(real.sum()) == trie.num_nodes - 1  # every edge once


def test_accelerator_mask_path_on_cpu(trie: ItemTrie, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU, masks gather the trie's largest fan-out per row; check that path here too."""
    nodes = torch.tensor([*range(trie.num_nodes), -1])
    expected = trie.allowed_mask(nodes), trie.additive_mask(nodes)

    def fixed_width(nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, count, _ = trie._padded_children(nodes, trie._max_children)
        return tokens, count > 0

    monkeypatch.setattr(trie, "_mask_columns", fixed_width)
    assert torch.equal(trie.allowed_mask(nodes), expected[0])
    assert torch.equal(trie.additive_mask(nodes), expected[1])


def test_to_returns_independent_copy(trie: ItemTrie) -> None:
    moved = trie.to("cpu")
    assert moved is not trie and moved.device == torch.device("cpu")
    nodes = torch.tensor([*range(trie.num_nodes), -1])
    assert torch.equal(moved.allowed_mask(nodes), trie.allowed_mask(nodes))


# ---------------------------------------------------------------------------------- errors


def test_duplicate_identifiers_name_both_items() -> None:
    codes = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [3, 4]])
    with pytest.raises(ValueError, match=r"items 1 and 4 .*\[3, 4\]"):
        ItemTrie(codes, 10)


@pytest.mark.parametrize("bad", [-1, 10])
def test_out_of_range_ids(bad: int) -> None:
    with pytest.raises(ValueError, match=r"item 1 .*outside \[0, 10\)"):
        ItemTrie(torch.tensor([[1, 2], [3, bad]]), 10)


@pytest.mark.parametrize(
    "codes, message",
    [
        (torch.zeros(0, 3, dtype=torch.long), "non-empty"),
        (torch.zeros(4, 0, dtype=torch.long), "non-empty"),
        (torch.tensor([1, 2, 3]), "2-D"),
        (torch.zeros(2, 2, 2, dtype=torch.long), "2-D"),
        (torch.tensor([[0.0, 1.0]]), "integer"),
    ],
)
def test_malformed_codes(codes: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ItemTrie(codes, 10)


# ------------------------------------------------------------------- brute-force properties


@st.composite
def identifier_sets(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], int]:
    """Distinct identifiers of random length 1..4 over small per-level alphabets of vocab ids.

    Levels may share vocab ids, which the trie must not care about.
    """
    depth = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 4)) for _ in range(depth)]
    vocab_size = draw(st.integers(max(sizes), 24))
    ids = st.integers(0, vocab_size - 1)
    alphabets = [draw(st.lists(ids, min_size=k, max_size=k, unique=True)) for k in sizes]
    every = list(itertools.product(*alphabets))
    return draw(st.lists(st.sampled_from(every), min_size=1, max_size=30, unique=True)), vocab_size


def next_tokens(idents: list[tuple[int, ...]], prefix: tuple[int, ...]) -> set[int]:
    d = len(prefix)
    return {ident[d] for ident in idents if d < len(ident) and ident[:d] == prefix}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), case=identifier_sets())
def test_masks_and_children_match_brute_force(data: st.DataObject, case) -> None:
    idents, vocab_size = case
    trie = ItemTrie(torch.tensor(idents), vocab_size)
    depth = len(idents[0])
    near = st.sampled_from(sorted({t for ident in idents for t in ident}))
    token = st.one_of(near, st.integers(0, vocab_size - 1))
    for d in range(depth + 1):
        real = sorted({ident[:d] for ident in idents})
        made_up = data.draw(st.lists(st.tuples(*[token] * d), max_size=8))
        prefixes = real + made_up
        nodes = trie.walk(torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), d))
        exists = [any(ident[:d] == p for ident in idents) for p in prefixes]
        assert (nodes >= 0).tolist() == exists
        assert trie.node_depth(nodes).tolist() == [d if e else -1 for e in exists]
        allowed = [sorted(next_tokens(idents, p)) for p in prefixes]
        assert torch.equal(trie.allowed_mask(nodes), mask_rows(allowed, vocab_size))
        tokens, is_real = trie.children(nodes)
        assert tokens.shape[1] == max(map(len, allowed))
        assert [row[mask].tolist() for row, mask in zip(tokens, is_real)] == allowed
        assert (tokens[~is_real] == 0).all()
    first = sorted(next_tokens(idents, ()))
    assert trie.first_tokens().tolist() == first
    assert trie.step(torch.full((len(first),), trie.root), trie.first_tokens()).tolist() == list(
        range(1, len(first) + 1))  # the root's children are nodes 1..F, in token order


@settings(max_examples=60, deadline=None)
@given(case=identifier_sets())
def test_full_identifiers_walk_to_their_items(case) -> None:
    idents, vocab_size = case
    trie = ItemTrie(torch.tensor(idents), vocab_size)
    leaves = trie.walk(torch.tensor(idents))
    assert trie.items(leaves).tolist() == list(range(len(idents)))
    assert trie.num_items == len(idents) and trie.depth == len(idents[0])
    assert trie.num_nodes == len({ident[:d] for ident in idents for d in range(trie.depth + 1)})


@settings(max_examples=60, deadline=None)
@given(case=identifier_sets(), seed=st.integers(0, 2**32 - 1))
def test_random_walks_from_the_root_end_at_items(case, seed: int) -> None:
    idents, vocab_size = case
    trie = ItemTrie(torch.tensor(idents), vocab_size)
    generator = torch.Generator().manual_seed(seed)
    nodes = torch.zeros(16, dtype=torch.long)
    path = []
    for _ in range(trie.depth):
        allowed = trie.allowed_mask(nodes)
        assert allowed.any(dim=1).all()
        tokens = torch.multinomial(allowed.float(), 1, generator=generator).squeeze(1)
        path.append(tokens)
        nodes = trie.step(nodes, tokens)
    assert not trie.allowed_mask(nodes).any()
    items = trie.items(nodes)
    assert (items >= 0).all()
    assert torch.equal(torch.tensor(idents)[items], torch.stack(path, dim=1))


def accepted_sequences(trie: ItemTrie, at: int = 0, prefix: tuple[int, ...] = ()) -> set:
    """Every full token sequence the trie accepts below node ``at``, by DFS over children."""
    if trie.node_depth(torch.tensor([at])).item() == trie.depth:
        return {prefix}
    tokens, real = trie.children(torch.tensor([at]))
    found = set()
    for token in tokens[0][real[0]].tolist():
        child = int(trie.step(torch.tensor([at]), torch.tensor([token]))[0])
        found |= accepted_sequences(trie, child, (*prefix, token))
    return found


@settings(max_examples=60, deadline=None)
@given(case=identifier_sets())
def test_trie_accepts_exactly_the_identifiers(case) -> None:
    idents, vocab_size = case
    assert accepted_sequences(ItemTrie(torch.tensor(idents), vocab_size)) == set(idents)


# -------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3000, 4), generator=generator).unique(dim=0)
    codes = codes + torch.arange(4) * 16
    cpu = ItemTrie(codes, 70)
    for cuda in (cpu.to("cuda"), ItemTrie(codes.cuda(), 70)):
        assert cuda.device.type == "cuda"
        nodes = torch.randint(-1, cpu.num_nodes, (500,), generator=generator)
        tokens = torch.randint(-2, 72, (500,), generator=generator)
        prefixes = codes[torch.randint(0, len(codes), (500,), generator=generator), :3]
        on = nodes.cuda()
        assert torch.equal(cuda.step(on, tokens.cuda()).cpu(), cpu.step(nodes, tokens))
        assert torch.equal(cuda.walk(prefixes.cuda()).cpu(), cpu.walk(prefixes))
        assert torch.equal(cuda.node_depth(on).cpu(), cpu.node_depth(nodes))
        assert torch.equal(cuda.items(on).cpu(), cpu.items(nodes))
        assert torch.equal(cuda.allowed_mask(on).cpu(), cpu.allowed_mask(nodes))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(
                cuda.additive_mask(on, dtype).cpu(), cpu.additive_mask(nodes, dtype)
            )
        for got, want in zip(cuda.children(on), cpu.children(nodes)):
            assert torch.equal(got.cpu(), want)
