"""`recspec bench sampling`: the sampling decoders side by side, on text and on item identifiers.

**Text** (knowledge generation: MovieLens user-profile prompts, SmolLM2-135M-Instruct as the
target, a draft of its own layers, a distilled draft or a text head with ``draft_spec``): ``sample``, ``spec-sample``,
``topk-imp``, ``beam-sample`` and DSBD (fixed width, dynamic width, one KV cache), and on request
``spec-sample-fp32`` and ``dsbd-one-cache-fp32`` (a text head drafting in float32, side by side
with its int8 products), every prompt decoded alone (batch 1), the methods taking turns prompt by
prompt in a balanced order, median of ``repeats`` runs. Per method: ms per generated token
over whole requests and past each request's fixed part (``decode ms/token``: the runs timed again
cut at ``gamma + 1`` new tokens, :func:`decode_ms_per_token`; whole-request ratios move with the
texts' lengths, which differ between methods), the speed ratios of both against the
non-speculative method of the same output distribution (``spec-sample`` against ``sample``; DSBD
against ``beam-sample``; ``topk-imp``, which samples another distribution, against ``sample``),
the acceptance (Leviathan's ``alpha``: the mean of ``sum min(p, q)`` over the tested positions;
the share of drafted tokens or layers accepted), the average accepted length (drafted tokens or
layers accepted per round), the quality (the
target's mean log-likelihood per generated token), the peak memory of one prompt (measured in a
separate process, :mod:`recspec.bench.memory`), and the speed-up predicted from the measured
acceptance and cost ratio ``c`` (speculative_decoding.txt Theorem 3.8, its denominator's 1 replaced
by the measured cost of the verifying call over ``gamma + 1`` tokens in one-token calls; for DSBD
the steps per iteration of dsbd.txt Theorem 3.2 over ``1 + gamma c``) next to the measured one. A first table
justifies the draft: acceptance, ``c`` and predicted speed-up of several layer subsets.

**Recommendation** (with ``--rec-target`` / ``--rec-draft``): trie-constrained beam sampling of
K items at batch 1: the target's ``beam-sample`` with independent draws (the distribution both
speculative decoders sample exactly), AtSpeed's relaxed verification with independent draws,
and DSBD (fixed width K, dynamic width, one KV cache): WS@K (speed-up over ``beam-sample``),
accepted steps, and Recall / NDCG@K on ``quality_users`` test users.
"""

from __future__ import annotations

import multiprocessing
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.align.distill import acceptance
from recspec.bench.report import markdown_table, reuse_freed_memory, write_results
from recspec.decoding.acceptance import expected_speedup, expected_tokens_per_call
from recspec.decoding.cache import drop_tail
from recspec.decoding.cost import median_seconds
from recspec.decoding.head_trees import HeadDrafter
from recspec.decoding.rounds import SpecStats
from recspec.decoding.text import (BEAM_SAMPLE, DSBD, SAMPLE, SPEC_SAMPLE, TOPK_IMP, Generated, TextOptions, generate,
                                   log_likelihood)
from recspec.decoding.warp import Warp
from recspec.errors import RecspecError
from recspec.eval.metrics import recall_ndcg
from recspec.knowledge.sampled import generate_tree, tree_drafter
from recspec.hub import load_tokenizer, resolve_model_dir, with_cache
from recspec.models.hf import load_causal_lm
from recspec.models.layer_draft import text_draft_model
from recspec.models.text_head import TextHeadDraft, layer_features
from recspec.recommend import BEAM_SAMPLE as ITEM_BEAM_SAMPLE, DSBD as ITEM_DSBD, SPEC_RELAXED
from recspec.recommend import DecodeOptions, Decoded, Recommender, item_rows, run_decoder
from recspec.turns import take_turns

