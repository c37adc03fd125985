"""`python -m benchmarks.lab ids`: time to build MovieLens identifiers (embedding and quantisation apart),
collision rates, and trie mask throughput for a batch of 1,000 prefixes.

Ceilings: embedding is set against the machine's measured float32 matmul throughput (the model's
forward FLOPs divided by GFLOP/s); the trie masks against writing a mask of the same size with
``torch.full`` (pure memory write, no trie work).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from recspec.bench.report import markdown_table, matmul_gflops, timed, write_results
from recspec.data import load_dataset
from recspec.itemids.build import default_codebook_sizes, load_released, resolve
from recspec.itemids.embed import embed_texts
from recspec.itemids.index import ItemIndex
from recspec.itemids.quantize import rq_kmeans, rq_vae
from recspec.itemids.trie import ItemTrie
from recspec.hub import resolve_model_dir


def _forward_gflop(model_dir: Path, texts: list[str], max_length: int = 64) -> float:
    """Forward FLOPs of the embedding pass: 2 x non-embedding parameters x real tokens."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)(
        texts, truncation=True, max_length=max_length)["input_ids"])
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter  # q, o, k, v, gate/up/down projections
    return 2 * per_layer * layers * tokens / 1e9


def _random_nodes(trie: ItemTrie, codes: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Nodes of ``batch`` random real prefixes of random depth 0..L-1 (the states a decoder masks)."""
    rows = torch.randint(0, codes.shape[0], (batch,), generator=generator)
    depths = torch.randint(0, codes.shape[1], (batch,), generator=generator)
    nodes = torch.full((batch,), trie.root, dtype=torch.long)
    for level in range(codes.shape[1] - 1):
        stepped = trie.step(nodes, codes[rows, level])
        nodes = torch.where(depths > level, stepped, nodes)
    return nodes


def trie_rows(name: str, index: ItemIndex, offset: int, repeats: int, batch: int = 1000) -> list[dict[str, Any]]:
    """Mask throughput for ``batch`` prefixes with identifier tokens placed after ``offset`` other tokens."""
    vocab = offset + len(index.tokens)
    trie = index.trie({t: offset + i for i, t in enumerate(index.tokens)}, vocab_size=vocab)
    codes = torch.as_tensor(index.codes + offset)
    nodes = _random_nodes(trie, codes, batch, torch.Generator().manual_seed(0))
    ceiling = timed(lambda: torch.full((batch, vocab), torch.finfo(torch.float32).min), repeats=repeats)["median_s"]
    rows = []
    for op, fn in (("additive_mask", lambda: trie.additive_mask(nodes)), ("allowed_mask", lambda: trie.allowed_mask(nodes)),
                   ("children", lambda: trie.children(nodes)), ("step", lambda: trie.step(nodes, codes[:batch, 0]))):
        seconds = timed(fn, repeats=repeats)["median_s"]
        rows.append({"index": name, "vocab": vocab, "batch": batch, "op": op, "median_ms": seconds * 1e3,
                     "prefixes_per_s": batch / seconds,
                     "ceiling_ms": ceiling * 1e3 if op == "additive_mask" else None,
                     "share_of_ceiling": ceiling / seconds if op == "additive_mask" else None})
    return rows


def run(out: Path, repeats: int = 3, beauty: Path | None = None, embedder: str = "smollm2") -> str:
    """Run the benchmark, write ``ids.json`` and ``ids.md`` into ``out``, return the Markdown."""
    dataset = load_dataset("ml-100k")
    texts = dataset.item_texts()
    sizes = default_codebook_sizes(dataset.num_items)
    model_dir = resolve_model_dir(embedder)
    embed = timed(lambda: embed_texts(texts, model_dir, use_cache=False, progress=False), repeats=repeats, warmup=0)
    embeddings = embed_texts(texts, model_dir, progress=False)
    gflops = matmul_gflops()
    embed_ceiling = _forward_gflop(model_dir, texts) / gflops
    build_rows, resolved = [], {}
    for method, quantize in (("rqkmeans", lambda: rq_kmeans(embeddings, sizes)),
                             ("rqvae", lambda: rq_vae(embeddings, sizes, progress=False))):
        timing = timed(quantize, repeats=repeats, warmup=0)
        quantization = quantize()
        resolved[method], _, stats = resolve(quantization.codes, sizes, "reassign", quantization.last_level_costs())
        build_rows.append({"method": method, "quantize_median_s": timing["median_s"],
                           "quantize_runs_s": timing["runs_s"],
                           "collision_rate_before": stats["collisions_before"]["rate"],
                           "collision_groups_before": stats["collisions_before"]["groups"],
                           "collision_rate_after": stats["collisions_after"]["rate"],
                           "moved_items": stats["moved_items"], "code_usage": stats["code_usage"]})
    ml_index = ItemIndex.from_codes(dataset.item_ids, resolved["rqkmeans"])
    trie_results = trie_rows("ml-100k", ml_index, 4, repeats=max(repeats, 20))
    if beauty is not None:
        beauty_index, _ = load_released(Path(beauty) / "item_index.json")
        trie_results += trie_rows("beauty", beauty_index, 4, repeats=max(repeats, 20))
        trie_results += trie_rows("beauty+smollm2-vocab", beauty_index, 49152, repeats=max(repeats, 5))
    results = {
        "dataset": "ml-100k", "items": dataset.num_items, "codebook_sizes": sizes, "repeats": repeats,
        "embedding": {"model": str(embedder), "median_s": embed["median_s"], "runs_s": embed["runs_s"],
                      "items_per_s": len(texts) / embed["median_s"], "matmul_gflops": gflops,
                      "ceiling_s": embed_ceiling, "share_of_ceiling": embed_ceiling / embed["median_s"]},
        "quantization": build_rows, "trie": trie_results,
    }
    markdown = "\n\n".join([
        f"# Identifier building and trie masks (ML-100K, {dataset.num_items} items, codebooks {sizes})",
        f"Embedding with {embedder}: median {embed['median_s']:.1f} s over {repeats} runs "
        f"({len(texts) / embed['median_s']:.0f} items/s); compute ceiling {embed_ceiling:.1f} s at the measured "
        f"{gflops:.0f} GFLOP/s float32 matmul, i.e. {embed_ceiling / embed['median_s']:.0%} of the ceiling.",
        markdown_table(["method", "quantize median s", "collisions before", "groups", "after", "moved", "code usage"],
                       [[r["method"], r["quantize_median_s"], f"{r['collision_rate_before']:.2%}",
                         r["collision_groups_before"], f"{r['collision_rate_after']:.2%}", r["moved_items"],
                         ", ".join(f"{u:.0%}" for u in r["code_usage"])] for r in build_rows]),
        "Trie operations on a batch of 1,000 random real prefixes (ceiling: `torch.full` of the same mask).",
        markdown_table(["index", "vocab", "op", "median ms", "prefixes/s", "ceiling ms", "share of ceiling"],
                       [[r["index"], r["vocab"], r["op"], r["median_ms"], f"{r['prefixes_per_s']:,.0f}",
                         "" if r["ceiling_ms"] is None else r["ceiling_ms"],
                         "" if r["share_of_ceiling"] is None else f"{r['share_of_ceiling']:.0%}"]
                        for r in trie_results]),
    ])
    write_results(out, "ids", results, markdown)
    return markdown

