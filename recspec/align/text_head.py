"""Training a text draft head (:mod:`recspec.models.text_head`) on the target's own samples and
features (`recspec distill --head`), on the corpus, metric and trainer of
:mod:`recspec.align.distill`.

* **Corpus**: :func:`~recspec.align.distill.sample_corpus` (the target's samples at temperature 1
  on MovieLens knowledge prompts, ``corpus.jsonl``), split as distillation splits it.
* **Draft vocabulary** ``D`` (``vocab``): the ``vocab`` most frequent tokens of the training
  responses plus the end tokens (``vocab = 0``: the whole vocabulary).
* **Features**, once: one target forward per batch of the corpus gives its last hidden state ``f``
  (after the final norm) at every position and, at every response position, the log-normaliser
  ``lse`` of its logits, so that ``log p = f W^T - lse`` on any rows ``W`` of the output layer.
  They are kept in ``features.{safetensors,json}`` (float32, :mod:`recspec.statefile`: the JSON
  records the tensors' sha256, checked whenever they are read, and the corpus and target they
  came from), so an epoch costs the head alone. A cache that is damaged or made from another corpus
  or target is refused with one line. The pass is resumable: it writes its features in parts of
  :data:`PART_BATCHES` batches, which an interrupted run's next call reads back instead of
  computing them again.
* **Fused input** (``fused_layers``, EAGLE-3; default none): the features pass also keeps the
  target's outputs of those decoder layers, normalised by its final norm (``layers``), and the head
  reads them with ``f_t`` through its ``W_fuse`` (:mod:`recspec.models.text_head`). A cache made
  without them is refused for such a run (and kept valid for a run without them).
* **Loss** (EAGLE-1, teacher features): input ``t`` is ``(f_t, x_{t+1})``, the head's output
  ``h_t`` is compared with ``f_{t+1}`` at every position whose next token is a response token:
  ``p(D) KL(p_D || q) + feature_weight * SmoothL1(h_t, f_{t+1})``, where ``q`` is the head's
  distribution over ``D`` (the output layer's rows of ``D`` at ``h_t``), ``p`` the target's and
  ``p_D`` its restriction to ``D`` renormalised. ``p(D) KL(p_D || q)`` equals
  ``sum_{v in D} p_v (log p_v - log q_v) - p(D) log p(D)``: finite (a KL over the full vocabulary
  with ``q = 0`` outside ``D`` is infinite), zero exactly at ``q = p_D``, the ``q`` on ``D`` that
  maximises the acceptance ``sum min(p, q)`` (it reaches ``p(D)``), and the plain forward KL when
  ``D`` is the whole vocabulary. ``feature_weight`` defaults to 1 (EAGLE weights the regression
  10:1 over its classification term; here the distribution term, which is what acceptance
  measures, comes first and the regression helps it). ``noise`` adds ``U(-noise, noise)`` to the
  input features in training (EAGLE: 0.1; default off). ``tv_weight`` adds ``tv_weight * (p(D) -
  sum_{v in D} min(p_v, q_v))``, the acceptance's shortfall from its ceiling (the total variation
  on ``D``): the metric itself, which a head too small to reach ``p_D`` trades against the KL
  otherwise (the TVD of AtSpeed's TVDKD baseline; default 0). ``ahead_weight`` adds that loss two
  steps ahead, the head fed its own guess as a draft tree's second level feeds it (the
  training-time test of HASS and EAGLE-3; default 0: EAGLE-1).
* **Selection**: the validation acceptance ``sum_{v in D} min(p, q)`` at ``T = 1``
  (:func:`~recspec.align.distill.acceptance`), measured as decoding uses the head: one step ahead
  (fed ``f_t`` and ``x_{t+1}``, over the head's cache of true inputs), logged as
  ``valid_acceptance`` and kept in ``best/`` (a head folder). Also logged: ``valid_acceptance_2``,
  two steps ahead as a draft tree's second level sees it (fed its own ``h_{t-1}`` and ``x_{t+1}``
  after the true inputs up to ``t - 1``), ``valid_kl`` and ``valid_vocab_mass`` (the mean
  ``p(D)``: the acceptance's ceiling with this vocabulary).

Resumable exactly as distillation (``checkpoint.{safetensors,json}``, ``train_log.jsonl``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.align.distill import (ACCEPTANCE, ADDED_CORPUS_OPTIONS, CorpusConfig, Pairs, acceptance, corpus_split,
                                   open_run, pair_batch, position_kl, response_outputs, run_summary)
from recspec.align.head import HeadStore
from recspec.errors import RecspecError
from recspec.hub import resolve_model_dir
from recspec.models.text_head import (TEXT_HEAD, TextHeadDraft, layer_features, new_text_head, ordered_layers,
                                      text_head_config, text_head_fingerprint)
from recspec.models.train import OneExampleRows, Trainer, autocast
from recspec.statefile import has_state, load_state, save_state, state_files

FEATURES = "features"
PART_BATCHES = 32  # batches per resumable part of the features pass (an interruption loses at most one part)
ACCEPTANCE_2 = "valid_acceptance_2"


@dataclass(frozen=True)
class HeadDistillConfig(CorpusConfig):
    """``vocab``: draft vocabulary size (0: all tokens); ``feature_weight``: weight of the
    feature regression; ``noise``: half-width of the uniform noise on the input features in
    training; ``ahead_weight``: weight of the loss two steps ahead; ``tv_weight``: weight of the
    acceptance's shortfall; ``fused_layers``: the target's decoder layers the head reads beside
    its top feature; the rest as :class:`~recspec.align.distill.CorpusConfig`."""

    vocab: int = 8192
    feature_weight: float = 1.0
    noise: float = 0.0
    ahead_weight: float = 0.0
    tv_weight: float = 0.0
    fused_layers: tuple[int, ...] = ()

    def checks(self) -> dict[str, bool]:
        return {**super().checks(), "vocab": self.vocab >= 0, "feature_weight": 0 <= self.feature_weight < math.inf,
                "noise": 0 <= self.noise < math.inf, "ahead_weight": 0 <= self.ahead_weight < math.inf,
                "tv_weight": 0 <= self.tv_weight < math.inf,
                "fused_layers": ordered_layers(self.fused_layers)}


#: Options added after runs were recorded, with the value such a run trained with (as recorded in JSON).
ADDED_OPTIONS = {**ADDED_CORPUS_OPTIONS, "tv_weight": 0.0, "fused_layers": []}


def draft_vocabulary(pairs: Pairs, size: int, always: Iterable[int]) -> torch.Tensor:
    """The ``size`` most frequent tokens of the responses of ``pairs`` (ties: the smaller id
    first; never an unseen token) and the ``always`` ids (the end tokens): int64, ascending."""
    end = torch.tensor(sorted(always), dtype=torch.int64)
    counts = torch.bincount(torch.cat([torch.tensor(response, dtype=torch.int64) for _, response in pairs]))
    order = torch.argsort(-counts, stable=True)[:size]
    return torch.unique(torch.cat((order[counts[order] > 0], end)))


@dataclass
class CorpusFeatures:
    """The target's features over a corpus, flat, pair after pair: ``features`` float32 ``[N, H]``
    at every position; ``lse`` float32 ``[M]``, the log-normaliser of its logits at every position
    whose next token is a response token; ``starts`` and ``response_starts`` int64 ``[n + 1]``, where
    each pair's rows begin in them; ``layers`` float32 ``[N, F * H]``: the normalised outputs of the
    ``F`` fused layers at every position (empty without fused layers)."""

    features: torch.Tensor
    lse: torch.Tensor
    starts: torch.Tensor
    response_starts: torch.Tensor
    layers: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def right_aligned(flat: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Pairs ``rows`` (int64 ``[b]``) of a flat ragged tensor ``flat`` ``[N, ...]`` (pair ``i`` at
    ``starts[i]:starts[i + 1]``), each right-aligned in the width of the longest, zeros on the left:
    ``[b, W, ...]``."""
    begin, end = starts[rows], starts[rows + 1]
    width = int((end - begin).max())
    index = end[:, None] - width + torch.arange(width)[None, :]
    real = (index >= begin[:, None]).reshape(*index.shape, *[1] * (flat.dim() - 1))
    return torch.where(real, flat[index.clamp(min=0)], 0.0)


