"""`python -m benchmarks.lab pack`: training throughput of one-example and packed batches, side by side.

Each *mode* is a pack size and a batch size (``10x16``: packs of up to 10 examples, 16 packs a
step). Every mode trains its own copy of the same fresh preset model with the trainer's optimizer
for ``steps`` optimizer steps per timed run, on the batches an epoch would give it (seeded); the
modes take turns (:func:`~recspec.turns.turn_order`) after a warm-up of two steps each,
and the median of ``repeats`` runs is reported as training examples per second, real tokens per
second and the ratio to the first mode. The ceiling of a mode is the ratio of tokens per example
(the speed-up if a packed token cost what a one-example token costs). Whether packed training
learns as well is a separate question, answered by training runs (`python -m benchmarks.lab curve`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from recspec.bench.report import markdown_table, reuse_freed_memory, write_results
from recspec.errors import RecspecError
from recspec.fit import training_data
from recspec.models.packing import next_item_task
from recspec.models.presets import build_model
from recspec.models.train import TrainConfig, build_optimizer, epoch_batches
from recspec.turns import turn_order


def parse_mode(mode: str) -> tuple[int, int]:
    """``"PACKxBATCH"`` -> (pack size, batch size)."""
    try:
        pack, batch = (int(part) for part in mode.lower().split("x"))
    except ValueError:
        raise RecspecError(f"--mode {mode!r}: write PACKxBATCH, e.g. 1x64 or 10x16") from None
    if pack < 1 or batch < 1:
        raise RecspecError(f"--mode {mode!r}: pack and batch sizes must be at least 1")
    return pack, batch


class Mode:
    """One mode's model, optimizer, task and batches."""

    def __init__(self, mode: str, preset: str, encoder, split, seed: int) -> None:
        self.name = mode
        self.pack, batch_size = parse_mode(mode)  # checked before the data were read
        self.config = TrainConfig(pack=self.pack, batch_size=batch_size, precision="fp32", seed=seed)
        self.task = next_item_task(encoder, split, self.config)
        self.model = build_model(preset, encoder.tokenizer, seed=seed).train()
        lengths = self.task.lengths()
        self.batches = epoch_batches(lengths, batch_size, self.config.bucket_batches, seed, 0)
        self.optimizer, _ = build_optimizer(self.model, self.config, len(self.batches))
        self.lengths, self.next = lengths, 0
        self.examples = len(self.task.examples)
        self.tokens_per_example = float(lengths.sum()) / self.examples
        self.runs: list[dict[str, float]] = []

    def train(self, steps: int) -> dict[str, float]:
        """``steps`` optimizer steps on the next batches: seconds, examples and real tokens."""
        examples = tokens = 0
        start = time.perf_counter()
        for _ in range(steps):
            rows = self.batches[self.next % len(self.batches)]
            self.next += 1
            loss = self.task.loss(self.model, self.task.batch(rows), None)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            examples += self.task.examples_in(rows)
            tokens += int(self.lengths[rows].sum())
        return {"seconds": time.perf_counter() - start, "examples": examples, "tokens": tokens}


def run(out: Path, dataset: str, preset: str, ids: Path | None, split: str | None, max_history: int,
        modes: Sequence[str], steps: int, repeats: int, threads: int, seed: int, name: str) -> str:
    """Time ``modes`` side by side; write ``name.{json,md}`` into ``out`` and return the Markdown."""
    if len(set(modes)) != len(modes) or not modes:
        raise RecspecError("--mode: give each mode once")
    for mode in modes:
        parse_mode(mode)
    torch.set_num_threads(threads)
    reuse_freed_memory()
    data, parts, encoder = training_data(dataset, preset, ids, None, split, max_history)
    timed = {mode: Mode(mode, preset, encoder, parts, seed) for mode in modes}
    for mode in timed.values():
        mode.train(2)  # warm-up: allocator, kernels
    for repeat in range(repeats):
        for mode in turn_order(list(timed), repeat):
            timed[mode].runs.append(timed[mode].train(steps))
    rows, first = [], timed[modes[0]]
    base = statistics.median(timing["examples"] / timing["seconds"] for timing in first.runs)
    for mode in timed.values():
        per_s = [timing["examples"] / timing["seconds"] for timing in mode.runs]
        tokens_s = [timing["tokens"] / timing["seconds"] for timing in mode.runs]
        examples_s = statistics.median(per_s)
        rows.append({"mode": mode.name, "pack": mode.pack, "batch_size": mode.config.batch_size,
                     "sequences": len(mode.lengths), "tokens_per_example": mode.tokens_per_example,
                     "examples_per_s": examples_s, "tokens_per_s": statistics.median(tokens_s),
                     "speedup": examples_s / base, "ceiling": first.tokens_per_example / mode.tokens_per_example,
                     "epoch_minutes": mode.examples / examples_s / 60, "runs_examples_per_s": per_s})
    results = {"dataset": data.name, "preset": preset, "steps": steps, "repeats": repeats, "threads": threads,
               "examples": int(np.mean([m.examples for m in timed.values()])), "modes": rows}
    table = markdown_table(
        ["mode (pack x batch)", "sequences / epoch", "tokens / example", "examples/s", "tokens/s", "speed-up",
         "ceiling (token ratio)", "epoch (min)"],
        [[r["mode"], r["sequences"], f"{r['tokens_per_example']:.1f}", f"{r['examples_per_s']:.3g}",
          f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x", f"{r['ceiling']:.2f}x", f"{r['epoch_minutes']:.1f}"]
         for r in rows])
    markdown = (f"# Packed training: {preset} on {data.name}\n\n{steps} optimizer steps per timed run, median of "
                f"{repeats} runs, modes taking turns, {threads} threads, fp32. Speed-up: training examples per "
                f"second against the first mode; ceiling: its tokens per example over this mode's.\n\n{table}\n")
    write_results(out, name, results, markdown)
    return markdown
