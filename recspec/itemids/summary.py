"""Plain-text summaries of identifier statistics for the command line."""

from __future__ import annotations

from typing import Any


def describe_stats(stats: dict[str, Any]) -> str:
    """Items, length, vocabulary, collisions before/after, code usage and timings."""
    before, after = stats["collisions_before"], stats["collisions_after"]
    lines = [
        f"items          {stats['num_items']:,}",
        f"length L       {stats['length']} (codebooks {stats['codebook_sizes']})",
        f"vocabulary     {stats['vocabulary']:,} identifier tokens",
        f"collisions     before: {before['rate']:.2%} of items in {before['groups']} groups "
        f"(largest {before['largest_group']}); after: {after['rate']:.2%}",
        f"resolution     {stats['resolution']} ({stats['moved_items']} items moved)",
        "code usage     " + ", ".join(f"L{i + 1} {u:.0%}" for i, u in enumerate(stats["code_usage"])),
    ]
    if "seconds" in stats:
        s = stats["seconds"]
        lines.append(f"time           embed {s['embed']:.1f}s, quantise {s['quantize']:.1f}s, total {s['total']:.1f}s")
    for key, change in stats.get("changes", {}).items():
        lines.append(f"  item {key}: {' '.join(change['from'])} -> {' '.join(change['to'])}")
    return "\n".join(lines)
