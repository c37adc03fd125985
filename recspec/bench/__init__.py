"""Benchmark suites: each writes JSON and a Markdown table under benchmarks/results/."""
