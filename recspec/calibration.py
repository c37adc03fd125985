"""Per-model measurements on this machine, taken once and kept beside the model: the call cost
``F + r * n`` (:class:`~recspec.decoding.cost.CallCost`) of a target, a draft model or a draft
head, and a draft's acceptance per round level and width (:func:`acceptance_tables`, counted by
:class:`CountingVerifier`), that draft trees and ``--decoder auto`` are sized from.

The record lives in the model folder as ``calibration-<device>.json``: the cost, what it was
measured for (the sha256 of the weights, the device, torch's thread count, what accel does there
(:func:`~recspec.accel.timing_key`), the prompt length and, for a call cost, whether the model pads
its rows) and
the sha256 of the record itself. It is used only when all of that matches and the digest checks
out; otherwise the cost is measured again and the record rewritten (atomically). A folder that
cannot be written to still works: the cost is then measured in every process. A caller that must
not write into the model folders (a server: :mod:`recspec.serve.service`) passes ``records``, a
:data:`Memory`: records there are read first, then the folder's, and a new one is kept there only.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from recspec.accel import call_shape, timing_key
from recspec.decoding.cost import CallCost, measure_cost_model, measure_head_cost
from recspec.decoding.draft_sources import ModelHeadPair
from recspec.decoding.draft_tree import Level
from recspec.decoding.drafters import TopNDrafter
from recspec.decoding.frontier import Frontier
from recspec.decoding.head_trees import HeadDrafter, HeadTreeConfig, round_cost
from recspec.decoding.item_prior import ItemDraft
from recspec.decoding.target_prior import PRIOR_WEIGHTS, TargetPrior, is_prior_dir
from recspec.decoding.prefix import shared_columns
from recspec.decoding.prompts import prompt_batches
from recspec.decoding.rounds import RoundOutcome, SpecStats, drafted_per_row, run_rounds
from recspec.decoding.tree_plan import Acceptance
from recspec.decoding.verifiers import StepVerifier
from recspec.errors import RecspecError
from recspec.fileio import read_json, write_json_atomic
from recspec.models.checkpoint import trained_model_dir, weights_fingerprint
from recspec.models.head import HEAD_WEIGHTS, HeadDraft, head_dir, is_head_dir
from recspec.models.text_head import TextHeadDraft


#: Records kept in memory instead of in the model folders, by the path each would have there.
Memory = dict[Path, dict[str, Any]]


def calibration_path(model_dir: Path, device: torch.device) -> Path:
    return model_dir / f"calibration-{device.type}.json"


def _digest(record: dict[str, Any]) -> str:
    body = {key: value for key, value in record.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def measurement_key(device: torch.device | str) -> dict[str, Any]:
    """What any timing on this machine depends on besides the models: the device, torch's thread
    count, and what accel does on the device (:func:`~recspec.accel.timing_key`: the versions of its
    speed-ups, whether recspec's small-row kernel computes the products)."""
    return {"device": str(device), "threads": torch.get_num_threads(), **timing_key(device)}


def median_prompt_length(recommender) -> int:
    """The median number of tokens a call feeds for a test prompt: the prompt a call-cost record
    is measured over. A prefix the target stores (:mod:`~recspec.decoding.prefix`) is not fed, so
    it is not counted."""
    prompts = recommender.encoder.prompts(recommender.examples("test"))
    return int(statistics.median(len(p) for p in prompts)) - shared_columns(recommender.model, prompts)


def kept_record(path: Path, key: dict[str, Any], measure: Callable[[], Any], remeasure: bool = False,
                records: Memory | None = None) -> Any:
    """The value kept in the record ``path`` (``records[path]`` first, when given) when the record
    was made for exactly ``key`` (the same fields, the same values) and its digest checks out; else
    ``measure()``, kept for the next time: in ``records`` when given, else at ``path`` (atomically;
    a record that cannot be written, in a read-only folder, is measured again in the next process)."""
    if not remeasure:
        for record in (None if records is None else records.get(path), _read_record(path)):
            if (isinstance(record, dict) and record.get("sha256") == _digest(record)
                    and {name: value for name, value in record.items() if name not in ("value", "sha256")} == key):
                return record["value"]
    value = measure()
    record = {**key, "value": value}
    record["sha256"] = _digest(record)
    if records is not None:
        records[path] = record
        return value
    try:
        write_json_atomic(path, record)
    except OSError:
        pass
    return value


def _read_record(path: Path) -> Any:
    """The JSON at ``path``; None where there is none or it is damaged (measured again, never trusted)."""
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except RecspecError:
        return None


def call_cost(model, model_dir: str | Path, prompt_len: int, repeats: int = 10,
              remeasure: bool = False, records: Memory | None = None) -> CallCost:
    """The call cost of ``model`` (loaded from ``model_dir``) on its device for prompts of about
    ``prompt_len`` tokens: the kept record where it matches (see the module doc), else measured
    now (:func:`~recspec.decoding.cost.measure_cost_model`) and kept (in ``records`` when given:
    :func:`kept_record`). Whether the model computes
    its calls over padded rows (:func:`~recspec.accel.call_shape`) is part of the key: it changes
    the cost, and the cost records it (:attr:`CallCost.padded`)."""
    model_dir = Path(model_dir)
    device = next(model.parameters()).device
    padded = call_shape(model).padded
    key = {"weights_sha256": weights_fingerprint(model_dir), **measurement_key(device), "prompt_len": int(prompt_len),
           "padded_rows": padded, **precision_key(model)}
    value = kept_record(calibration_path(model_dir, device), key,
                        lambda: replace(measure_cost_model(model, prompt_len, repeats), padded=padded).to_json(),
                        remeasure, records)
    return CallCost.from_json(value)


#: Text tokens before a round that a head's cost-sized trees are costed at (a knowledge prompt of
#: ~360 tokens and part of its text; a call's cost hardly depends on it at these lengths).
COST_CONTEXT = 384


def sized_round_cost(model, model_dir: str | Path, head: TextHeadDraft, tree: HeadTreeConfig) -> CallCost:
    """The cost model of ``head``'s rounds in ``tree``s for ``model`` (loaded from ``model_dir``):
    :func:`~recspec.decoding.head_trees.round_cost` of the model's call cost (kept beside it by
    :func:`call_cost`) and the head's drafting (timed now), at :data:`COST_CONTEXT` tokens."""
    target = call_cost(model, model_dir, COST_CONTEXT)
    return round_cost(target, HeadDrafter(head, tree).round_seconds(COST_CONTEXT))


@dataclass
class CountingVerifier:
    """Strict verification that also counts what it accepts: per round kind (the first round, drafted
    from the root, or a later one) and round level ``j``, the users whose round reached level ``j``
    (it was drafted and the levels before it accepted) and those accepted there; and per absolute
    identifier level, the rounds that drafted it first in the round and how many were accepted
    (coverage from the target's exact beams)."""

    inner: StepVerifier
    reached: dict[tuple[bool, int], int] = field(default_factory=dict)
    accepted: dict[tuple[bool, int], int] = field(default_factory=dict)
    level_rounds: dict[int, int] = field(default_factory=dict)
    level_accepted: dict[int, int] = field(default_factory=dict)

    def verify(self, front: Frontier, levels: list[Level], log_p: torch.Tensor) -> RoundOutcome:
        outcome = self.inner.verify(front, levels, log_p)
        drafted = len(levels) - 1
        if drafted:
            first = bool((front.depth == 0).all())
            own = drafted_per_row(front.depth, self.inner.trie.depth, drafted)
            took = outcome.counters["accepted_steps"].cpu().float()
            for j in range(1, drafted + 1):
                here = own >= j
                _add(self.reached, (first, j), int((here & (took >= j - 1)).sum()))
                _add(self.accepted, (first, j), int((here & (took >= j)).sum()))
            for level, hit, own_levels in zip((front.depth + 1).tolist(), (took >= 1).tolist(), own.tolist()):
                if own_levels >= 1:  # users ahead of the batch draft nothing this round
                    _add(self.level_rounds, level, 1)
                    _add(self.level_accepted, level, int(hit))
        return outcome

    def finished(self, front: Frontier) -> torch.Tensor:
        return self.inner.finished(front)

    def carry(self, front: Frontier) -> Frontier:
        return self.inner.carry(front)

    def rates(self, first: bool) -> list[float]:
        """Acceptance of round levels 1, 2, ... (of the first round or the later ones) given the
        levels before them (0 where no round reached a level)."""
        levels = sorted(j for kind, j in self.reached if kind == first)
        return [self.accepted[(first, j)] / self.reached[(first, j)] if self.reached[(first, j)] else 0.0
                for j in range(1, (max(levels) if levels else 0) + 1)]


def _add(counts: dict, key, value: int) -> None:
    counts[key] = counts.get(key, 0) + value


@torch.inference_mode()
def count_rounds(recommender, draft, prompts, k: int, n: int, gamma: int | None,
                 batch_size: int = 16) -> CountingVerifier:
    """Strict speculative rounds of ``draft`` at width ``n`` over ``prompts``, counted."""
    trie, device = recommender.trie, next(recommender.model.parameters()).device
    verifier = CountingVerifier(StepVerifier(trie, k))
    shared = shared_columns(recommender.model, prompts)
    for batch in prompt_batches(prompts, recommender.encoder.pad_id, device, batch_size, shared):
        run_rounds(recommender.model, draft, batch, trie, gamma, TopNDrafter(trie, n), verifier,
                   SpecStats.zeros(len(batch.lengths)), lambda rows, front: None)
    return verifier


def measure_acceptance(recommender, draft, prompts, k: int, choices: tuple[int, ...]) -> dict[str, Any]:
    """``{"first": ..., "later": ...}``: :class:`~recspec.decoding.tree_plan.Acceptance` tables (as
    JSON) of ``draft`` at every width of ``choices``, from rounds over ``prompts``."""
    first: list[dict[int, float]] = []
    later: list[dict[int, float]] = []
    for n in choices:
        counts = count_rounds(recommender, draft, prompts, k, n, None)
        for tables, rates in ((first, counts.rates(True)), (later, counts.rates(False))):
            for j, rate in enumerate(rates):
                if j == len(tables):
                    tables.append({})
                tables[j][n] = rate
    return {"first": Acceptance(tuple(first)).to_json(), "later": Acceptance(tuple(later)).to_json()}


def decoding_key(recommender) -> dict[str, Any]:
    """What a timing of the loaded models depends on: the target's and the draft's weights and
    :func:`measurement_key`."""
    return {"target_sha256": weights_fingerprint(recommender.folder),
            **draft_identity(recommender.draft_dirs, recommender.draft_name),
            **measurement_key(next(recommender.model.parameters()).device), **precision_key(recommender.model),
            **({"draft_" + name: value for name, value in precision_key(recommender.draft).items()}
               if isinstance(recommender.draft, torch.nn.Module) else {})}


def precision_key(model) -> dict[str, str]:
    """A 16-bit model's dtype, which changes its timings and near-ties (``{}`` for float32, so the
    records kept for float32 models stay valid)."""
    dtype = next(model.parameters()).dtype
    return {} if dtype == torch.float32 else {"dtype": str(dtype).removeprefix("torch.")}


def draft_identity(folders: Sequence[Path], named: str | None = None) -> dict[str, str]:
    """sha256 of the weights of each draft folder (a model and / or a head); a draft ``named``
    instead (``items``: the item prior, a function of the target's training data; ``root``: the
    unfitted prior, a function of the trie) is named."""
    identity = {"draft": named} if named else {}
    for folder in folders:
        if is_prior_dir(folder):
            identity["prior_sha256"] = weights_fingerprint(folder, PRIOR_WEIGHTS)
        elif is_head_dir(folder):
            identity["head_sha256"] = weights_fingerprint(head_dir(folder), HEAD_WEIGHTS)
        else:
            identity["draft_sha256"] = weights_fingerprint(trained_model_dir(folder))
    return identity


def acceptance_tables(recommender, k: int, choices: tuple[int, ...], users: int = 128,
                      remeasure: bool = False, records: Memory | None = None) -> tuple[Acceptance, Acceptance]:
    """The loaded draft's acceptance per round level and width (first round, later rounds) on the
    first ``users`` validation users, kept in the target's folder as ``acceptance-k<K>.json``
    (or in ``records``: :func:`kept_record`) while target, draft, K, widths and users match."""
    key = {"target_sha256": weights_fingerprint(recommender.folder),
           **draft_identity(recommender.draft_dirs, recommender.draft_name), "k": k, "choices": list(choices),
           "users": users, **precision_key(recommender.model)}
    def measure() -> dict[str, Any]:
        prompts = recommender.encoder.prompts(recommender.examples("valid", users))
        return measure_acceptance(recommender, recommender.draft, prompts, k, choices)

    value = kept_record(recommender.folder / f"acceptance-k{k}.json", key, measure, remeasure, records)
    return Acceptance.from_json(value["first"]), Acceptance.from_json(value["later"])


def head_cost(head: HeadDraft, folder: Path, repeats: int = 10, remeasure: bool = False,
              records: Memory | None = None) -> CallCost:
    """One drafting step of ``head`` (saved in ``folder``) on its device, kept beside it (or in
    ``records``: :func:`kept_record`)."""
    key = {"head_sha256": weights_fingerprint(folder, HEAD_WEIGHTS), **measurement_key(head.device)}
    value = kept_record(calibration_path(folder, head.device), key,
                        lambda: measure_head_cost(head, repeats).to_json(), remeasure, records)
    return CallCost.from_json(value)


def draft_costs(recommender, prompt_len: int, repeats: int = 10, remeasure: bool = False,
                records: Memory | None = None) -> tuple[CallCost, CallCost, CallCost, bool]:
    """What drafting costs with the loaded draft: per level in the first round and in later
    rounds, the draft's prefill, and whether the first round is the target's prefill alone (a
    head without a draft model); measurements are kept as :func:`kept_record` says."""
    draft, free = recommender.draft, CallCost(0.0, 0.0)
    if isinstance(draft, (ItemDraft, TargetPrior)):  # a table: no model call (its Python work shows in auto's probe)
        return free, free, free, False
    folders = {is_head_dir(folder): folder for folder in recommender.draft_dirs}
    head = draft.head if isinstance(draft, ModelHeadPair) else draft if isinstance(draft, HeadDraft) else None
    model = draft.model if isinstance(draft, ModelHeadPair) else None if head is not None else draft
    model_cost = (None if model is None else
                  call_cost(model, trained_model_dir(folders[False]), prompt_len, repeats, remeasure, records))
    head_step = None if head is None else head_cost(head, head_dir(folders[True]), repeats, remeasure, records)
    if model_cost is None:
        return free, head_step, free, True
    return model_cost, head_step or model_cost, model_cost, False
