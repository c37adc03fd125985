"""BENCHMARKS.md is generated (`python -m benchmarks.report_summary`): its summary tables come from
benchmarks/results/*.json and its sections from benchmarks/sections/*.md, so the file must be what
the script writes now; regenerate it after adding a result or editing a section."""

from __future__ import annotations

import re

from benchmarks import report_summary
from benchmarks.report_summary import BEGIN, END, OUT, ROOT, render, section_files


def test_benchmarks_md_is_current():
    current = (ROOT / OUT).read_text()
    assert current == render(), "BENCHMARKS.md is not current: run python -m benchmarks.report_summary"


def test_every_section_file_is_included_once():
    text = render()
    files = section_files()
    assert files, "no benchmarks/sections/*.md"
    for path in files:
        assert text.count(f"<!-- section: {path.relative_to(ROOT)} -->") == 1, path
    assert len({path.stem for path in files}) == len(files)


def test_summary_has_a_table_per_area_from_the_results():
    summary = report_summary.summary()
    assert summary.startswith(BEGIN) and summary.endswith(END)
    for area, _ in report_summary.AREAS:
        assert f"### {area}" in summary, area
    for link in re.findall(r"\(benchmarks/results/([\w.-]+)\.md\)", summary):
        assert (ROOT / "benchmarks" / "results" / f"{link}.json").is_file(), link


def test_section_headings_carry_no_dates():
    for path in section_files():
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                assert not re.search(r"\b20\d\d-\d\d-\d\d\b", line), f"{path.name}: {line}"


def test_new_section_files_are_picked_up(tmp_path, monkeypatch):
    (tmp_path / "benchmarks" / "sections").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for name in ("zeta", "demo", "alpha"):
        (tmp_path / "benchmarks" / "sections" / f"{name}.md").write_text(f"## {name}\n")
    names = [path.stem for path in section_files(tmp_path)]
    assert names == ["demo", "alpha", "zeta"]  # ORDER first, then any other by name
    text = render(tmp_path)
    assert text.index("## demo") < text.index("## alpha") < text.index("## zeta")
