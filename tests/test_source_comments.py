"""Comments and docstrings in recspec/ say what the code does and why, not what one run measured:
no timing figures from particular runs (``1.26x``, ``34 ms``, ``850 tokens/s``, ``15% slower``) and no
references to BENCHMARKS.md sections. Measurements live in benchmarks/results/ and BENCHMARKS.md;
a cost model or a design fact may still be stated in words or as a formula."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "recspec"

#: What a run's figure looks like in prose.
FIGURES = {
    # 1.26x, 1.07-1.10x, 5-15x (a bare "2x" is a factor in a rule, not a measurement)
    "speed-up": re.compile(r"(?<![\w.])(?:\d+\.\d+|\d+(?:\.\d+)?\s*[-–]\s*\d+(?:\.\d+)?)x(?![\w.])"),
    # 0.6 ms, about 10 s, 7 s here, ~23 min (a default or a limit, "5 ms by default", is not a run)
    "time": re.compile(r"(?:(?<![\w.])\d+\.\d+(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s?(?:ms|µs|us|s|min|h)\b"
                       r"|(?:about|~)\s?\d[\d.,]*(?:\s*[-–]\s*\d[\d.]*)?\s?(?:ms|µs|us|seconds?|s|min|minutes?|h|hours?)\b"
                       r"|\d[\d.]*\s?(?:ms|µs|us|s|min|minutes?)\s+here\b"
                       r"|\d[\d.]*(?:\s*[-–]\s*\d[\d.]*)?\s?(?:us|µs)\b)"),
    # 850 tokens/s, 77 examples/s
    "rate": re.compile(r"\d[\d,.]*\s*(?:tokens|users|examples|requests|texts)\s*(?:/\s*s\b|a second|per second)"),
    # measured up to 15% slower
    "percent": re.compile(r"measured (?:up to |about )?\d+(?:\.\d+)?%|\d+(?:\.\d+)?%\s+(?:slower|faster|cheaper)\s+(?:here|measured)"),
    "BENCHMARKS reference": re.compile(r"BENCHMARKS"),
}
#: file (relative to the repository) -> count of hits allowed. Empty: none is.
ALLOWED: dict[str, int] = {}


def prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring of a Python source."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                start = body[0].lineno
                found += [(start + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    # attribute docstrings: a string statement right after an assignment, and ``#:`` comments (above)
    return found


def hits(path: Path) -> list[str]:
    """``file:line: kind: text`` of every figure in ``path``'s comments and docstrings."""
    rel = path.relative_to(ROOT)
    out = []
    for line, text in prose(path.read_text()):
        for kind, pattern in FIGURES.items():
            if pattern.search(text):
                out.append(f"{rel}:{line}: {kind}: {text.strip()[:120]}")
                break
    return out


def all_hits() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        listed = hits(path)
        if listed:
            found[str(path.relative_to(ROOT))] = listed
    return found


def test_patterns_catch_run_figures():
    for text in ("1.26x faster", "1.07-1.10x cheaper", "one node 34 against 88.5 ms", "about 10 s, once",
                 "2-4x slower", "0.6 ms a round", "40-110 us", "about 7 s here",
                 "~850 tokens/s there", "measured up to 15% slower", 'BENCHMARKS.md "A cut LLM preset"'):
        assert any(pattern.search(text) for pattern in FIGURES.values()), text
    for text in ("4 x 256 Llama", "K = 10, batch 16", "scores within 1e-4", "three levels of 16", "c = F + r * n",
                 "max_position_embeddings 512", "a 5-second probe", "x (the draft)", "levels x widths",
                 "at least 3% faster", "(5 ms by default)", "at least 2 s and at most 20", "at 2x the best rate",
                 "transformers 5.2.x", "(target >= 3x)"):
        assert not any(pattern.search(text) for pattern in FIGURES.values()), text


def test_no_run_figures_in_comments():
    found = all_hits()
    over = {name: listed for name, listed in found.items() if len(listed) > ALLOWED.get(name, 0)}
    assert not over, "run figures or BENCHMARKS references in comments/docstrings:\n" + "\n".join(
        line for listed in over.values() for line in listed)
