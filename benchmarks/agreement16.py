"""How exact recspec's decoders are in 16-bit: each against transformers' in the same dtype.

In float32 recspec's exact decoders return what transformers' constrained ``generate`` returns
(within 1e-6). In bfloat16 or float16 they cannot be bit-identical: a tree call and transformers'
sequential calls sum in other orders, and each rounds its logits to the dtype's grid. This script
measures what remains, on a trained target and draft (``make demo``'s by default):

* **items**: for ``tree-beam``, ``beam``, ``spec-strict`` and ``auto`` (its choice made in memory,
  nothing written beside the models), the fraction of users whose top-K equals the ``hf`` decoder's
  (transformers' constrained beam search) item for item; the largest gap between two computations
  of the same item's score; and whether every user that differs is a near-tie: its beam search's
  margin (:attr:`~recspec.decoding.TopK.margin`, the smallest gap between a kept and a dropped
  candidate at any step) is within the dtype's rounding (:func:`~recspec.precision.tie_bound` at
  the largest identifier logit the target computed for the reference's items). ``spec-strict``
  against ``tree-beam`` is reported too (the claim ``tests/test_dtype.py`` checks).
* **text**: recspec's greedy text loop (the knowledge job's ``ar``; with ``--pool``, also greedy
  retrieval drafting from a knowledge store, LASER's drafts), one prompt at a time and in
  batches, against transformers' greedy ``generate`` one prompt at a time, on SmolLM2 from the
  asset cache: the fraction of prompts with the same tokens, and at each first divergence the gap
  between the two tokens' logits there (teacher-forced on the common prefix), against
  :func:`text_tolerance`.

Run: ``python -m benchmarks.agreement16 --users 200`` (JSON and Markdown under
benchmarks/results/). Not a timing: it may share the machine.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from recspec.auto import choose
from recspec.bench.report import markdown_table, write_results
from recspec.data import Examples
from recspec.decoding import TopK
from recspec.decoding.prompts import left_pad
from recspec.models.tokenizer import identifier_token_ids
from recspec.precision import DTYPES, tie_bound, ulp
from recspec.recommend import AUTO, BEAM, HF, SPEC_STRICT, TREE_BEAM, Recommender

#: The decoders compared with ``hf`` (``auto`` runs the decoder it chooses).
ITEM_DECODERS = (TREE_BEAM, BEAM, SPEC_STRICT, AUTO)
DEMO = Path("runs/demo")


def text_tolerance(dtype: torch.dtype, magnitude: float) -> float:
    """The near-tie bound of a greedy step: two rounding units (:func:`~recspec.precision.ulp`) of
    the logits at ``magnitude`` (the two tokens' logits each rounded once)."""
    return 2 * ulp(dtype, magnitude)


def identifier_logit_magnitude(recommender: Recommender, prompts: list[torch.Tensor], topk: TopK,
                               batch_size: int = 32) -> float:
    """The largest |logit| of the target over the identifier tokens at every step that scores
    one of the ``topk`` items after its prompt (teacher-forced, in the model's dtype)."""
    model, levels = recommender.model, topk.tokens.shape[2]
    columns = torch.tensor(sorted(identifier_token_ids(recommender.tokenizer, recommender.index).values()))
    largest = 0.0
    rows = [torch.cat((prompt.long(), path)) for prompt, paths in zip(prompts, topk.tokens.cpu()) for path in paths]
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = left_pad(rows[start:start + batch_size], recommender.encoder.pad_id, model.device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids).logits[:, -levels - 1:-1]
            largest = max(largest, float(logits[..., columns.to(logits.device)].float().abs().max()))
    return largest


def on_cpu(topk: TopK) -> TopK:
    """``topk`` with its tensors on the CPU (answers of another device compared with the CPU's)."""
    return TopK(topk.items.cpu(), topk.scores.cpu(), topk.tokens.cpu(),
                None if topk.margin is None else topk.margin.cpu())


@dataclass
class Agreement:
    """One decoder against a reference over the same users (module doc)."""

    dtype: str
    k: int
    decoder: str
    reference: str
    users: int
    identical: float  # fraction of users with the same items in the same order
    same_set: float  # fraction with the same items in any order
    overlap: float  # mean fraction of the K items both return
    largest_gap: float  # largest |score difference| of one item in both answers
    tolerance: float  # near-tie bound (recspec.precision.tie_bound)
    decided: float  # fraction of users whose margin exceeds the tolerance
    decided_identical: float  # among those, the fraction identical
    differing_margin: float  # the largest margin among users that differ (0.0: none differ)
    differing_ulps: float  # the same in rounding units of the dtype at the logits' magnitude
    all_near_ties: bool  # every differing user has margin <= tolerance


def compare(dtype: str, k: int, decoder: str, reference: str, ours: TopK, ref: TopK, bound: float,
            unit: float) -> Agreement:
    """:class:`Agreement` of ``ours`` against ``ref`` (``unit``: the dtype's rounding unit at the
    logits' magnitude); margins: ``ours``'s, and ``ref``'s too where it tracks one (the smaller
    counts)."""
    ours, ref = on_cpu(ours), on_cpu(ref)
    margin = ours.margin if ref.margin is None else torch.minimum(ours.margin, ref.margin)
    same = (ours.items == ref.items).all(1)
    same_set = (ours.items.sort(1).values == ref.items.sort(1).values).all(1)
    common = ours.items[:, :, None] == ref.items[:, None, :]  # [B, K, K]: ours j is ref's i
    gaps = (ours.scores[:, :, None] - ref.scores[:, None, :]).abs()
    gap = float(gaps[common].max()) if bool(common.any()) else 0.0
    decided = margin > bound
    differ = margin[~same]
    return Agreement(dtype, k, decoder, reference, len(same), float(same.float().mean()),
                     float(same_set.float().mean()), float(common.any(2).float().mean()), gap, bound,
                     float(decided.float().mean()),
                     float(same[decided].float().mean()) if bool(decided.any()) else 1.0,
                     float(differ.max()) if len(differ) else 0.0, float(differ.max()) / unit if len(differ) else 0.0,
                     bool((differ <= bound).all()))


def item_agreement(target: Path, draft: Path, dtype: str, users: int, ks: list[int], batch_size: int,
                   device: str = "cpu") -> tuple[list[Agreement], float]:
    """Every decoder of :data:`ITEM_DECODERS` against ``hf`` and ``spec-strict`` against
    ``tree-beam`` at each K of ``ks``, the models in ``dtype``; and the largest logits' magnitude
    the tolerances are taken at."""
    recommender = Recommender.load(target, device=device, draft_dir=f"model:{draft}", dtype=dtype)
    examples = recommender.examples("test", users)
    rows, largest = [], 0.0
    for k in ks:
        found, magnitude = k_agreement(recommender, examples, dtype, k, batch_size)
        rows, largest = rows + found, max(largest, magnitude)
    return rows, largest


def k_agreement(recommender: Recommender, examples: Examples, dtype: str, k: int, batch_size: int
                ) -> tuple[list[Agreement], float]:
    """:func:`item_agreement` at one K."""
    results = {name: recommender.recommend(examples, k, name, batch_size).topk for name in (HF, *ITEM_DECODERS)
               if name != AUTO}
    choice = choose(recommender, k, batch_size, records={})  # in memory: nothing written beside the models
    results[AUTO] = recommender.recommend(examples, k, choice.decoder, batch_size, choice.options).topk
    magnitude = identifier_logit_magnitude(recommender, recommender.encoder.prompts(examples), results[HF])
    bound, unit = tie_bound(DTYPES[dtype], magnitude, recommender.trie.depth), ulp(DTYPES[dtype], magnitude)
    rows = [compare(dtype, k, name, HF, results[name], results[HF], bound, unit) for name in ITEM_DECODERS]
    rows.append(compare(dtype, k, SPEC_STRICT, TREE_BEAM, results[SPEC_STRICT], results[TREE_BEAM], bound, unit))
    return rows, magnitude


@dataclass
class TextAgreement:
    """recspec's greedy text (``ar``, at ``batch`` prompts per call) against transformers' greedy
    ``generate`` one prompt at a time."""

    dtype: str
    decoder: str
    prompts: int
    identical: float  # fraction of prompts with the same tokens
    tolerance: float  # near-tie bound at the largest divergence logit (:func:`text_tolerance`)
    differing_gap: float  # the largest logit gap between the two tokens at a first divergence
    differing_ulps: float  # the largest such gap in rounding units of the dtype at its logits
    all_near_ties: bool


def divergence_gap(model, prompt: list[int], ours: list[int], ref: list[int]) -> tuple[float, float]:
    """At the first position where ``ours`` and ``ref`` differ after ``prompt``: the gap between
    the two tokens' logits and the larger |logit|, teacher-forced on the common prefix (one call
    in the model's dtype)."""
    at = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ref[:at]], device=model.device)).logits[0, -1].float()
    return float((logits[ours[at]] - logits[ref[at]]).abs()), float(logits[[ours[at], ref[at]]].abs().max())