#: label -> (method, option overrides, baseline label of the same output distribution)
TEXT_METHODS: dict[str, tuple[str, dict[str, Any], str]] = {
    "sample": (SAMPLE, {}, "sample"),
    "spec-sample": (SPEC_SAMPLE, {}, "sample"),
    "spec-sample-dynamic": (SPEC_SAMPLE, {"gamma": "most", "draft_stop": "stop"}, "sample"),
    "topk-imp": (TOPK_IMP, {}, "sample"),
    "beam-sample": (BEAM_SAMPLE, {}, "beam-sample"),
    "dsbd": (DSBD, {}, "beam-sample"),
    "dsbd-dynamic": (DSBD, {"threshold": "t", "beams": 1}, "beam-sample"),
    "dsbd-one-cache": (DSBD, {"one_cache": True}, "beam-sample"),
    "sample-tree": (SAMPLE, {}, "sample"),
    "spec-sample-tree": (SPEC_SAMPLE, {}, "sample"),
}
#: Rows run only when asked for (``--method``): the head's rows drafted by the same head in float32,
#: side by side with its int8 products (:mod:`recspec.accel.int8`).
FLOAT32_HEAD: dict[str, tuple[str, dict[str, Any], str]] = {
    "spec-sample-fp32": (SPEC_SAMPLE, {}, "sample"),
    "dsbd-one-cache-fp32": (DSBD, {"one_cache": True}, "beam-sample"),
}
#: Labels run in the tree loop (:mod:`recspec.knowledge.sampled`: one uniform per text position;
#: ``spec-sample-tree`` verifies a text head's trees by the target's draw at every node).
TREE_LABELS = ("sample-tree", "spec-sample-tree")
#: ``spec-sample-dynamic``'s draft length: chains end once the draft's probability of them falls
#: below DRAFT_STOP, at MOST_DRAFTED tokens at most (the fastest setting measured on SmolLM2 with a
#: text head).
DRAFT_STOP, MOST_DRAFTED = 0.3, 6


def time_per_user(decoders: dict[str, Callable[[list], Decoded]], prompts: list[torch.Tensor],
                   repeats: int, warmup: bool = True) -> tuple[dict[str, list[float]], dict[str, list[Decoded]]]:
    """:func:`~recspec.turns.take_turns` user by user (one call per user): per decoder the
    total seconds of each run and the last run's outputs. A decoder named ``ceiling`` (the
    speculative ceiling of the lab's spec benchmark: the target as its own draft) counts only its
    verification phase, its drafting time left out."""
    def charge(name: str, decoded: Decoded, seconds: float) -> float:
        if name == "ceiling":
            return float(decoded.stats.verify_s.sum() + decoded.stats.overhead_s.sum())
        return seconds

    return take_turns(decoders, [[prompt] for prompt in prompts], repeats, warmup, charge)


def _options(base: TextOptions, overrides: dict[str, Any], named: dict[str, Any]) -> TextOptions:
    """``base`` with a row's ``overrides``, a value named in ``named`` (``t``: DSBD's threshold,
    ``stop`` and ``most``: the dynamic draft length's stop and its most tokens) taken from it."""
    return replace(base, **{key: named.get(value, value) if isinstance(value, str) else value
                            for key, value in overrides.items()})


def chain_costs(target, draft, prompt: torch.Tensor, gamma: int, repeats: int = 20) -> tuple[float, float, float]:
    """Median seconds of one call after the prompt's cache: the target over one token and over
    ``gamma + 1`` tokens (a chain's verifying call), and the draft over one token (a draft model,
    or a text head's step and draft distribution): the ``T``, the verifying call and the ``c T``
    of Theorem 3.8."""
    from transformers import DynamicCache

    seconds = []
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        out = target(input_ids=prompt[None, :-1], use_cache=True, **with_cache(target, cache),
                     output_hidden_states=True)
        layers = draft.fused_layers if isinstance(draft, TextHeadDraft) else ()
        features = layer_features(target, out.hidden_states, layers)  # [1, P - 1, input_width]: a text head's input
        for model, fed in ((target, 1), (target, gamma + 1), (draft, 1)):
            if isinstance(model, TextHeadDraft):
                seconds.append(_head_step_seconds(model, features, prompt, repeats))
                continue
            if model is not target:
                cache = DynamicCache(config=model.config)
                model(input_ids=prompt[None, :-1], use_cache=True, **with_cache(model, cache))
            tokens = prompt[-1:].repeat(fed)[None]

            def call() -> None:  # timed at once, in this iteration
                model(input_ids=tokens, **with_cache(model, cache), use_cache=True)
                drop_tail(cache, fed)  # back to the prompt (a view): the next call sees the same cache

            seconds.append(median_seconds(call, prompt.device, repeats, warmup=0))
    return seconds[0], seconds[1], seconds[2]


