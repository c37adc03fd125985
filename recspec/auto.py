"""``--decoder auto``: the fastest exact decoder for a model pair, device, K and batch size.

Candidates: ``tree-beam`` (one target call per identifier level over the ``K`` beams; ``beam``
feeds the same nodes and also copies caches, so it is never the faster of the two), the same
loop with the first identifier level scored in the prompt's call (``expand_root``: one call fewer
for ``F - K`` more nodes, ``F`` the root's children; any model, no draft needed) and, when a draft
is loaded, ``spec-strict`` with rounds sized by cost (:class:`~recspec.decoding.tree_plan.
CostPlanner`). The choice comes from measurements kept beside the models
(:mod:`recspec.calibration`): the call cost ``F + r * n`` of the target and the draft on this
device, and the draft's acceptance per round level and width on validation users. From them the
expected time of a batch is computed level by level (:func:`expected_seconds`). The prediction
leaves out the Python work of each step and round (it runs low), so a predicted win (at
least ``margin``) is checked by timing the candidates predicted to win beside ``tree-beam`` on a
few validation users (:func:`probe`, kept beside the target like the other measurements), and
another decoder runs only when it is measured at least 3% faster than ``tree-beam`` there. The
choice and its reason are returned for printing. With ``records`` (a server) every measurement
is read from and kept in that memory before the model folders, which are then never written
(:func:`~recspec.calibration.kept_record`).
"""

from __future__ import annotations

from dataclasses import dataclass

from recspec.calibration import (Memory, acceptance_tables, call_cost, decoding_key, draft_costs, kept_record,
                                 median_prompt_length)
from recspec.decoding.tree_plan import CostPlanner
from recspec.itemids.trie import ItemTrie
from recspec.recommend import SPEC_STRICT, TREE_BEAM, DecodeOptions, Recommender
from recspec.turns import take_turns, user_batches

#: Widths tried per drafted level, as multiples of K.
WIDTH_FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0)
#: How auto names the plain loop with the first level scored in the prompt's call, and what it says
#: when it chooses each contender.
ROOT_LABEL = f"{TREE_BEAM}+root"
CHOSEN = {ROOT_LABEL: f"{TREE_BEAM} with the first identifier level scored in the prompt's call",
          SPEC_STRICT: f"{SPEC_STRICT} with cost-sized trees"}
#: Validation users of the timed check of a predicted win, the margin it must show, and its runs.
PROBE_USERS = 32
PROBE_MARGIN = 0.03
PROBE_RUNS = 3


@dataclass(frozen=True)
class Choice:
    """``decoder`` and ``options`` to run; ``predicted_ms``: per candidate, expected ms per user;
    ``reason``: one line saying why."""

    decoder: str
    options: DecodeOptions
    predicted_ms: dict[str, float]
    reason: str


def expected_seconds(planner: CostPlanner, levels: int, head_first: bool, draft_prefill_s: float) -> float:
    """Expected seconds of one batch: the first round (a head's is the target's prefill alone;
    a draft model's drafts from the root in the prompt's call, after the draft's prefill
    ``draft_prefill_s``), then rounds planned by ``planner`` until all ``levels`` are decoded,
    each advancing ``1 + a`` levels where ``a`` is the number of its drafted levels accepted."""
    after = [0.0] * (levels + 1)  # after[d]: expected seconds from depth d (later rounds)
    for depth in range(levels - 1, 0, -1):
        after[depth] = _round_seconds(planner, False, levels - depth, lambda s: after[min(levels, depth + s)])
    if head_first:
        return planner.target.call_s(planner.rows * planner.prompt_len) + after[1]
    return draft_prefill_s + _round_seconds(planner, True, levels, lambda s: after[min(levels, s)])


def _round_seconds(planner: CostPlanner, first: bool, remaining: int, then) -> float:
    plan = planner.plan(first, remaining)
    table = planner.first if first else planner.later
    reach, total, mass = 1.0, plan.seconds, 0.0
    for j, width in enumerate(plan.widths, start=1):
        accepted = reach * table(j, width)
        total += (reach - accepted) * then(j)  # levels 1 .. j - 1 accepted, j rejected: j steps
        mass += reach - accepted
        reach = accepted
    return total + (1.0 - mass) * then(len(plan.widths) + 1)


