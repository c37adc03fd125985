"""`python -m benchmarks.lab level-prior`: how much of the target's second identifier level a head drafts,
against what the target itself does on average.

Strict verification accepts a level only when the draft's top-N children hold all K beams the
target keeps (`python -m benchmarks.lab coverage`). Level 2 is where heads fail (BENCHMARKS.md, "Why the
Beauty heads plateau"). This benchmark takes that level apart. For each test user: the target's
exact level-1 beams ``x1`` (its K best first tokens, from the prompt), then its exact
``p(x2 | x1, user)`` at every one of them (one call over the prompt and ``x1`` per beam), and the
candidates: every trie child of every beam, scored ``log p(x1) + log q(x2 | x1)``. Drafts ``q``:

* ``head``: the head's guess from the target's true feature at the prompt's last position and
  ``x1``'s embedding (exactly what it drafts from);
* ``target prior``: the target's own ``p(x2 | x1)`` averaged over *other* users (the next
  ``prior_users`` test users) whose beams held ``x1``: a table per trie node, the same for every
  user (a node no prior user reached falls back to uniform);
* ``uniform``: every child of ``x1`` alike (a floor).

For N in ``factors * K``: coverage (the share of users whose K target pairs all rank in the draft's
top N: strict acceptance of the level) and recall (the share of the K pairs that do). Also the
head's probability mass on ``x1``'s trie children, and the rank of the target's pairs among their
siblings under the head. Not a timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recspec.bench.report import markdown_table, write_results
from recspec.decoding.prompts import left_pad
from recspec.decoding.scorer import forward_features, prompt_rows
from recspec.errors import RecspecError
from recspec.models.head import HeadDraft
from recspec.recommend import Recommender

DRAFTS = ("head", "target prior", "uniform")


@dataclass
class LevelTwo:
    """The target's first two levels for a batch of ``B`` users at beam width K: its level-1 beams
    ``x1`` int64 ``[B, K]`` (``slot``: their index among the root's children) with ``log_p1``
    float32 ``[B, K]``, the trie children of each beam ``children`` int64 ``[B, K, C]`` (``real``
    bool ``[B, K, C]``: False on padding slots; ``C`` the most children of any level-1 node), the
    target's ``log_p2 = log p(x2 | x1)`` at them float32 ``[B, K, C]`` (``-inf`` on padding), and its
    features at the prompts' last position ``root`` float32 ``[B, H]``."""

    x1: torch.Tensor
    slot: torch.Tensor
    log_p1: torch.Tensor
    children: torch.Tensor
    real: torch.Tensor
    log_p2: torch.Tensor
    root: torch.Tensor


def first_levels(trie, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trie's first two levels: the root's child tokens int64 ``[C1]``, and each one's child
    tokens int64 ``[C1, C]`` with their real flags bool ``[C1, C]``."""
    first = trie.first_tokens().to(device)
    return (first, *trie.children(trie.step(torch.full_like(first, trie.root), first)))


def level_two(recommender: Recommender, prompts: Sequence[torch.Tensor], k: int,
              levels: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> LevelTwo:
    """:class:`LevelTwo` of ``prompts`` (one int64 tensor per user; ``levels``: :func:`first_levels`
    on the target's device): one target call over the prompts, one over the prompts each followed
    by one of its K level-1 beams (on the target's device; the result on the CPU)."""
    model = recommender.model
    device = next(model.parameters()).device
    batch = left_pad(prompts, recommender.encoder.pad_id, device)
    logits, features = forward_features(model, None, batch.input_ids, prompt_rows(batch.attention_mask),
                                        batch.position_ids, keep_last=1)
    first, second, second_real = levels
    scores = torch.log_softmax(logits[:, -1].float(), dim=-1)[:, first]
    log_p1, slot = scores.topk(k, dim=1)  # [B, K]
    x1 = first[slot]
    children, real = second[slot], second_real[slot]  # [B, K, C]
    users = len(prompts)
    mask = torch.cat((batch.attention_mask, torch.ones_like(batch.attention_mask[:, :1])), dim=1)
    ids = torch.cat((batch.input_ids.repeat_interleave(k, dim=0), x1.reshape(-1, 1)), dim=1)  # [B * K, P + 1]
    mask = mask.repeat_interleave(k, dim=0)
    positions = torch.cat((batch.position_ids, batch.lengths[:, None]), dim=1).repeat_interleave(k, dim=0)
    logits2 = forward_features(model, None, ids, prompt_rows(mask), positions, keep_last=1)[0][:, -1]
    log_p2 = torch.log_softmax(logits2.float(), dim=-1).gather(1, children.view(users * k, -1)).view(children.shape)
    parts = (x1, slot, log_p1, children, real, log_p2.masked_fill(~real, -torch.inf), features[:, -1].float())
    return LevelTwo(*(part.cpu() for part in parts))


def head_log_q(head: HeadDraft, two: LevelTwo) -> torch.Tensor:
    """The head's ``log q(x2 | x1)`` at the candidates of ``two`` float32 ``[B, K, C]``, drafted from
    the target's true feature at the root, as in decoding."""
    users, k = two.x1.shape
    parent = two.root[:, None, :].expand(users, k, -1).contiguous()
    x1 = two.x1.to(head.device)
    rows = head.log_probs(head.features(parent.to(head.device), x1, torch.zeros_like(x1))).float().cpu()  # [B, K, V]
    return rows.gather(2, two.children).masked_fill(~two.real, -torch.inf)


class NodePrior:
    """The target prior (module doc): per level-1 token (by its slot among the root's
    ``tokens`` children, each with at most ``width`` children: :func:`first_levels`), the mean of
    the target's ``p(x2 | x1, user)`` over the users whose beams held it."""

    def __init__(self, tokens: int, width: int) -> None:
        self.sums = torch.zeros(tokens, width)
        self.counts = torch.zeros(tokens)

    def add(self, two: LevelTwo) -> None:
        slots = two.slot.reshape(-1)
        self.sums.index_add_(0, slots, two.log_p2.exp().flatten(0, 1))
        self.counts.index_add_(0, slots, torch.ones(len(slots)))

    def log_q(self, two: LevelTwo) -> tuple[torch.Tensor, int]:
        """The prior's ``log q(x2 | x1)`` at the candidates ``[B, K, C]`` (uniform over the children
        of a level-1 token no counted user reached), and how many beams that was."""
        slots = two.slot
        seen = self.counts[slots] > 0  # [B, K]
        mean = (self.sums[slots] / self.counts[slots].clamp(min=1)[:, :, None]).log()
        uniform = -two.real.sum(dim=2, keepdim=True).float().log()
        return torch.where(seen[:, :, None], mean, uniform).masked_fill(~two.real, -torch.inf), int((~seen).sum())


def ranked_hits(two: LevelTwo, log_q: torch.Tensor, k: int, ns: Sequence[int]) -> torch.Tensor:
    """For every user and N in ``ns``: how many of the target's K best level-2 pairs rank in the
    draft's top N (by ``log p(x1) + log q``): int64 ``[B, len(ns)]``."""
    users = two.x1.shape[0]
    exact = (two.log_p1[:, :, None] + two.log_p2).view(users, -1)
    drafted = (two.log_p1[:, :, None] + log_q).view(users, -1)
    wanted = exact.topk(k, dim=1).indices  # [B, K]
    rank = drafted.argsort(dim=1, descending=True, stable=True).argsort(dim=1).gather(1, wanted)  # 0-based
    return torch.stack([(rank < n).sum(dim=1) for n in ns], dim=1)


def run(out: Path, target: Path, head: Path | None, k: int = 10, factors: Sequence[float] = (1.0, 2.0, 4.0),
        users: int = 200, prior_users: int = 1000, batch_size: int = 16, name: str = "level-prior") -> str:
    """Level-2 coverage and recall of ``head`` (None: the target prior and uniform alone), the
    target prior and uniform (module doc); writes ``{name}.json`` / ``.md``; the Markdown."""
    from tqdm.auto import tqdm

    recommender = Recommender.load(target, draft_dir=head)
    if head is not None and not isinstance(recommender.draft, HeadDraft):
        raise RecspecError(f"{head}: not a draft head (`recspec align train --head` writes one)")
    examples = recommender.examples("test", users + prior_users)
    if len(examples) < users + prior_users:
        raise RecspecError(f"--users {users} and --prior-users {prior_users} need {users + prior_users} test "
                           f"users; the data has {len(examples)}")
    prompts = recommender.encoder.prompts(examples)
    ns = [max(k, round(f * k)) for f in factors]
    drafts = DRAFTS if head is not None else DRAFTS[1:]
    levels = first_levels(recommender.trie, next(recommender.model.parameters()).device)
    prior = NodePrior(*levels[1].shape)
    hits: dict[str, list[torch.Tensor]] = {draft: [] for draft in drafts}
    mass, sibling_rank, unseen = [], [], 0
    with torch.no_grad():
        for start in tqdm(range(users, users + prior_users, batch_size), desc="target prior", unit="batch"):
            prior.add(level_two(recommender, prompts[start:start + batch_size], k, levels))
        for start in tqdm(range(0, users, batch_size), desc="level 2", unit="batch"):
            two = level_two(recommender, prompts[start:start + batch_size], k, levels)
            prior_q, missing = prior.log_q(two)
            unseen += missing
            uniform = torch.where(two.real, -two.real.sum(dim=2, keepdim=True).float().log(), -torch.inf)
            drafted = {"target prior": prior_q, "uniform": uniform}
            if head is not None:
                drafted["head"] = log_q = head_log_q(recommender.draft, two)
                mass.append(log_q.logsumexp(dim=2).exp().reshape(-1))
                best = (two.log_p1[:, :, None] + two.log_p2).flatten(1).topk(k, dim=1).indices
                beam, child = best // two.children.shape[2], best % two.children.shape[2]  # [B, K] each
                rows = torch.arange(len(beam))[:, None]
                own = log_q[rows, beam, child]
                sibling_rank.append((log_q[rows, beam] > own[:, :, None]).sum(dim=2).reshape(-1) + 1)
            for draft in drafts:
                hits[draft].append(ranked_hits(two, drafted[draft], k, ns))
    rows: list[dict[str, Any]] = []
    for draft in drafts:
        got = torch.cat(hits[draft])  # [users, len(ns)]
        for j, n in enumerate(ns):
            rows.append({"draft": draft, "k": k, "n": n, "coverage": float((got[:, j] == k).float().mean()),
                         "recall": float(got[:, j].float().mean() / k)})
    results: dict[str, Any] = {"target": str(target), "head": None if head is None else str(head), "users": users,
                               "prior_users": prior_users, "k": k, "rows": rows,
                               "prior_unseen_beams": unseen / (users * k)}
    parts = [f"# Level 2: {'a head' if head is not None else 'drafts'} against the target's own average ({target})",
             f"{users} test users; the target's exact level-1 beams (K = {k}); candidates: all their trie children, "
             f"scored log p(x1) + log q(x2 | x1). Target prior: the target's p(x2 | x1) averaged over the next "
             f"{prior_users} test users ({results['prior_unseen_beams']:.1%} of the beams had no prior user: "
             f"uniform there). Coverage: users whose K target pairs all rank in the draft's top N (strict "
             f"acceptance of level 2); recall: the share of the K pairs that do.",
             markdown_table(["draft", "K", "N", "coverage", "recall"],
                            [[r["draft"], r["k"], r["n"], f"{r['coverage']:.1%}", f"{r['recall']:.1%}"]
                             for r in rows])]
    if head is not None:
        ranks = torch.cat(sibling_rank).float()
        results.update({"head_mass_on_children": float(torch.cat(mass).mean()),
                        "head_sibling_rank_mean": float(ranks.mean()),
                        "head_sibling_rank_at_most": {str(r): float((ranks <= r).float().mean()) for r in (1, 2, 4, 8)}})
        parts.append(f"The head's mass on x1's trie children: {results['head_mass_on_children']:.1%}; the target's "
                     f"pairs rank {results['head_sibling_rank_mean']:.1f} among their siblings under the head on "
                     f"average (first: {results['head_sibling_rank_at_most']['1']:.1%}, in the first 4: "
                     f"{results['head_sibling_rank_at_most']['4']:.1%}).")
    markdown = "\n\n".join(parts)
    write_results(out, name, results, markdown)
    return markdown
