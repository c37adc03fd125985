"""Table drafts over a sub-trie (recspec.decoding.item_prior.sub_trie): a target prior (``--draft
root``, ``--draft PRIOR``) or the item draft (``--draft items``) fitted over the full item trie
drafts for a decode over the catalogue less some items (a request's ``exclude``) by reading its
per-node tables through the node of the same prefix; strict speculative search with it returns
tree-beam's items over that sub-trie, through the decoders, the Python API and the server; a trie
that is not a sub-trie is refused in one line."""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from recspec.api import RecspecModel
from recspec.decoding.item_prior import ItemDraft, TransitionPrior, node_mass
from recspec.decoding.target_prior import TargetPrior, fit_prior
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie
from recspec.models.tokenizer import identifier_token_ids
from recspec.recommend import DecodeOptions, Recommender, run_decoder
from recspec.serve.app import create_app
from recspec.serve.config import ServeConfig
from recspec.serve.service import RecommendService

pytestmark = pytest.mark.usefixtures("one_thread")

K = 10
USERS = 16

#: Six 3-token identifiers over a vocabulary of 8. The full trie, breadth-first and by token: root 0;
#: (1) 1, (2) 2; (1 3) 3, (1 4) 4, (2 3) 5, (2 4) 6; the leaves 7..12, item i at node 7 + i.
CODES = torch.tensor([[1, 3, 5], [1, 3, 6], [1, 4, 5], [2, 3, 5], [2, 4, 6], [2, 4, 7]])
KEEP = torch.tensor([0, 1, 4, 5])  # items 2 and 3 excluded: the prefixes (1 4) and (2 3) go with them
#: The sub-trie's nodes: root, (1), (2), (1 3), (2 4), then items 0, 1, 4, 5: their full-trie nodes.
EXPECTED = [0, 1, 2, 3, 6, 7, 8, 11, 12]


def test_the_node_map_of_a_sub_trie_is_the_full_tries_nodes_of_the_same_prefixes() -> None:
    full = ItemTrie(CODES, vocab_size=8)
    sub = ItemTrie(CODES[KEEP], vocab_size=8, item_ids=KEEP)
    assert full.prefix_nodes(sub).tolist() == EXPECTED
    assert full.prefix_nodes(full).tolist() == list(range(full.num_nodes))
    assert full.prefix_nodes(ItemTrie(torch.tensor([[1, 3, 5], [3, 3, 3]]), vocab_size=8)).tolist() == [
        0, 1, -1, 3, -1, 7, -1]  # the prefixes (3), (3 3), (3 3 3) are not the full trie's


def test_priors_read_their_tables_through_the_node_map_and_refuse_other_tries() -> None:
    """A target prior's weights and the item draft's node weights over a sub-trie are those of the
    same prefixes in the full trie; the map is kept per trie while the trie lives; a trie of other
    identifiers (a missing prefix, another depth or vocabulary) is one RecspecError."""
    full = ItemTrie(CODES, vocab_size=8)
    sub = ItemTrie(CODES[KEEP], vocab_size=8, item_ids=KEEP)
    prior = TargetPrior(torch.rand(full.num_nodes, generator=torch.Generator().manual_seed(0)), full)
    assert prior.for_trie(full) is prior
    read = prior.for_trie(sub)
    assert read.trie is sub and torch.equal(read.weights, prior.weights[EXPECTED])
    root_children = read.weights[[1, 2]]  # the sub-trie's level 1 is the full trie's
    torch.testing.assert_close(read.root_log_q[0, 0, [1, 2]].exp(), root_children / root_children.sum())
    draft = ItemDraft(TransitionPrior.fit([np.arange(6), np.array([5, 0, 2])], num_items=6), full)
    scores = torch.rand(2, 6, generator=torch.Generator().manual_seed(1))
    assert draft.for_trie(full) is draft
    over_sub = draft.for_trie(sub)
    assert over_sub.space is sub
    torch.testing.assert_close(over_sub.space_mass(scores), node_mass(full, scores)[:, EXPECTED])
    maps = prior._maps
    assert len(maps) == 1 and maps[sub] is maps[sub] and prior.for_trie(sub).trie is sub  # kept, not recomputed
    del sub, read, over_sub
    gc.collect()
    assert len(maps) == 0  # let go with the trie
    others = (ItemTrie(torch.tensor([[1, 3, 5], [3, 3, 3]]), vocab_size=8),  # a prefix the full trie lacks
              ItemTrie(CODES[:, :2].unique(dim=0), vocab_size=8),  # shorter identifiers
              ItemTrie(CODES, vocab_size=9))  # another vocabulary
    for other in others:
        with pytest.raises(RecspecError, match="not fitted over"):
            prior.for_trie(other)
        with pytest.raises(RecspecError, match="another item index"):
            draft.for_trie(other)