def text_agreement(dtype: str, prompts: int, max_new_tokens: int, batch: int, device: str = "cpu",
                   model_name: str = "smollm2", pool: Path | None = None) -> list[TextAgreement]:
    """recspec's greedy loop, one prompt at a time and ``batch`` at a time, against transformers'
    greedy ``generate`` on ``prompts`` knowledge prompts of MovieLens users, ``model_name`` in
    ``dtype``; with ``pool`` (a knowledge store of greedy texts) also greedy retrieval drafting
    from it (LASER's drafts over one pool, greedy verification: the greedy text by construction in
    float32)."""
    from recspec.data import load_dataset
    from recspec.decoding.text_rounds import generate_texts
    from recspec.hub import load_tokenizer, resolve_model_dir
    from recspec.knowledge.decode import RetrievalDrafter, eos_ids, hf_generate
    from recspec.knowledge.prompts import chat_prompts, random_prompt_texts
    from recspec.knowledge.retrieval import RetrievalConfig
    from recspec.knowledge.store import read_rows
    from recspec.knowledge.trie import TokenTrie
    from recspec.models.hf import load_causal_lm

    folder = resolve_model_dir(model_name)
    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, device=device, dtype=DTYPES[dtype])
    eos = eos_ids(model, tokenizer)
    texts = [prompt.tolist() for prompt in chat_prompts(tokenizer, random_prompt_texts(load_dataset("ml-100k"),
                                                                                        "user", prompts))]
    reference = [hf_generate(model, [text], max_new_tokens, eos)[0].tokens for text in texts]
    drafters: dict[str, RetrievalDrafter | None] = {"ar": None}
    if pool is not None:
        trie = TokenTrie(RetrievalConfig().window)
        trie.add_all(row.tokens for row in read_rows(pool))
        drafters["laser-greedy"] = RetrievalDrafter(trie, RetrievalConfig())
    rows = []
    for (name, drafter), size in itertools.product(drafters.items(), (1, batch)):
        ours = [generation.tokens for start in range(0, len(texts), size)
                for generation in generate_texts(
                    model, texts[start:start + size], max_new_tokens, eos,
                    None if drafter is None else drafter.batch(texts[start:start + size]))]
        gaps = [divergence_gap(model, text, a, b) for text, a, b in zip(texts, ours, reference)
                if a != b and a[:min(len(a), len(b))] != b[:min(len(a), len(b))]]
        ended = sum(a != b for a, b in zip(ours, reference)) - len(gaps)  # one text a prefix of the other
        magnitude = max((m for _, m in gaps), default=0.0)
        bound = text_tolerance(DTYPES[dtype], magnitude) if gaps else 0.0
        widest = max((g for g, _ in gaps), default=0.0)
        units = max((g / ulp(DTYPES[dtype], m) for g, m in gaps), default=0.0)
        rows.append(TextAgreement(dtype, f"{name} (batch {size})", len(texts),
                                  sum(a == b for a, b in zip(ours, reference)) / len(texts), bound, widest, units,
                                  ended == 0 and all(g <= text_tolerance(DTYPES[dtype], m) for g, m in gaps)))
    return rows