def _head_step_seconds(head: TextHeadDraft, features: torch.Tensor, prompt: torch.Tensor, repeats: int) -> float:
    """Median seconds of one drafting step of ``head`` after the prompt (``features``: the target's
    there, :func:`~recspec.models.text_head.layer_features`): one input (its own guess and a token)
    over its cache of the prompt's ``P - 2`` inputs, then the draft distribution."""
    features = head.read(features)
    length = features.shape[1] - 1
    visible = torch.ones(1, length, length, dtype=torch.bool).tril()
    _, keys, values = head.step(features[:, :-1], prompt[None, 1:-1], torch.arange(length)[None], visible)

    def step() -> None:
        guessed, _, _ = head.step(features[:, -1:], prompt[None, -1:], torch.tensor([[length]]),
                                  torch.ones(1, 1, length + 1, dtype=torch.bool), (keys, values))
        head.log_probs(guessed[:, -1])

    return median_seconds(step, features.device, repeats, warmup=0)


def _acceptance(method: str, stats: SpecStats | None, options: TextOptions, cost: float,
                verify_ratio: float) -> dict[str, Any]:
    """Acceptance figures of one method over all prompts, and the speed-up the theorems predict
    (``spec-sample``'s with its verifying call's measured cost, ``verify_ratio`` one-token calls)."""
    if stats is None:
        return {}
    total = {name: float(value.sum()) for name, value in vars(stats).items()}
    gamma = options.gamma
    row: dict[str, Any] = {"accept_share": total["accepted_steps"] / max(total["drafted_steps"], 1e-9),
                           "accepted_per_round": total["accepted_steps"] / max(total["rounds"], 1e-9),
                           "target_calls": total["target_calls"]}
    if method == DSBD:
        beta = total["beta_sum"] / max(total["verified_layers"], 1e-9)
        alpha = min(1.0 if options.threshold is None else options.threshold, beta)
        row.update(alpha=alpha, steps_per_round=total["steps"] / max(total["rounds"], 1e-9),
                   predicted_steps_per_round=expected_tokens_per_call(alpha, gamma),
                   predicted_speedup=expected_speedup(alpha, gamma, cost), mean_width=total["width_sum"] /
                   max(total["steps"], 1e-9))
    else:
        alpha = total["alpha_sum"] / max(total["tried"], 1e-9)
        row.update(alpha=alpha, tokens_per_target_call=total["tokens"] / max(total["target_calls"], 1e-9))
        if method == SPEC_SAMPLE and options.draft_stop is None:  # Theorem 3.8 takes a fixed gamma
            row["predicted_speedup"] = expected_speedup(alpha, gamma, cost, verify_ratio)
        if options.draft_stop is not None:
            row["drafted_per_round"] = total["drafted_steps"] / max(total["rounds"], 1e-9)
    return row


def text_call(label: str, method: str, options: TextOptions, model, draft, pad: int, eos: int,
              drafter: HeadDrafter | None) -> Callable[[list[torch.Tensor]], Generated]:
    """One row's decoder over a list of prompts: :func:`~recspec.decoding.text.generate`, or the
    tree loop for :data:`TREE_LABELS` (``drafter``: the head's, for ``spec-sample-tree``)."""
    if label in TREE_LABELS:
        trees = drafter if method == SPEC_SAMPLE else None
        return lambda prompts: generate_tree(model, prompts, options, eos, trees)
    return lambda prompts: generate(method, model, draft, prompts, options, pad, eos)