@pytest.fixture(scope="module")
def target(trained_models: Path) -> Recommender:
    return Recommender.load(trained_models / "target")


def test_strict_search_over_a_sub_trie_returns_tree_beams_items(target: Recommender) -> None:
    """``root``, a fitted prior and ``items``, each fitted over the full trie, drafting for
    spec-strict over the full trie and over the catalogue less a whole first-level subtree and
    tree-beam's top items of the first users: tree-beam's items and scores over the same trie
    (batches of 1 and 8)."""
    examples = target.examples("test", USERS)
    prompts = target.encoder.prompts(examples)
    pad = target.encoder.pad_id
    full = run_decoder("tree-beam", target.model, None, prompts, target.trie, K, pad).topk
    subtree = np.arange(256)  # every item under the first level-1 token (identifiers: n // 256, ...)
    exclude = np.union1d(subtree, full.items[:4, :3].numpy())
    keep = np.setdiff1d(np.arange(target.trie.num_items), exclude)
    sub = target.index.trie(identifier_token_ids(target.tokenizer, target.index), len(target.tokenizer), keep)
    assert sub.num_items == len(keep) and len(sub.first_tokens()) == len(target.trie.first_tokens()) - 1
    reduced = run_decoder("tree-beam", target.model, None, prompts, sub, K, pad).topk
    assert not np.isin(reduced.items.numpy(), exclude).any()
    fitted = fit_prior(target.model, target.encoder.prompts(target.examples("valid", 64)), target.trie, K, pad,
                       batch_size=32)
    drafts = {"root": target.with_draft("root"), "items": target.with_draft("items"),
              "prior": replace(target, draft=TargetPrior(fitted.float(), target.trie))}
    for name, recommender in drafts.items():
        for trie, reference, batch in ((target.trie, full, 8), (sub, reduced, 1), (sub, reduced, 8)):
            decoded = run_decoder("spec-strict", recommender.model, recommender.draft, prompts, trie, K, pad,
                                  DecodeOptions(draft_beams=40), batch)
            assert torch.equal(decoded.topk.items, reference.items), (name, trie.num_items, batch)
            torch.testing.assert_close(decoded.topk.scores, reference.scores, atol=1e-4, rtol=0)
            if name == "prior":
                assert float(decoded.stats.accepted_steps.sum()) > 0  # it drafts, not only verifies


def test_the_api_and_the_server_answer_exclusions_with_a_root_draft(target: Recommender, trained_models: Path) -> None:
    """The Python API (the service's engine) and a served request with ``exclude`` under
    ``--draft root`` and spec-strict: 200, no excluded item, tree-beam's items over the catalogue
    without them; the service's sub-trie is read through one node map, kept."""
    examples = target.examples("test", 4)
    histories = [[target.dataset.item_ids[item] for item in examples.history_of(i)] for i in range(4)]
    model = RecspecModel(RecommendService(target.with_draft("root"), "spec-strict"))
    plain = model.recommend(histories, K, "tree-beam")
    exclude = sorted({item for answer in plain for item in answer.items[:3]})
    reference = model.recommend(histories, K, "tree-beam", exclude=exclude)
    for _ in range(2):
        answers = model.recommend(histories, K, exclude=exclude)
        assert [answer.items for answer in answers] == [answer.items for answer in reference]
        assert all(answer.decoder == "spec-strict" and not set(answer.items) & set(exclude) for answer in answers)
    assert len(model.service.recommender.draft._maps) == 1
    app = create_app(ServeConfig(trained_models / "target", draft="root", decoder="spec-strict"))
    with TestClient(app) as client:
        deadline = time.monotonic() + 300
        while client.get("/health/ready").status_code != 200:
            assert time.monotonic() < deadline and app.state.recspec.failure is None
            time.sleep(0.2)
        for history, expected in zip(histories, reference):
            response = client.post("/v1/recommend", json={"history": history, "k": K, "exclude": exclude})
            assert response.status_code == 200, response.text
            got = response.json()
            assert got["decoder"] == "spec-strict" and got["items"] == expected.items