def markdown(items: list[Agreement], magnitudes: dict[str, float], text: list[TextAgreement],
             settings: dict[str, Any]) -> str:
    """The tables of a run."""
    lines = [f"# Exactness in 16-bit: recspec's decoders against transformers' in the same dtype",
             f"{settings['users']} test users of {settings['target']} (draft {settings['draft']}), batch "
             f"{settings['batch_size']}, on the {settings['device']}. Tolerance (recspec.precision.tie_bound): two "
             f"rounding units of the dtype at the largest identifier logit per identifier level (largest |logit|: "
             + ", ".join(f"{name} {value:.2f}" for name, value in magnitudes.items()) + "). "
             "*Decided*: users whose beam-search margin exceeds it; *overlap*: mean share of the K items both return.",
             markdown_table(["dtype", "K", "decoder", "reference", "identical", "same set", "overlap",
                             "largest gap (same item)", "tolerance", "decided", "identical among decided",
                             "largest margin differing (rounding units)", "all differences near-ties"],
                            [[row.dtype, row.k, row.decoder, row.reference, f"{row.identical:.1%}",
                              f"{row.same_set:.1%}", f"{row.overlap:.1%}",
                              f"{row.largest_gap:.2g}", f"{row.tolerance:.2g}", f"{row.decided:.1%}",
                              f"{row.decided_identical:.1%}", f"{row.differing_margin:.2g} ({row.differing_ulps:.1f})",
                              "yes" if row.all_near_ties else "NO"] for row in items])]
    if text:
        lines += [f"Greedy text: {text[0].prompts} MovieLens user-profile prompts, {settings['max_new_tokens']} new "
                  f"tokens, {settings['text_model']}, against transformers' greedy generate one prompt at a time. "
                  "Tolerance: two rounding units at the larger logit of a first divergence.",
                  markdown_table(["dtype", "decoder", "identical", "largest logit gap at a divergence",
                                  "largest gap (rounding units)", "tolerance", "all differences near-ties"],
                                 [[row.dtype, row.decoder, f"{row.identical:.1%}", f"{row.differing_gap:.2g}",
                                   f"{row.differing_ulps:.1f}", f"{row.tolerance:.2g}",
                                   "yes" if row.all_near_ties else "NO"] for row in text])]
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEMO / "target")
    parser.add_argument("--draft", type=Path, default=DEMO / "draft")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to measure")
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--ks", default="1,10", help="comma-separated K values")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--text-prompts", type=int, default=24, help="0: no text part")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--text-batch", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pool", type=Path, help="A greedy knowledge store (user side): also greedy retrieval "
                                                  "drafting from it")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="agreement16")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    items: list[Agreement] = []
    magnitudes: dict[str, float] = {}
    text: list[TextAgreement] = []
    for dtype in dtypes:
        rows, magnitudes[dtype] = item_agreement(args.target, args.draft, dtype, args.users,
                                                 [int(k) for k in args.ks.split(",")], args.batch_size, args.device)
        items += rows
        if args.text_prompts:
            text += text_agreement(dtype, args.text_prompts, args.max_new_tokens, args.text_batch, args.device,
                                   pool=args.pool)
    settings = {"target": str(args.target), "draft": str(args.draft), "users": args.users, "ks": args.ks,
                "batch_size": args.batch_size, "device": args.device, "max_new_tokens": args.max_new_tokens,
                "text_model": "SmolLM2-135M-Instruct", "torch_threads": torch.get_num_threads()}
    report = markdown(items, magnitudes, text, settings)
    write_results(args.out, args.name, {**settings, "logit_magnitude": magnitudes,
                                        "items": [asdict(row) for row in items],
                                        "text": [asdict(row) for row in text]}, report)
    print(report)


if __name__ == "__main__":
    main()