def choose(recommender: Recommender, k: int, batch_size: int, margin: float = 0.05,
           valid_users: int = 128, records: Memory | None = None) -> Choice:
    """The decoder ``auto`` runs for ``k`` items at ``batch_size`` users per batch (module doc;
    ``records``: where measurements are kept instead of the model folders)."""
    folder = recommender.folder
    prompt_len = median_prompt_length(recommender)
    target = call_cost(recommender.model, folder, prompt_len, records=records)
    levels, rows = recommender.trie.depth, batch_size
    tree_beam = target.call_s(rows * prompt_len) + (levels - 1) * target.call_s(rows * k)
    predicted = {TREE_BEAM: 1e3 * tree_beam / rows}
    contenders: dict[str, tuple[str, DecodeOptions]] = {}
    if levels >= 2:  # the first level scored in the prompt's call: one call fewer, F - K more nodes
        fanout = len(recommender.trie.first_tokens())
        root = target.call_s(rows * (prompt_len + fanout)) + (levels - 2) * target.call_s(rows * k)
        predicted[ROOT_LABEL] = 1e3 * root / rows
        if root < (1.0 - margin) * tree_beam:
            contenders[ROOT_LABEL] = (TREE_BEAM, DecodeOptions(expand_root=True))
    detail = ", ".join(f"{name} {ms:.1f}" for name, ms in predicted.items()) + f" ms/user predicted at batch {rows}"
    if recommender.draft is None:
        detail = f"no draft loaded; {detail}"
    else:
        choices = width_choices(recommender.trie, k)
        first, later = acceptance_tables(recommender, k, choices, valid_users, records=records)
        first_draft, later_draft, draft_prefill, head_first = draft_costs(recommender, prompt_len, records=records)
        planner = CostPlanner(first, later, target, first_draft, later_draft, k, prompt_len, choices, rows)
        spec = expected_seconds(planner, levels, head_first, draft_prefill.call_s(rows * prompt_len))
        predicted[SPEC_STRICT] = 1e3 * spec / rows
        plan = planner.plan(not head_first, levels if not head_first else levels - 1)
        detail += (f"; {SPEC_STRICT} {predicted[SPEC_STRICT]:.1f} ms/user (first drafted round: widths "
                   f"{list(plan.widths) or 'none'}, {plan.steps:.2f} levels expected per call)")
        if spec < (1.0 - margin) * tree_beam:
            contenders[SPEC_STRICT] = (SPEC_STRICT, DecodeOptions(planner=planner))
    if not contenders:
        return Choice(TREE_BEAM, DecodeOptions(), predicted,
                      f"auto: {TREE_BEAM} ({detail}; another decoder must be predicted {margin:.0%} faster)")
    measured = probe(recommender, k, rows, {TREE_BEAM: (TREE_BEAM, DecodeOptions()), **contenders}, records)
    detail += f"; measured on {PROBE_USERS} validation users: " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in measured.items()) + " ms/user"
    best = min(contenders, key=lambda name: measured[name])
    if measured[best] < (1.0 - PROBE_MARGIN) * measured[TREE_BEAM]:
        decoder, options = contenders[best]
        return Choice(decoder, options, predicted, f"auto: {CHOSEN[best]} ({detail})")
    return Choice(TREE_BEAM, DecodeOptions(), predicted, f"auto: {TREE_BEAM} ({detail})")


def width_choices(trie: ItemTrie, k: int) -> tuple[int, ...]:
    """The widths tried per drafted level: :data:`WIDTH_FACTORS` times ``k``, and the root's
    number of children (a first level of all of them is always accepted: the first beam step then
    costs no call of its own, which pays where the root has few children)."""
    root_children = len(trie.first_tokens())
    widths = {max(k, round(f * k)) for f in WIDTH_FACTORS}
    return tuple(sorted(widths | {root_children} if root_children > k else widths))


def probe(recommender: Recommender, k: int, batch_size: int, contenders: dict[str, tuple[str, DecodeOptions]],
          records: Memory | None = None) -> dict[str, float]:
    """ms per user of each of ``contenders`` (label: decoder and options; ``tree-beam`` first) on
    the first :data:`PROBE_USERS` validation users: :data:`PROBE_RUNS` runs in which they take
    turns batch by batch (:func:`~recspec.turns.take_turns`: a drift of the machine's speed reaches
    all alike), the best run of each (the least disturbed by the machine's other work); kept beside
    the target (or in ``records``) while target, draft, K, batch size, device, threads and contenders match."""
    def measure() -> dict[str, float]:
        examples = recommender.examples("valid", PROBE_USERS)
        runs = {label: (lambda part, plan=plan: recommender.recommend(part, k, plan[0], batch_size, plan[1]))
                for label, plan in contenders.items()}
        seconds, _ = take_turns(runs, user_batches(examples, batch_size), PROBE_RUNS)
        return {label: 1e3 * min(times) / len(examples) for label, times in seconds.items()}

    key = {**decoding_key(recommender), "k": k, "batch_size": batch_size, "users": PROBE_USERS,
           "turns": "batch by batch", "contenders": list(contenders)}
    return kept_record(recommender.folder / f"probe-k{k}-b{batch_size}.json", key, measure, records=records)
