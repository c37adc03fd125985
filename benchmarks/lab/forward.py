"""`python -m benchmarks.lab forward`: decoders through transformers' forward and through recspec's lean one.

One model pair (:mod:`recspec.accel.lean_forward`: a small Llama's calls made by one function),
each decoder run both ways on the same test users, the two arms of every decoder taking turns
batch by batch with the others in a balanced order (:func:`~recspec.turns.take_turns`), the median
of ``repeats`` runs per batch size. Reported per decoder: ms per user both ways, the speed-up, and
whether the two arms returned the same items with the same scores bit for bit (the lean forward's
claim). The ceiling of the lever is the share of a call that is not its matrix products, which the
lean forward does not touch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recspec.bench.compare import ROOT_NAMES, split_root, unknown_decoders
from recspec.bench.report import markdown_table, reuse_freed_memory, write_results
from recspec.errors import RecspecError
from recspec.accel.lean_forward import drop_lean_forward, use_lean_forward
from recspec.recommend import DECODERS, DecodeOptions, Decoded, Recommender, check_decoder
from recspec.turns import take_turns, user_batches

#: The forwards compared: transformers' own and recspec's lean one.
ARMS = ("transformers", "lean")


def run(out: Path, target: Path, draft: Path | None, decoders: Sequence[str], k: int = 10,
        batch_sizes: Sequence[int] = (1, 16), users: int = 64, repeats: int = 5, name: str = "forward") -> str:
    """Time every decoder both ways at every batch size on the first ``users`` test users of
    ``target`` (with ``draft`` for speculative ones); write ``{name}.json`` / ``.md`` into ``out``
    and return the Markdown."""
    unknown = [d for d in decoders if d == "auto"] + unknown_decoders(decoders)
    if unknown or not decoders:
        raise RecspecError(f"--decoder: name one or more decoders of {', '.join(d for d in DECODERS if d != 'auto')} "
                           f"(or {ROOT_NAMES})"
                           + (f" (not: {', '.join(unknown)})" if unknown else ""))
    for decoder in decoders:
        check_decoder(split_root(decoder)[0], draft is not None)
    reuse_freed_memory()
    recommender = Recommender.load(target, draft_dir=draft)
    models = [model for model in (recommender.model, recommender.draft) if isinstance(model, torch.nn.Module)]
    if not use_lean_forward(recommender.model):
        raise RecspecError(f"{target}: the target is not a model the lean forward serves (a multi-head float32 "
                           f"Llama with SDPA attention and the default rotary embedding)")
    examples = recommender.examples("test", users)
    rows: list[dict[str, Any]] = []
    for batch_size in batch_sizes:
        def decode(part, decoder: str, arm: str) -> Decoded:
            for model in models:  # a dictionary entry set or removed: microseconds in a timed batch
                if arm == "lean":
                    use_lean_forward(model)
                else:
                    drop_lean_forward(model)
            plain, root = split_root(decoder)
            return recommender.recommend(part, k, plain, batch_size, DecodeOptions(expand_root=root))

        contenders = {f"{decoder} / {arm}": (lambda part, d=decoder, a=arm: decode(part, d, a))
                      for decoder in decoders for arm in ARMS}
        seconds, outputs = take_turns(contenders, user_batches(examples, batch_size), repeats)
        for decoder in decoders:
            ms = {arm: 1e3 * statistics.median(seconds[f"{decoder} / {arm}"]) / len(examples) for arm in ARMS}
            mine, theirs = (Decoded.joined(outputs[f"{decoder} / {arm}"]).topk for arm in ("lean", "transformers"))
            same = torch.equal(mine.items, theirs.items) and torch.equal(mine.scores, theirs.scores)
            rows.append({"decoder": decoder, "batch_size": batch_size, "transformers_ms": ms["transformers"],
                         "lean_ms": ms["lean"], "speedup": ms["transformers"] / ms["lean"], "same_bits": same,
                         "runs_s": {arm: seconds[f"{decoder} / {arm}"] for arm in ARMS}})
    for model in models:
        use_lean_forward(model)
    label = f"{recommender.dataset.name}: {Path(target).name}" + (f" + {Path(draft).name}" if draft else "")
    markdown = "\n\n".join([
        f"# transformers' forward and recspec's lean forward ({label})",
        f"{len(examples)} test users, K = {k}, median of {repeats} timed runs (every decoder's two arms take turns "
        f"batch by batch); same bits: the same items and scores, bit for bit. torch threads: "
        f"{torch.get_num_threads()}.",
        markdown_table(["decoder", "batch", "transformers ms/user", "lean ms/user", "speed-up", "same bits"],
                       [[row["decoder"], row["batch_size"], row["transformers_ms"], row["lean_ms"],
                         f"{row['speedup']:.2f}x", "yes" if row["same_bits"] else "NO"] for row in rows])])
    write_results(out, name, {"target": str(target), "draft": str(draft) if draft else None, "k": k, "users": len(examples),
                              "repeats": repeats, "rows": rows}, markdown)
    return markdown
