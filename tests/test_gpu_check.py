"""benchmarks/gpu_check.py at a tiny size on the CPU (``--device cpu``): every phase runs (each exact
decoder, the drop-in, the service at 1 and 16 clients, greedy text, float32 and bfloat16), checks
its answers and writes one JSON and Markdown table; in float32 every answer matches its reference,
so a GPU session only has to run it."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_check import EXACT, main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_runs_on_the_cpu(trained_models, smollm2_dir, tmp_path) -> None:
    results = main(["--device", "cpu", "--target", str(trained_models / "target"),
                    "--draft", str(trained_models / "draft"), "--users", "8", "--batch-size", "4",
                    "--service-requests", "16", "--text-prompts", "1", "--max-new-tokens", "8",
                    "--budget-s", "3600", "--out", str(tmp_path), "--name", "check"])
    assert results["skipped"] == []
    written = json.loads((tmp_path / "check.json").read_text())
    assert written["rows"] == results["rows"]
    markdown = (tmp_path / "check.md").read_text()
    for dtype in ("float32", "bfloat16"):
        mine = [row for row in results["rows"] if row["dtype"] == dtype]
        assert {row["what"] for row in mine if row["part"] == "items"} >= set(EXACT)
        assert {row["part"] for row in mine} == {"items", "drop-in", "service", "text"}
        assert {row["what"] for row in mine if row["part"] == "service"} == {"1 client(s)", "16 client(s)"}
        assert all(row["all_near_ties"] for row in mine if "all_near_ties" in row and row["part"] != "text"), mine
        assert f"| {dtype} | drop-in |" in markdown
    full = [row for row in results["rows"] if row["dtype"] == "float32" and "identical" in row]
    assert all(row["identical"] == 1.0 for row in full), full  # float32: transformers' and the CPU's answers