def _head_drafter(model, target: str, draft) -> HeadDrafter | None:
    """The cost-sized tree drafter of a text head draft (None for other drafts)."""
    return tree_drafter(model, resolve_model_dir(target), draft) if isinstance(draft, TextHeadDraft) else None


def _memory_worker(target: str, draft_spec: str | None, layers: str, prompt: list[int],
                   runs: list[tuple[str, str, TextOptions]], pad: int, eos: int) -> list[int]:
    """In a fresh process: peak bytes of generating from one prompt with each (label, method, options)."""
    from recspec.bench.memory import peak_memory, return_freed_memory

    return_freed_memory()
    torch.set_num_threads(1)
    model = load_causal_lm(target)
    draft, _, row_draft = row_drafts(model, target, draft_spec, layers, [label for label, _, _ in runs])
    drafter = _head_drafter(model, target, draft) if any(label in TREE_LABELS for label, _, _ in runs) else None
    ids = torch.tensor(prompt)
    peaks = []
    for label, method, options in runs:
        decode = text_call(label, method, options, model, row_draft[label], pad, eos, drafter)
        decode([ids])
        peaks.append(peak_memory(lambda: decode([ids])))  # noqa: B023 (called at once)
    return peaks


def _draft_probe(model, draft, ids: list[torch.Tensor], probe: TextOptions, pad: int, eos: int,
                 costs: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """Acceptance, cost ratio and predicted speed-up of ``draft`` (spec-sample on 3 prompts);
    ``costs``: its :func:`chain_costs` on ``ids[0]`` at ``probe.gamma`` where already measured."""
    seconds, verify_seconds, draft_seconds = costs or chain_costs(model, draft, ids[0], probe.gamma)
    stats = generate(SPEC_SAMPLE, model, draft, ids[:3], probe, pad, eos).stats
    alpha = float(stats.alpha_sum.sum() / stats.tried.sum())
    return {"alpha": alpha, "c": draft_seconds / seconds, "target_ms": 1e3 * seconds,
            "predicted_speedup": expected_speedup(alpha, probe.gamma, draft_seconds / seconds,
                                                  verify_seconds / seconds)}


def text_methods(chosen: Sequence[str] | None) -> dict[str, tuple[str, dict[str, Any], str]]:
    """The rows of :data:`TEXT_METHODS` to run: ``chosen`` (all for None) and each one's baseline."""
    if chosen is None:
        return dict(TEXT_METHODS)
    known = {**TEXT_METHODS, **FLOAT32_HEAD}
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise RecspecError(f"unknown sampling method {unknown[0]!r}; choose from {', '.join(known)}")
    wanted = set(chosen) | {known[label][2] for label in chosen}
    return {label: row for label, row in known.items() if label in wanted}


def decode_ms_per_token(runs_s: Sequence[float], tokens: int, short_runs_s: Sequence[float],
                        short_tokens: int) -> float | None:
    """ms per generated token past a request's fixed part: the medians of whole runs (``tokens``
    generated) and of the same runs cut short (``short_tokens``) as ``T = F + n d`` (None where the
    cut runs are not shorter in tokens and time). Whole-request ratios move with the texts'
    lengths, which differ between methods (the fixed part is spread over more tokens); this one
    does not."""
    extra_s = statistics.median(runs_s) - statistics.median(short_runs_s)
    return 1e3 * extra_s / (tokens - short_tokens) if tokens > short_tokens and extra_s > 0 else None


def teacher_forced_acceptance(model, head: TextHeadDraft, prompts: Sequence[torch.Tensor],
                              texts: Sequence[Sequence[int]]) -> float:
    """The head's mean acceptance ``sum_x min(p, q)`` one step ahead over ``texts`` (int token ids,
    each generated after its 1-D prompt in ``prompts``), teacher-forced: the target's features
    over prompt and text, the head reading them causally in one call. Deterministic, so a change in
    the head's precision shows at the fourth decimal, where sampled runs' alpha moves by 0.06."""
    accepted = []
    with torch.inference_mode():
        for prompt, text in zip(prompts, texts):
            tokens = torch.cat((prompt, torch.tensor(text, dtype=prompt.dtype)))[None].to(model.device)
            out = model(tokens, output_hidden_states=True)
            features = head.read(layer_features(model, out.hidden_states, head.fused_layers))
            count = tokens.shape[1] - 1
            visible = torch.ones(count, count, dtype=torch.bool, device=tokens.device).tril()[None]
            guessed = head.step(features[:, :-1], tokens[:, 1:], torch.arange(count, device=tokens.device)[None],
                                visible)[0][0]
            # guessed[i] drafts token i + 2, which the target's logits at i + 1 predict: the text's tokens
            drafted = slice(len(prompt) - 2, count - 1)
            log_p = torch.log_softmax(out.logits[0, len(prompt) - 1:count].float(), dim=-1)
            log_q = head.vocabulary_log_probs(guessed[drafted])
            accepted.append(acceptance(log_p, log_q, torch.ones(len(log_p), dtype=torch.bool, device=log_p.device)))
    return float(torch.cat(accepted).mean())


def row_drafts(model, target: str, draft_spec: str | None, layers: str, labels: Sequence[str],
               float32: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """The bench's draft (:func:`~recspec.models.layer_draft.text_draft_model`, a text head's
    products in int8 on the CPU), its float32 form (the draft itself unless it is an int8 head;
    that head bound in float32 where :data:`FLOAT32_HEAD`'s rows or ``float32`` ask for it, else
    None) and each of ``labels``' draft: the float32 form for :data:`FLOAT32_HEAD`'s rows."""
    model_dir = resolve_model_dir(target)
    draft = text_draft_model(model, draft_spec, layers, model_dir)
    wanted = float32 or bool(set(labels) & set(FLOAT32_HEAD))
    fp32 = draft if not getattr(draft, "int8", False) else \
        text_draft_model(model, draft_spec, layers, model_dir, int8=False) if wanted else None
    return draft, fp32, {label: fp32 if label in FLOAT32_HEAD else draft for label in labels}


def bench_text(target: str, draft_layers: str, candidate_layers: Sequence[str], prompts: int, base: TextOptions,
               threshold: float, repeats: int, draft_spec: str | None = None,
               methods: Sequence[str] | None = None, draft_stop: float = DRAFT_STOP,
               most: int = MOST_DRAFTED) -> dict[str, Any]:
    """The text half of the benchmark (see the module doc): ``methods`` (labels of
    :data:`TEXT_METHODS`, None for all) with their baselines; ``spec-sample-dynamic`` drafts up to
    ``most`` tokens a round with the stop ``draft_stop``."""
    table = text_methods(methods)
    from recspec.data import load_dataset
    from recspec.knowledge.prompts import chat_prompts, random_prompt_texts

    tokenizer = load_tokenizer(target)
    model = load_causal_lm(target)
    messages = random_prompt_texts(load_dataset("ml-100k"), "user", prompts)
    ids = chat_prompts(tokenizer, messages)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    probe = replace(base, max_new_tokens=min(base.max_new_tokens, 32))
    drafts = [{"layers": layers, **_draft_probe(model, text_draft_model(model, None, layers), ids, probe, pad, eos)}
              for layers in candidate_layers]
    draft, fp32, row_draft = row_drafts(model, target, draft_spec, draft_layers, list(table), "sample" in table)
    costs = chain_costs(model, draft, ids[0], base.gamma)  # probe.gamma is base.gamma
    if draft_spec is not None:
        drafts.append({"layers": f"distilled: {draft_spec}", **_draft_probe(model, draft, ids, probe, pad, eos, costs)})
    target_s, verify_s, draft_s = costs
    cost, verify_ratio = draft_s / target_s, verify_s / target_s
    if methods is None and not isinstance(draft, TextHeadDraft):
        del table["spec-sample-tree"]  # drafts with a text head only
    named = {"t": threshold, "stop": draft_stop, "most": most}
    runs = {label: (method, _options(base, overrides, named)) for label, (method, overrides, _) in table.items()}
    if "spec-sample-tree" in runs and not isinstance(draft, TextHeadDraft):
        raise RecspecError("spec-sample-tree drafts with a text head: pass --draft HEAD")
    drafter = _head_drafter(model, target, draft) if "spec-sample-tree" in runs else None
    calls = {label: text_call(label, method, options, model, row_draft[label], pad, eos, drafter)
             for label, (method, options) in runs.items()}
    times, outputs = time_per_user(calls, ids, repeats)
    # each row's fixed part of a request (the prefills, setup), timed on the same calls cut at gamma + 1 tokens
    short_runs = {label: (method, replace(options, max_new_tokens=base.gamma + 1))
                  for label, (method, options) in runs.items()}
    short_times, short_outputs = time_per_user(
        {label: text_call(label, method, options, model, row_draft[label], pad, eos, drafter)
         for label, (method, options) in short_runs.items()}, ids, repeats, warmup=False)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        peaks = dict(zip(runs, pool.apply(_memory_worker, (target, draft_spec, draft_layers, ids[0].tolist(),
                                                           [(label, *run) for label, run in runs.items()], pad,
                                                           eos))))
    rows = []
    for label, (method, _, baseline) in table.items():
        texts = [tokens for result in outputs[label] for tokens in result.tokens]
        generated = sum(len(tokens) for tokens in texts)
        per_token = statistics.median(times[label]) / generated
        stats = [result.stats for result in outputs[label] if result.stats is not None]
        quality = log_likelihood(model, ids, texts, pad)
        head_int8 = {"head_int8": row_draft[label].int8} if isinstance(row_draft[label], TextHeadDraft) else {}
        rows.append({"method": label, "runs_s": times[label], "tokens": generated, "ms_per_token": 1e3 * per_token,
                     "baseline": baseline, **head_int8, "quality": float(quality.nanmean()),
                     "peak_mib": peaks[label] / 2**20,
                     **_acceptance(method, type(stats[0]).cat(stats) if stats else None, runs[label][1], cost,
                                     verify_ratio)})
        if label in TREE_LABELS:
            rows[-1]["tokens_per_target_call"] = generated / sum(result.calls or 0 for result in outputs[label])
        rows[-1]["decode_ms_per_token"] = decode_ms_per_token(
            times[label], generated, short_times[label],
            sum(len(tokens) for result in short_outputs[label] for tokens in result.tokens))
    by_label = {row["method"]: row for row in rows}
    for row in rows:
        row["speed_ratio"] = by_label[row["baseline"]]["ms_per_token"] / row["ms_per_token"]
        base_decode = by_label[row["baseline"]]["decode_ms_per_token"]
        row["decode_speed_ratio"] = base_decode / row["decode_ms_per_token"] \
            if base_decode is not None and row["decode_ms_per_token"] is not None else None
    precision = {}
    if isinstance(draft, TextHeadDraft) and "sample" in outputs:  # on `sample`'s texts, the head in both precisions
        texts = [tokens for result in outputs["sample"] for tokens in result.tokens]
        precision = {"float32": teacher_forced_acceptance(model, fp32, ids, texts)}
        if draft.int8:
            precision["int8"] = teacher_forced_acceptance(model, draft, ids, texts)
    return {"head_acceptance": precision, "prompts": messages, "draft": draft_spec or f"layers {draft_layers}",
            "c": cost, "target_ms": 1e3 * target_s, "verify_ratio": verify_ratio, "drafts": drafts, "rows": rows,
            "tree_round_cost": None if drafter is None or drafter.cost is None else drafter.cost.to_json()}


def _recall(recommender: Recommender, name: str, k: int, options: DecodeOptions, users: int) -> dict[str, float]:
    examples = recommender.examples("test", users)
    decoded = run_decoder(name, recommender.model, recommender.draft, recommender.encoder.prompts(examples),
                          recommender.trie, k, recommender.encoder.pad_id, options, batch_size=64)
    items = decoded.topk.items.cpu().numpy()
    table = item_rows(recommender.dataset.item_ids, recommender.index.item_keys)
    return recall_ndcg(np.where(items >= 0, table[items.clip(0)], -1),
                       [examples.targets(i) for i in range(len(examples))], [k])


def bench_recommend(target: Path, draft: Path, ks: Sequence[int], users: int, quality_users: int, repeats: int,
                    temperature: float, threshold: float) -> list[dict[str, Any]]:
    """The recommendation half of the benchmark (see the module doc)."""
    recommender = Recommender.load(target, draft_dir=draft)
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    rows = []
    for k in ks:
        settings = {"beam-sample": (ITEM_BEAM_SAMPLE, DecodeOptions(temperature=temperature, replacement=True)),
                    "spec-relaxed": (SPEC_RELAXED, DecodeOptions(temperature=temperature, replacement=True)),
                    "dsbd": (ITEM_DSBD, DecodeOptions(temperature=temperature)),
                    "dsbd-dynamic": (ITEM_DSBD, DecodeOptions(temperature=temperature, threshold=threshold,
                                                              min_width=1)),
                    "dsbd-one-cache": (ITEM_DSBD, DecodeOptions(temperature=temperature, one_cache=True))}
        calls = {label: (lambda batch, n=name, o=opts: run_decoder(n, recommender.model, recommender.draft, batch,
                                                                   recommender.trie, k, recommender.encoder.pad_id, o))
                 for label, (name, opts) in settings.items()}
        times, outputs = time_per_user(calls, prompts, repeats)
        base = statistics.median(times["beam-sample"])
        for label, (name, opts) in settings.items():
            stats = [decoded.stats for decoded in outputs[label] if decoded.stats is not None]
            row = {"k": k, "decoder": label, "runs_s": times[label],
                   "latency_ms": 1e3 * statistics.median(times[label]) / len(prompts),
                   "ws": base / statistics.median(times[label]), **_recall(recommender, name, k, opts, quality_users)}
            if stats:
                summary = type(stats[0]).cat(stats).summary()
                row.update(accepted_steps=summary["accepted_steps"], target_calls=summary["target_calls"],
                           accept_share=summary["accepted_steps"] / max(summary["drafted_steps"], 1e-9))
            rows.append(row)
    return rows


def run_sampling(out: Path, target: str = "smollm2", draft_layers: str = "0-5,29", draft_spec: str | None = None,
                 candidate_layers: Sequence[str] = ("0-1,29", "0-3,29", "0-5,29", "0-9,29", "0-5,28-29"),
                 prompts: int = 6, max_new_tokens: int = 48, repeats: int = 3, gamma: int = 4, beams: int = 2,
                 draft_width: int = 4, threshold: float = 0.7, temperature: float = 1.0, candidates: int = 10,
                 rec_target: Path | None = None, rec_draft: Path | None = None, ks: Sequence[int] = (10,),
                 users: int = 32, quality_users: int = 500, text: bool = True, name: str = "sampling",
                 methods: Sequence[str] | None = None, draft_stop: float = DRAFT_STOP, most: int = MOST_DRAFTED) -> str:
    """Run the benchmark; write ``{name}.json`` / ``{name}.md``; return the Markdown."""
    reuse_freed_memory()
    base = TextOptions(max_new_tokens=max_new_tokens, warp=Warp(temperature), gamma=gamma, candidates=candidates,
                       beams=beams, draft_width=draft_width)
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": repeats, "gamma": gamma,
                               "beams": beams, "draft_width": draft_width, "threshold": threshold,
                               "draft_stop": draft_stop, "most_drafted": most,
                               "temperature": temperature, "max_new_tokens": max_new_tokens}
    parts = ["# Sampling decoders: speculative sampling, TopK-ImpSpecDec, DSBD"]
    if text:
        results["text"] = bench_text(target, draft_layers, candidate_layers, prompts, base, threshold, repeats,
                                     draft_spec, methods, draft_stop, most)
        t = results["text"]
        parts += [
            f"## Text: {len(t['prompts'])} MovieLens user-profile prompts, {target}, up to {max_new_tokens} new tokens",
            f"Batch 1, median of {repeats} runs (methods alternate run by run), T = {temperature}, gamma = {gamma}, "
            f"W = {beams}, W_S = {draft_width}, dynamic width t = {threshold} with W_min = 1, TopK K = {candidates}; "
            f"spec-sample-dynamic: up to {most} tokens a round, a chain ending below draft probability "
            f"{draft_stop}. "
            f"Draft: {t['draft']} (c = {t['c']:.3f}; a target call "
            f"{t['target_ms']:.1f} ms; its call over gamma + 1 tokens {t['verify_ratio']:.2f} of it, which "
            f"spec-sample's predicted speed-up divides by instead of Theorem 3.8's 1; DSBD's prediction keeps 1)."
            + ("" if t["tree_round_cost"] is None else
               f" spec-sample-tree's rounds are sized by the cost model F = {1e3 * t['tree_round_cost']['fixed_s']:.1f}"
               f" ms (the head's drafting included) + r = {1e3 * t['tree_round_cost']['per_token_s']:.2f} ms per "
               f"verified token."),
            *(["The head's acceptance one step ahead, teacher-forced on `sample`'s texts: "
               + ", ".join(f"{value:.4f} in {name}" for name, value in t["head_acceptance"].items()) + "."]
              if t.get("head_acceptance") else []),
            "### Draft choice (spec-sample on 3 prompts, 32 tokens)",
            markdown_table(["draft (target layers)", "alpha", "c", "predicted speed-up (Thm 3.8)"],
                           [[d["layers"], d["alpha"], d["c"], f"{d['predicted_speedup']:.2f}x"] for d in t["drafts"]]),
            "### Methods",
            markdown_table(
                ["method", "tokens", "ms/token", "vs", "speed ratio", "decode ms/token", "decode ratio", "predicted",
                 "alpha", "accepted share", "accepted/round", "tokens/call", "steps/round (pred.)", "log-lik/token",
                 "peak MiB"],
                [[r["method"], r["tokens"], r["ms_per_token"], r["baseline"], f"{r['speed_ratio']:.2f}x",
                  r["decode_ms_per_token"] or "",
                  f"{r['decode_speed_ratio']:.2f}x" if r["decode_speed_ratio"] is not None else "",
                  f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "", r.get("alpha", ""),
                  r.get("accept_share", ""), r.get("accepted_per_round", ""), r.get("tokens_per_target_call", ""),
                  f"{r['steps_per_round']:.2f} ({r['predicted_steps_per_round']:.2f})" if "steps_per_round" in r
                  else "", r["quality"], f"{r['peak_mib']:.1f}"] for r in t["rows"]]),
        ]
    if rec_target is not None and rec_draft is not None:
        results["recommend"] = bench_recommend(rec_target, rec_draft, ks, users, quality_users, repeats, temperature,
                                               threshold)
        parts += [
            f"## Recommendation: {rec_target} with draft {rec_draft}",
            f"Batch 1, {users} test users, median of {repeats} runs; quality on {quality_users} test users; "
            f"T = {temperature}; WS = speed-up over beam-sample with independent draws.",
            markdown_table(["K", "decoder", "ms/user", "WS", "accepted steps", "accepted share", "target calls",
                            "recall", "ndcg"],
                           [[r["k"], r["decoder"], r["latency_ms"], f"{r['ws']:.2f}x", r.get("accepted_steps", ""),
                             r.get("accept_share", ""), r.get("target_calls", ""), r[f"recall@{r['k']}"],
                             r[f"ndcg@{r['k']}"]] for r in results["recommend"]]),
        ]
    markdown = "\n\n".join(parts)
    write_results(out, name, results, markdown)
    return markdown