def compute_features(target, pairs: Pairs, batch_size: int, pad_token_id: int, progress: bool,
                     desc: str = "target features", fused_layers: Sequence[int] = ()) -> CorpusFeatures:
    """:class:`CorpusFeatures` of ``pairs`` (with the normalised outputs of ``fused_layers``), on
    the CPU: one target forward per ``batch_size`` pairs on the target's device. The first batch
    also checks that the logits are the output layer applied to the features (no soft-capping,
    bias or scale between them), which the head relies on."""
    from tqdm.auto import tqdm

    features, lse, layers = [], [], []
    output = target.get_output_embeddings().weight
    with torch.no_grad():
        for start in tqdm(range(0, len(pairs), batch_size), desc=desc, unit="batch", disable=not progress):
            batch = {key: value.to(output.device)
                     for key, value in pair_batch(pairs[start:start + batch_size], pad_token_id).items()}
            logits, real, states = response_outputs(target, batch, features=True)
            assert states is not None
            hidden = states[-1]
            if start == 0 and not torch.allclose(hidden[:, -(logits.shape[1] + 1):-1] @ output.T, logits,
                                                 rtol=1e-4, atol=1e-3):
                raise RecspecError("the target's logits are not its output layer applied to its last hidden state; "
                                   "a text head cannot draft through that output layer")
            kept = batch["attention_mask"].bool()
            features.append(hidden[kept].float().cpu())
            lse.append(torch.logsumexp(logits, dim=-1)[real].cpu())
            if fused_layers:
                layers.append(layer_features(target, states, fused_layers)[kept][:, :-hidden.shape[-1]].float().cpu())
    lengths = torch.tensor([len(p) + len(r) for p, r in pairs])
    responses = torch.tensor([len(r) for _, r in pairs])
    return CorpusFeatures(torch.cat(features), torch.cat(lse), offsets(lengths), offsets(responses),
                          torch.cat(layers) if layers else torch.empty(0))


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[n + 1]``: where each of ``n`` consecutive runs of ``counts`` (int ``[n]``) begins, and the end."""
    return torch.cat((torch.zeros(1, dtype=torch.int64), counts.long().cumsum(0)))


def joined(parts: Sequence[CorpusFeatures]) -> CorpusFeatures:
    """The :class:`CorpusFeatures` of consecutive pieces of one corpus, as one."""
    return CorpusFeatures(torch.cat([p.features for p in parts]), torch.cat([p.lse for p in parts]),
                          offsets(torch.cat([p.starts.diff() for p in parts])),
                          offsets(torch.cat([p.response_starts.diff() for p in parts])),
                          torch.cat([p.layers for p in parts]))


def feature_part(number: int) -> str:
    """The state name of part ``number`` of a resumable features pass."""
    return f"{FEATURES}-part-{number:05d}"


def _kept_features(out_dir: Path, name: str, made_from: dict[str, Any], remedy: str) -> CorpusFeatures | None:
    """The features kept as state ``name`` in ``out_dir`` (checked), or None where there are none;
    ones made from anything but ``made_from`` are refused with one line ending in ``remedy``."""
    if not has_state(out_dir, name):
        return None
    saved = load_state(out_dir, name, remedy)
    kept = saved.get("made_from") or {}
    if kept != made_from:
        layers = [kept.get("fused_layers", []), made_from.get("fused_layers", [])]
        what = ("another corpus or target" if layers[0] == layers[1] else
                f"fused layers {layers[0]} (this run reads {layers[1]})")
        raise RecspecError(f"{Path(out_dir) / name}.json: features made for {what}; {remedy}")
    return CorpusFeatures(**saved["corpus"])


def corpus_features(target, pairs: Pairs, out_dir: Path, batch_size: int, pad_token_id: int,
                    fingerprint: dict[str, str], progress: bool, fused_layers: Sequence[int] = ()) -> CorpusFeatures:
    """The :class:`CorpusFeatures` of ``pairs`` (and of ``fused_layers``) kept in
    ``out_dir/features.{safetensors,json}`` (computed and written the first time); a damaged cache,
    or one made from another corpus, target or fused layers, is refused with one line. The pass is
    resumable: every :data:`PART_BATCHES` batches are written as ``features-part-NNNNN`` (checked
    like the whole) and read back by a later call, and removed once the whole is written."""
    layers = {"fused_layers": list(fused_layers)} if fused_layers else {}  # caches made before stay valid
    made_from = {"target": fingerprint, "lengths": [[len(p), len(r)] for p, r in pairs], **layers}
    remedy = f"delete {Path(out_dir) / FEATURES}* to compute them again"
    kept = _kept_features(out_dir, FEATURES, made_from, remedy)
    if kept is not None:
        return kept
    size = batch_size * PART_BATCHES
    starts = range(0, len(pairs), size)
    parts = []
    for number, start in enumerate(starts):
        part_from = {"target": fingerprint, "start": start, "lengths": made_from["lengths"][start:start + size],
                     **layers}
        part = _kept_features(out_dir, feature_part(number), part_from, remedy)
        if part is None:
            part = compute_features(target, pairs[start:start + size], batch_size, pad_token_id, progress,
                                    desc=f"target features, part {number + 1}/{len(starts)}",
                                    fused_layers=fused_layers)
            save_state(out_dir, feature_part(number), {"made_from": part_from, "corpus": asdict(part)})
        parts.append(part)
    corpus = joined(parts)
    save_state(out_dir, FEATURES, {"made_from": made_from, "corpus": asdict(corpus)})
    for number in range(len(starts)):
        for path in state_files(out_dir, feature_part(number)):
            path.unlink(missing_ok=True)
    return corpus


class TextHeadTask(OneExampleRows):
    """Head distillation as a training task (see the module doc). ``bound``: the head being
    trained (``bound.head`` is the trainer's model) bound to the frozen target; ``train`` and
    ``valid``: int64 indices into ``pairs``."""

    def __init__(self, bound: TextHeadDraft, pairs: Pairs, corpus: CorpusFeatures, train: np.ndarray,
                 valid: np.ndarray, config: HeadDistillConfig, pad_token_id: int, store: HeadStore) -> None:
        self.bound, self.pairs, self.corpus, self.train, self.valid = bound, pairs, corpus, train, valid
        self.config, self.pad_token_id, self.head_store = config, pad_token_id, store

    def lengths(self) -> np.ndarray:
        return np.array([len(self.pairs[i][0]) + len(self.pairs[i][1]) for i in self.train], dtype=np.int64)

    def check(self) -> None:
        """Nothing to check: every pair is token ids the target sampled itself."""

    def store(self, out_dir: Path) -> HeadStore:
        return self.head_store

    def pair_rows(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """:func:`~recspec.align.distill.pair_batch` of pairs ``indices`` with their features
        ``[b, L, H]`` (left-padded as the tokens), response log-normalisers ``lse`` ``[b, R]``
        (right-aligned as the responses) and, with fused layers, their outputs ``layers``
        ``[b, L, F * H]``."""
        rows = torch.as_tensor(indices, dtype=torch.int64)
        corpus = self.corpus
        fused = {"layers": right_aligned(corpus.layers, corpus.starts, rows)} if corpus.layers.numel() else {}
        return {**pair_batch([self.pairs[i] for i in indices], self.pad_token_id),
                "features": right_aligned(corpus.features, corpus.starts, rows),
                "lse": right_aligned(corpus.lse, corpus.response_starts, rows), **fused}

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        return self.pair_rows(self.train[rows])

    def loss(self, model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None) -> torch.Tensor:
        config = self.config
        with autocast(batch["input_ids"].device, autocast_dtype):
            guessed, keys, values = head_pass(self.bound, batch, config.noise)
            at, target, lse = response_rows(guessed, batch)
            log_p = self.bound.logits(target) - lse[:, None]
            loss = self.guess_loss(at, target, log_p)
            if config.ahead_weight:
                ahead, _, _ = response_rows(second_pass(self.bound, batch, guessed, keys, values), batch)
                loss = loss + config.ahead_weight * self.guess_loss(ahead, target, log_p)
        return loss

    def guess_loss(self, guessed: torch.Tensor, target: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
        """``p(D) KL(p_D || q)`` plus ``feature_weight`` times the smooth-L1 regression plus
        ``tv_weight`` times the acceptance's shortfall ``p(D) - sum min(p, q)``, means over ``n``
        rows: the head's guesses ``[n, H]``, the target's features ``[n, H]`` and its log-probs on
        the draft vocabulary ``[n, D]``."""
        config = self.config
        log_q = self.bound.log_probs(guessed)
        loss = support_kl(log_p, log_q).mean()
        if config.feature_weight:
            loss = loss + config.feature_weight * torch.nn.functional.smooth_l1_loss(guessed.float(), target)
        if config.tv_weight:
            every = torch.ones(len(log_p), dtype=torch.bool, device=log_p.device)
            loss = loss + config.tv_weight * (log_p.exp().sum(dim=-1) - acceptance(log_p, log_q, every)).mean()
        return loss

    def validation_scores(self, model) -> dict[str, float]:
        """Mean per-token acceptance one step ahead (``valid_acceptance``, the selection metric)
        and two steps ahead (``valid_acceptance_2``), ``valid_kl`` (one step ahead) and
        ``valid_vocab_mass`` over the validation responses."""
        scores: dict[str, list[torch.Tensor]] = {ACCEPTANCE: [], ACCEPTANCE_2: [], "valid_kl": [],
                                                 "valid_vocab_mass": []}
        device = self.bound.weight.device
        with torch.no_grad():
            for start in range(0, len(self.valid), self.config.batch_size):
                batch = {key: value.to(device)
                         for key, value in self.pair_rows(self.valid[start:start + self.config.batch_size]).items()}
                guessed, keys, values = head_pass(self.bound, batch, 0.0)
                at, target, lse = response_rows(guessed, batch)
                at_2, _, _ = response_rows(second_pass(self.bound, batch, guessed, keys, values), batch)
                log_p = self.bound.logits(target) - lse[:, None]
                log_q, log_q2 = self.bound.log_probs(at), self.bound.log_probs(at_2)
                every = torch.ones(len(log_p), dtype=torch.bool, device=device)
                scores[ACCEPTANCE].append(acceptance(log_p, log_q, every))
                scores[ACCEPTANCE_2].append(acceptance(log_p, log_q2, every))
                scores["valid_kl"].append(support_kl(log_p, log_q))
                scores["valid_vocab_mass"].append(log_p.exp().sum(dim=-1))
        return {name: float(torch.cat(values).mean()) for name, values in scores.items()}

    def validation_loss(self, model, device: torch.device, autocast_dtype: torch.dtype | None) -> float:
        """The validation KL (``valid_kl``)."""
        return self.validation_scores(model)["valid_kl"]


def head_pass(bound: TextHeadDraft, batch: dict[str, torch.Tensor], noise: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head over a :meth:`TextHeadTask.pair_rows` batch with teacher features: input ``i`` is
    ``(f_i, x_{i+1})`` at position ``i`` (``f_i`` read with the fused layers' outputs when the
    batch has them; plus ``U(-noise, noise)`` on what is read), attending causally to the real
    inputs. Returns its outputs ``[b, L - 1, H]`` and keys and values ``[b, kv_heads, L - 1, d]``."""
    features = batch["features"][:, :-1]
    if "layers" in batch:
        features = torch.cat((batch["layers"][:, :-1], features), dim=-1)
    if noise:
        features = features + (torch.rand_like(features) * 2 - 1) * noise
    return bound.step(bound.head.read(features), batch["input_ids"][:, 1:], batch["position_ids"][:, :-1],
                      causal_rows(batch))


def second_pass(bound: TextHeadDraft, batch: dict[str, torch.Tensor], guessed: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> torch.Tensor:
    """The head two steps ahead: input ``i`` is ``(h_{i-1}, x_{i+1})`` (``guessed`` ``[b, T, H]``:
    the outputs of :func:`head_pass`, ``keys``, ``values`` its keys and values) at position ``i``,
    attending to the true inputs before ``i`` and itself, as a draft tree's second level does.
    Returns ``[b, T, H]``."""
    rows = causal_rows(batch)
    count = rows.shape[1]
    own = torch.eye(count, dtype=torch.bool, device=rows.device)
    earlier = rows & ~own
    previous = torch.nn.functional.pad(guessed[:, :-1], (0, 0, 1, 0))
    return bound.step(previous, batch["input_ids"][:, 1:], batch["position_ids"][:, :-1],
                      torch.cat((earlier, own.expand_as(rows)), dim=2), (keys, values))[0]


def causal_rows(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool ``[b, T, T]`` (``T = L - 1`` head inputs): input ``i`` sees the real inputs up to ``i``,
    and a padding input itself."""
    real = batch["attention_mask"][:, :-1].bool()
    count = real.shape[1]
    causal = torch.ones(count, count, dtype=torch.bool, device=real.device).tril()
    return (causal & real[:, None, :]) | torch.eye(count, dtype=torch.bool, device=real.device)


def response_rows(guessed: torch.Tensor, batch: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's outputs whose next token is a response token, flat ``[n, H]``, the target's
    features they guess ``[n, H]`` and its log-normalisers there ``[n]``."""
    lengths = batch["response_lengths"]
    width = int(lengths.max())
    real = torch.arange(width, device=lengths.device)[None, :] >= width - lengths[:, None]
    return (guessed[:, -(width + 1):-1][real], batch["features"][:, -(width + 1):-1][real],
            batch["lse"][:, -width:][real])


def support_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``p(D) KL(p_D || q)`` per row (module doc): ``log_p`` ``[n, D]`` the target's log-probs on
    the draft vocabulary (their mass ``p(D) <= 1``), ``log_q`` ``[n, D]`` the head's. Returns ``[n]``."""
    mass = log_p.exp().sum(dim=-1)
    every = torch.ones(len(log_p), dtype=torch.bool, device=log_p.device)
    return position_kl(log_p, log_q, every) - mass * mass.log()


def distill_head(target_spec: str, out_dir: Path, config: HeadDistillConfig = HeadDistillConfig(),
                 max_minutes: float | None = None, progress: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Sample the corpus, compute the target's features once, then train (or go on training) the
    head, all on ``device`` (the features are kept on the CPU); returns the run's summary (as
    :func:`~recspec.align.distill.distill`)."""
    from recspec.knowledge.decode import eos_ids

    target, tokenizer = open_run(target_spec, out_dir, {"target": str(target_spec), "head": True, **asdict(config)},
                                 ADDED_OPTIONS, lambda model: text_head_config(model, 0, config.fused_layers), device)
    fingerprint = text_head_fingerprint(resolve_model_dir(target_spec))
    train, valid = corpus_split(target, tokenizer, out_dir, config, progress)
    pairs = train + valid
    corpus = corpus_features(target, pairs, out_dir, config.batch_size, tokenizer.pad_token_id, fingerprint, progress,
                             config.fused_layers)
    ids = draft_vocabulary(train, config.vocab, eos_ids(target, tokenizer)) if config.vocab else None
    head = new_text_head(target, ids, config.seed, config.fused_layers)
    store = HeadStore(out_dir, fingerprint, {"target": str(target_spec)}, TEXT_HEAD)
    task = TextHeadTask(TextHeadDraft(head, target), pairs, corpus, np.arange(len(train)),
                        np.arange(len(train), len(pairs)), config, tokenizer.pad_token_id, store)
    started = time.perf_counter()
    result = Trainer(head, task, out_dir, config.training(max_minutes, device), evaluate=task.validation_scores,
                     progress=progress, metric=ACCEPTANCE, baseline=True).run()
    return run_summary(result, len(train), len(valid), started)
