"""Time the three top-K decoders (hf_beam_search, beam_search, tree_beam_search) on a random target.

The target is a randomly initialised LlamaForCausalLM of about 25M parameters (8 layers, hidden
512, 8 heads, intermediate 1376) over a vocabulary of 4 control tokens + 4 levels x 224
identifier tokens (900); the items are random distinct identifiers of length L = 4; each prompt is
the identifiers of 20 random items (80 tokens). For every batch size B and beam width K the
script runs each decoder once to warm up, then --repeats times, and prints the median wall time
per call, the speed-up of each recspec decoder over hf, and whether all three returned the same
items (in order).

    python scripts/time_beam.py                      # K in 1 5 10 20, B in 1 16, median of 5
    python scripts/time_beam.py --ks 10 --batches 16 --repeats 3
    python scripts/time_beam.py --malloc system     # glibc's default large-allocation policy

Memory: every decoder allocates large short-lived tensors per step (HF and beam_search copy a
``B * K``-row KV cache at every step). glibc serves allocations above its mmap threshold (at most
32 MiB) with fresh ``mmap``s and unmaps them on free, so each step page-faults its cache copies
in again; on some virtual machines that costs seconds per call and makes timings erratic. By
default (``--malloc reuse``) the script raises the mmap and trim thresholds with ``mallopt`` so
freed memory is reused, as an allocator like jemalloc or tcmalloc would do; it applies to all three
decoders alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recspec.bench.report import reuse_freed_memory
from recspec.decoding import beam_search, hf_beam_search, tree_beam_search
from recspec.itemids.trie import ItemTrie

CONTROL_TOKENS, LEVELS, CODES_PER_LEVEL = 4, 4, 224
PAD = 0
DECODERS = {"hf": hf_beam_search, "beam": beam_search, "tree-beam": tree_beam_search}


def build_target(attn: str, seed: int) -> LlamaForCausalLM:
    """The random ~25M-parameter Llama target, in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=CONTROL_TOKENS + LEVELS * CODES_PER_LEVEL,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        initializer_range=0.05,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


def build_items(num_items: int, seed: int) -> torch.Tensor:
    """``num_items`` distinct random identifiers as model tokens, int64 ``[num_items, L]``; level
    ``l`` uses tokens ``4 + 224 l .. 4 + 224 (l + 1) - 1``."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, CODES_PER_LEVEL, (2 * num_items, LEVELS), generator=generator)
    codes = torch.unique(codes, dim=0)
    codes = codes[torch.randperm(len(codes), generator=generator)[:num_items]]
    return CONTROL_TOKENS + CODES_PER_LEVEL * torch.arange(LEVELS) + codes


def build_prompts(items: torch.Tensor, batch: int, history: int, seed: int) -> list[torch.Tensor]:
    """``batch`` prompts, each the concatenated identifiers of ``history`` random items."""
    generator = torch.Generator().manual_seed(seed)
    return [items[torch.randint(0, len(items), (history,), generator=generator)].reshape(-1)
            for _ in range(batch)]


def median_seconds(run, repeats: int) -> tuple[float, object]:
    """Median wall time of ``run()`` over ``repeats`` calls after one warm-up, and its result."""
    result = run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10, 20])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--items", type=int, default=12000)
    parser.add_argument("--history", type=int, default=20, help="items per prompt (4 tokens each)")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--decoders", nargs="+", choices=list(DECODERS), default=list(DECODERS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc", choices=["reuse", "system"], default="reuse",
                        help="reuse: keep freed memory (mallopt, glibc); system: glibc defaults")
    args = parser.parse_args()
    if args.malloc == "reuse":
        reuse_freed_memory()

    model = build_target(args.attn, args.seed).to(args.device)
    items = build_items(args.items, args.seed)
    trie = ItemTrie(items, model.config.vocab_size).to(args.device)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"target: Llama {params:.1f}M params, {args.attn}, {args.device}, "
          f"{torch.get_num_threads()} threads, malloc {args.malloc}; "
          f"{len(items)} items, L={LEVELS}; "
          f"prompts of {args.history * LEVELS} tokens; median of {args.repeats} after warm-up")
    header = f"{'B':>3} {'K':>3} " + " ".join(f"{name + ' s':>12}" for name in args.decoders)
    speedups = [name for name in args.decoders if name != "hf" and "hf" in args.decoders]
    header += "".join(f" {'hf/' + name:>13}" for name in speedups) + "  same items"
    print(header)
    for batch in args.batches:
        prompts = build_prompts(items, batch, args.history, args.seed + batch)
        for k in args.ks:
            seconds, results = {}, {}
            for name in args.decoders:
                decoder = DECODERS[name]
                seconds[name], results[name] = median_seconds(
                    lambda: decoder(model, prompts, trie, k, PAD), args.repeats)
            same = all(torch.equal(r.items, next(iter(results.values())).items)
                       for r in results.values())
            row = f"{batch:>3} {k:>3} " + " ".join(f"{seconds[n]:>12.4f}" for n in args.decoders)
            row += "".join(f" {seconds['hf'] / seconds[n]:>12.2f}x" for n in speedups)
            print(row + f"  {same}", flush=True)


if __name__ == "__main__":
    main()
