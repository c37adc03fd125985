"""Text rounds: the engine's search over text (:class:`TextSearch`, run by :func:`generate_texts`),
speculative decoding of free text for a batch of prompts by every text decoder (LASER's
retrieval, ReSD, a text head's EAGLE-2 trees, a hybrid of both, spec-sample over trees and over
chains, TopK-ImpSpecDec, and plain greedy decoding or plain sampling, which draft nothing); the
loop is :func:`recspec.decoding.engine.run`, the item decoders' search
:mod:`recspec.decoding.rounds`.

:func:`generate_texts` prefills the prompts once (left-padded, :class:`~recspec.decoding.text_cache.
TextCache`) and then the engine repeats one *round* per target call until every row has an
end-of-sequence token or ``max_new_tokens``:

1. draft: the :class:`TextDrafter` proposes a token tree after each row's text (:class:`Draft`:
   node 0 the row's *root*, its last committed token, not yet in the KV cache; then the drafted
   nodes; a chain is a tree with one child per node; none for plain decoding);
2. score: every row's nodes in one forward pass over the batch's cache with tree attention (a
   drafter that needs the target's distributions while it drafts, TopK-ImpSpecDec's, scores them
   itself, one call per token, and the loop does not score again); shorter trees are padded with
   roots that nothing descends from, and each row attends to its own cached positions only;
3. verify: the :class:`TextVerifier` picks each row's accepted path and the target's own token
   after it (:class:`TreeVerifier`: greedy, LASER's relaxed rule or exact sampling over a tree;
   :class:`~recspec.decoding.chains.ChainVerifier`: Leviathan's test of a chain);
4. advance: the drafter learns what was accepted (a head reads the target's features at the
   kept positions), the cache keeps each row's path (:meth:`~recspec.decoding.text_cache.
   TextCache.keep`), and finished rows leave the batch.

The prefill either takes the target's own first token (the drafters of trees, ``lag`` 0) or
leaves the prompt's last token out, so that the first round's root is that token and its draft
continues the prompt (the chain drafters, ``lag`` 1).

A row's tokens depend on its own prompt, drafts and random draws only, so a batch writes each
row's text as that prompt alone does (up to the rounding of a batched call against a single one).
A batch of one runs the very computation of a single request: no padding, every cached position
visible.

Every step is a Python iteration over decoding rounds (and, for drafters made of per-request
sessions, over the rows' sessions: retrieval's tries); a head's drafting, tree masks, positions,
verification and cache compaction are tensor operations over the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from recspec.decoding.acceptance import GreedyAcceptance, TreeAcceptance, accepted_path
from recspec.decoding.cost import CallCost, batch_nodes
from recspec.decoding.engine import Clock, run
from recspec.decoding.prompts import Prompts, left_pad
from recspec.decoding.text_cache import TextCache
from recspec.decoding.tree import ancestor_matrix, node_depths
from recspec.errors import RecspecError


@dataclass(frozen=True)
class DraftTree:
    """``N`` draft nodes: ``tokens[i]`` and ``parents[i]`` in ``[-1, i)`` (``-1``: continues the
    current text directly); best-first order, so every parent precedes its children. ``chances``
    (None: not estimated): each node's estimated chance that verification accepts the path to it
    (retrieval: the share of the matched suffix's occurrences that continue with that path)."""

    tokens: list[int]
    parents: list[int]
    chances: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def first(self, nodes: int) -> DraftTree:
        """The tree of the first ``nodes`` nodes (a tree: parents come first)."""
        chances = None if self.chances is None else self.chances[:nodes]
        return DraftTree(self.tokens[:nodes], self.parents[:nodes], chances)

    def longest_branch(self) -> int:
        """Depth of the deepest node (0 for an empty draft)."""
        depth = [0] * len(self.parents)
        for i, parent in enumerate(self.parents):
            depth[i] = 1 + (depth[parent] if parent >= 0 else 0)
        return max(depth, default=0)


@dataclass
class Generation:
    """One generated text and how it was produced.

    ``tokens``: the generated token ids, the end-of-sequence token included when the model emitted
    it (as ``generate`` returns them); ``calls``: target forward calls, the prefill included;
    ``accepted``: accepted draft tokens kept in the text (every round commits one token of the
    target's own after them, and so does a prefill that takes the first token); ``drafted``: draft
    nodes scored in total (a chain's own: the nodes a row drafted for others not counted);
    ``ceiling_tokens``: tokens the same calls would have produced had every step accepted its
    longest draft branch (``1 + sum(longest branch + 1)`` over steps); ``retrieval_s``: seconds
    spent drafting (retrieving drafts and growing the temporary branches, or a head's calls);
    ``prefill_s``: the first target call (the prompt); ``wall_s``: the whole request, prefill
    included. A batch shares its prefill and wall seconds, and each round's drafting seconds:
    each text gets them divided by the rows they served.
    """

    tokens: list[int]
    prompt_tokens: int
    calls: int
    accepted: int
    drafted: int
    ceiling_tokens: int
    retrieval_s: float
    prefill_s: float
    wall_s: float


class TextSession:
    """One request's drafting state, drafted with as :class:`Sessions`: :meth:`propose` drafts a
    tree after the request's text."""

    def propose(self, text: list[int], max_depth: int) -> DraftTree:
        """A draft tree, at most ``max_depth`` deep, after ``text`` (prompt and generated tokens)."""
        raise NotImplementedError


def finish_text(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Cut ``tokens`` after the first end-of-sequence token or at ``max_new_tokens``; True if done."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[:i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def check_prompt(prompt: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt) == 0:
        raise RecspecError("empty prompt: knowledge generation needs at least one prompt token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RecspecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


@dataclass
class Draft:
    """A round's nodes, ``B`` rows of ``N``: ``tokens`` and ``parents`` int64 ``[B, N]`` (node 0 the
    row's root, parent ``-1``; then its drafted nodes, each parent a smaller index; a row with fewer
    is padded with roots of token 0 that nothing descends from); ``sizes`` and ``depths`` int64
    ``[B]``: the nodes the row drafted for itself and its deepest branch. A chain drafter adds the
    draft's distribution at each drafted node (``q``, float32 ``[B, N - 1, V]``); a drafter that
    scored the nodes itself gives the target's logits after them (and its features at them, or
    None) as ``scored`` and its ``calls``."""

    tokens: torch.Tensor
    parents: torch.Tensor
    sizes: torch.Tensor
    depths: torch.Tensor
    q: torch.Tensor | None = None
    scored: tuple[torch.Tensor, torch.Tensor | None] | None = None
    calls: int = 1
    ancestors: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.ancestors = ancestor_matrix(self.parents)  # bool [B, N, N]


#: What a drafter may feed the target while it drafts: ``n`` tokens per row (int64 ``[B, n]``) in a
#: chain after everything fed this round; returns the logits after them ``[B, n, V]`` and the
#: target's features at them (None unless the drafter wants features).
Scorer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class TextDrafter(Protocol):
    """The text loop's drafter, over the whole batch: :meth:`start` after the target's prefill
    (``features``: the target's at the prefilled columns ``[B, P - lag, H]``, None unless
    ``wants_features``; ``feature_layers``: the target's decoder layers whose outputs the features
    carry before its top feature, :func:`~recspec.models.text_head.layer_features`); :meth:`propose`
    a :class:`Draft` after each row's ``texts`` (prompt and generated tokens; ``budgets``: the
    deepest branch worth drafting per row; ``score``: see :data:`Scorer`); :meth:`learn` what was
    accepted (``path`` bool ``[B, N]``, ``own`` int64 ``[B]`` the target's token after it, the
    target's ``features`` at the nodes or None); :meth:`select` the rows that stay (int64 index).
    ``lag``: the prompt tokens the target's prefill leaves for the first round (0: the prefill
    takes the first token; 1: the first round's root is the prompt's last token); ``drop_hidden``:
    the target's cache is :class:`~recspec.decoding.text_cache.TextCache` with ``drop_hidden``."""

    lag: int
    drop_hidden: bool
    wants_features: bool
    feature_layers: tuple[int, ...]

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None: ...

    def propose(self, texts: list[list[int]], budgets: list[int], score: Scorer) -> Draft: ...

    def learn(self, draft: Draft, path: torch.Tensor, own: torch.Tensor, features: torch.Tensor | None) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...


class Sessions:
    """A :class:`TextDrafter` made of one :class:`TextSession` per request (LASER's and ReSD's
    retrieval): each row's session drafts its tree in Python, the loop scores them together. With
    ``cost`` (the target's call cost), every round's trees are cut to the node count per row that
    the cost model favours for the batch (:func:`~recspec.decoding.cost.batch_nodes`, from the
    trees' ``chances``): a batch feeds every row as many nodes as its largest tree, so the trees
    are sized together."""

    lag = 0
    drop_hidden = False
    wants_features = False
    feature_layers = ()

    def __init__(self, sessions: Sequence[TextSession], cost: CallCost | None = None) -> None:
        self.sessions, self.cost = list(sessions), cost
        self.device = torch.device("cpu")

    def start(self, prompts: Prompts, features: torch.Tensor | None) -> None:
        self.device = prompts.input_ids.device

    def propose(self, texts: list[list[int]], budgets: list[int], score: Scorer) -> Draft:
        trees = self.proposals(texts, budgets)
        if self.cost is not None and all(tree.chances is not None for tree in trees):
            width = max(len(tree) for tree in trees)
            chances = torch.tensor([tree.chances + [0.0] * (width - len(tree)) for tree in trees])
            nodes = batch_nodes(chances, self.cost)
            trees = [tree.first(nodes) for tree in trees]
        return self.draft(texts, trees)

    def proposals(self, texts: list[list[int]], budgets: list[int]) -> list[DraftTree]:
        """Each row's session's tree after its text ``texts``, at most ``budgets`` deep."""
        return [session.propose(text, budget) for session, text, budget in zip(self.sessions, texts, budgets)]

    def draft(self, texts: list[list[int]], trees: list[DraftTree]) -> Draft:
        """The round's :class:`Draft` of each row's tree ``trees`` after its text ``texts``."""
        width = 1 + max(len(tree) for tree in trees)  # shorter trees padded with roots of token 0
        tokens = [[text[-1], *tree.tokens] + [0] * (width - 1 - len(tree)) for text, tree in zip(texts, trees)]
        parents = [[-1, *(p + 1 for p in tree.parents)] + [-1] * (width - 1 - len(tree)) for tree in trees]
        return Draft(torch.tensor(tokens, device=self.device), torch.tensor(parents, device=self.device),
                     torch.tensor([len(tree) for tree in trees]),
                     torch.tensor([tree.longest_branch() for tree in trees]))

    def learn(self, draft: Draft, path: torch.Tensor, own: torch.Tensor, features: torch.Tensor | None) -> None:
        """Sessions read nothing back: each grows its own state from the text it is given."""

    def select(self, rows: torch.Tensor) -> None:
        self.sessions = [self.sessions[row] for row in rows.tolist()]


class TextVerifier(Protocol):
    """The text loop's verification, over the whole batch: :meth:`start` before the prefill (``rows``
    requests of at most ``max_new_tokens``); :meth:`first`: the target's own first token after the
    prefill's logits ``[B, V]`` (int64 ``[B]``; drafters of ``lag`` 0); :meth:`verify` a scored
    :class:`Draft` (``logits`` ``[B, N, V]`` after each node; ``generated`` int64 ``[B]``, each
    row's tokens so far): each row's accepted root path, bool ``[B, N]``, and the target's own token
    after it, int64 ``[B]``; :meth:`select` the rows that stay (int64 index)."""

    def start(self, rows: int, max_new_tokens: int, device: torch.device) -> None: ...

    def first(self, logits: torch.Tensor) -> torch.Tensor: ...

    def verify(self, draft: Draft, logits: torch.Tensor, generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def select(self, rows: torch.Tensor) -> None: ...


@dataclass
class TreeVerifier:
    """A :class:`TextVerifier` applying a :class:`~recspec.decoding.acceptance.TreeAcceptance` to
    every node and keeping the deepest fully accepted path
    (:func:`~recspec.decoding.acceptance.accepted_path`). Sampling draws each row's uniforms, one
    per text position, from ``generator`` (a CPU generator; None: one seeded 0) before decoding,
    row after row, as requests decoded one after another draw them."""

    acceptance: TreeAcceptance = field(default_factory=GreedyAcceptance)
    generator: torch.Generator | None = None
    uniforms: torch.Tensor | None = None  # float64 [B, max_new_tokens] while sampling

    def start(self, rows: int, max_new_tokens: int, device: torch.device) -> None:
        if self.acceptance.draws:
            generator = self.generator if self.generator is not None else torch.Generator().manual_seed(0)
            self.uniforms = torch.stack([torch.rand(max_new_tokens, generator=generator, dtype=torch.float64)
                                         for _ in range(rows)]).to(device)

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        return self.acceptance.choices(logits[:, None], None if self.uniforms is None else self.uniforms[:, :1])[:, 0]

    def verify(self, draft: Draft, logits: torch.Tensor, generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the uniforms of the positions the nodes' next tokens fill (sampling)
        at = None if self.uniforms is None else self.uniforms.gather(1, generated[:, None] +
                                                                     node_depths(draft.ancestors))
        choices = self.acceptance.choices(logits, at)
        last, path = accepted_path(self.acceptance.accept(draft.tokens, draft.parents, logits, choices),
                                   draft.ancestors)
        return path, choices.gather(1, last[:, None])[:, 0]

    def select(self, rows: torch.Tensor) -> None:
        if self.uniforms is not None:
            self.uniforms = self.uniforms[rows]


def path_first(path: torch.Tensor) -> torch.Tensor:
    """Each row's nodes with its accepted root path first, in node order (parents before
    children), then the others: int64 ``[B, N]`` from ``path`` bool ``[B, N]``."""
    return torch.sort((~path).to(torch.int8), dim=1, stable=True).indices


@dataclass
class Ledger:
    """Each request's text and counters while a batch decodes (what :class:`Generation` reports):
    ``generated`` tokens, ``done``, target ``calls``, ``own`` (tokens the target chose itself),
    ``drafted`` nodes, ``ceiling`` tokens, ``retrieval_s``."""

    generated: list[list[int]]
    done: list[bool]
    own: list[int]
    calls: list[int]
    drafted: list[int]
    ceiling: list[int]
    retrieval_s: list[float]

    @staticmethod
    def start(first: list[int] | None, size: int, max_new_tokens: int, eos: frozenset[int]) -> Ledger:
        """The ledger after the prefill: ``first``, the target's first token per request, or None
        when the prefill takes none (a drafter of ``lag`` 1)."""
        if first is None:
            generated, done, own = [[] for _ in range(size)], [False] * size, [0] * size
        else:
            generated, done = map(list, zip(*(finish_text([root], max_new_tokens, eos) for root in first)))
            own = [1] * size
        return Ledger(generated, done, own, [1] * size, [0] * size, list(own), [0.0] * size)

    def commit(self, rows: list[int], draft: Draft, path: torch.Tensor, mine: torch.Tensor, seconds: float,
               max_new_tokens: int, eos: frozenset[int]) -> None:
        """Add a verified round to the requests ``rows`` (by batch row): each row's accepted path
        (``path`` bool ``[B, N]``, in node order) and the target's token after it (``mine`` int64
        ``[B]``); ``seconds``: each row's share of the drafting."""
        order = path_first(path)
        kept, tokens = path.sum(dim=1).tolist(), draft.tokens.gather(1, order).tolist()
        for i, (request, token, nodes, depth) in enumerate(zip(rows, mine.tolist(), draft.sizes.tolist(),
                                                               draft.depths.tolist())):
            self.calls[request], self.own[request] = self.calls[request] + draft.calls, self.own[request] + 1
            self.drafted[request] += nodes
            self.ceiling[request] += depth + 1
            self.retrieval_s[request] += seconds
            self.generated[request], self.done[request] = finish_text(
                self.generated[request] + tokens[i][1:kept[i]] + [token], max_new_tokens, eos)

    def generations(self, prompts: Sequence[Sequence[int]], prefill_s: float, wall_s: float) -> list[Generation]:
        return [Generation(tokens=tokens, prompt_tokens=len(prompt), calls=self.calls[b],
                           accepted=len(tokens) - self.own[b], drafted=self.drafted[b], ceiling_tokens=self.ceiling[b],
                           retrieval_s=self.retrieval_s[b], prefill_s=prefill_s, wall_s=wall_s)
                for b, (prompt, tokens) in enumerate(zip(prompts, self.generated))]


class TextSearch:
    """The text rounds of one batch under the engine (:func:`~recspec.decoding.engine.run`): each
    row one request's text (``rows``: the requests still decoding, by batch row), drafted by
    ``drafter`` (None: plain decoding), scored in ``target`` (the rows' :class:`~recspec.decoding.
    text_cache.TextCache`), verified by ``verifier``, and written to ``ledger`` (see
    :func:`generate_texts`). Built, it has prefilled the prompts (left-padded with
    ``pad_token_id``; the seconds in ``clock``'s ``prefill``) and started the drafter."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], drafter: TextDrafter | None, verifier: TextVerifier,
                 max_new_tokens: int, eos: frozenset[int], clock: Clock, pad_token_id: int) -> None:
        self.model, self.prompts, self.drafter, self.verifier = model, prompts, drafter, verifier
        self.max_new_tokens, self.eos, self.clock = max_new_tokens, eos, clock
        self.observing = drafter is not None and drafter.wants_features
        self.layers = drafter.feature_layers if self.observing else ()
        started = clock.now()
        batch = left_pad([torch.tensor(list(prompt)) for prompt in prompts], pad_token_id, model.device)
        size, lag = len(prompts), 0 if drafter is None else drafter.lag
        self.rows, self.device = list(range(size)), batch.input_ids.device
        verifier.start(size, max_new_tokens, self.device)
        self.target, first, features = TextCache.start(model, batch, lag, self.observing, self.layers,
                                                        drafter is not None and drafter.drop_hidden)
        clock.add("prefill", started)
        if drafter is not None:
            drafter.start(batch, features)
        self.ledger = Ledger.start(None if lag else verifier.first(first).tolist(), size, max_new_tokens, eos)

    def feed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The :data:`Scorer` a drafter may call: ``tokens`` fed in a chain after this round's."""
        return self.target.feed(self.model, tokens, None, self.observing, self.layers)

    def draft(self) -> Draft:
        generated = self.ledger.generated
        texts = [list(self.prompts[request]) + generated[request] for request in self.rows]
        if self.drafter is None:  # plain decoding: each row's root alone
            roots = torch.tensor([[text[-1]] for text in texts], device=self.device)
            none = torch.zeros(len(roots), dtype=torch.int64)
            return Draft(roots, torch.full_like(roots, -1), none, none)
        budgets = [self.max_new_tokens - len(generated[request]) - 1 for request in self.rows]
        return self.drafter.propose(texts, budgets, self.feed)

    def score(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        if draft.scored is not None:  # the drafter scored its nodes itself
            return draft.scored
        return self.target.feed(self.model, draft.tokens, draft.ancestors, self.observing, self.layers)

    def verify(self, draft: Draft, scored: tuple[torch.Tensor, torch.Tensor | None]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        generated = torch.tensor([len(self.ledger.generated[request]) for request in self.rows],
                                 device=self.device)
        return self.verifier.verify(draft, scored[0], generated)

    def advance(self, draft: Draft, scored: tuple[torch.Tensor, torch.Tensor | None],
                outcome: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The drafter learns what was accepted, the cache keeps each row's path, the ledger its
        tokens (and its share of the round's drafting seconds); returns the rows now finished."""
        path, mine = outcome
        if self.drafter is not None:
            self.drafter.learn(draft, path, mine, scored[1])
        self.target.keep(path)
        self.ledger.commit(self.rows, draft, path, mine, self.clock.last["draft"] / len(self.rows),
                           self.max_new_tokens, self.eos)
        return torch.tensor([self.ledger.done[request] for request in self.rows])

    def settle(self, finished: torch.Tensor) -> bool:
        """The finished rows leave the cache, the verifier and the drafter."""
        if bool(finished.any()):
            stay = (~finished).nonzero()[:, 0]
            for part in (self.target, self.verifier, self.drafter):
                if part is not None:
                    part.select(stay.to(self.device))
            self.rows = [self.rows[i] for i in stay.tolist()]
        return bool(self.rows)


@torch.inference_mode()
def generate_texts(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: frozenset[int],
                   drafter: TextDrafter | None = None,
                   verifier: TextVerifier | TreeAcceptance | None = None,
                   generator: torch.Generator | None = None, pad_token_id: int = 0) -> list[Generation]:
    """Generate after each of ``prompts`` (token ids, chat template applied) in one batch, drafted by
    ``drafter`` (a batch's, :meth:`BatchDrafter.batch`; None: plain decoding) and
    verified by ``verifier`` (a :class:`~recspec.decoding.acceptance.TreeAcceptance`:
    :class:`TreeVerifier` with ``generator``; None: greedy); see the module doc. ``pad_token_id``
    fills the left padding (never attended to)."""
    for prompt in prompts:
        check_prompt(prompt, max_new_tokens)
    if not hasattr(verifier, "verify"):
        verifier = TreeVerifier(verifier or GreedyAcceptance(), generator)
    clock = Clock(model.device)
    started = clock.now()
    search = TextSearch(model, prompts, drafter, verifier, max_new_tokens, eos, clock, pad_token_id)
    run(search, clock, torch.tensor(search.ledger.done))
    return search.ledger.generations(prompts, clock.seconds["prefill"] / len(prompts),
                                     (clock.now() - started) / len(prompts))


class BatchDrafter(Protocol):
    """What drafts for a batch of prompts (token ids): a :class:`TextDrafter` per batch."""

    def batch(self, prompts: Sequence[Sequence[int]]) -> TextDrafter: ...


def speculative_generate(model, prompt: Sequence[int], max_new_tokens: int, eos: frozenset[int],
                         drafter: BatchDrafter | None = None, acceptance: TreeAcceptance = GreedyAcceptance(),
                         generator: torch.Generator | None = None) -> Generation:
    """:func:`generate_texts` of one request, drafted by ``drafter`` (None: plain decoding)."""
    batch = None if drafter is None else drafter.batch([prompt])
    return generate_texts(model, [prompt], max_new_tokens, eos, batch, acceptance, generator)[0]
