"""Fuzzing the command line (hypothesis, fixed seeds): `recommend`, `generate` and `knowledge generate`
with small models over a space of good and bad arguments. Every run ends in a result (exit 0, a
complete file of valid JSON lines or a store) or in one `error:` line (exit 2) with no output file
and no temporary file left; never a traceback."""

from __future__ import annotations

import io
import json
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from recspec.cli import main
from tests.test_recommend_cli import small_data  # noqa: F401  (module fixture: a small CSV data set)
from tests.test_safety import trained  # noqa: F401  (module fixture: target and draft on it)

pytestmark = pytest.mark.usefixtures("one_thread")
# fixed seeds; no shrinking (each example loads models: a failure is reported as drawn)
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate])
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "0.5", "1", "1e30"]


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _run(argv: list[str]) -> tuple[int, str]:
    """``recspec argv`` in this process: (exit status, stderr). An exception escaping ``main`` (a
    traceback for the user) fails the test."""
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        try:
            main(argv)
            code = 0
        except SystemExit as exited:
            code = exited.code or 0
    return int(code), err.getvalue()


def _check(argv: list[str], out: Path, store: bool = False) -> int:
    code, err = _run(argv)
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, (argv, leftovers)
    assert "Traceback" not in err, (argv, err)
    if code == 0:
        assert out.is_file(), argv
        if not store:
            rows = [_strict(line) for line in out.read_text().splitlines()]
            assert rows and all(isinstance(row, dict) for row in rows), argv
    else:
        lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
        assert code == 2, (argv, code, err)
        assert lines and lines[-1].startswith("error: "), (argv, err)
        assert sum(line.startswith("error: ") for line in lines) == 1, (argv, err)
        assert not out.exists(), argv
    return code


def _option(name: str, values: list) -> st.SearchStrategy[list[str]]:
    """``[]`` (the option left out, four times in five, so that runs with every option good are
    common) or ``[--name, value]`` for one of ``values``."""
    given_one = st.sampled_from(values).map(lambda value: [f"--{name}", str(value)])
    return st.integers(0, 4).flatmap(lambda draw: given_one if draw == 0 else st.just([]))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_fuzz_recommend(trained, scratch: Path) -> None:  # noqa: F811
    damaged = scratch / "damaged-draft"
    if not damaged.exists():
        import shutil

        shutil.copytree(trained["draft"], damaged)
        (damaged / "best" / "config.json").write_text("{")
    drafts = [str(trained["draft"]), str(damaged), str(scratch / "nowhere")]
    options = st.tuples(
        _option("decoder", ["hf", "beam", "tree-beam", "beam-sample", "spec-strict", "spec-relaxed",
                            "spec-beam-sample", "dsbd", "x"]),
        _option("k", [-1, 0, 1, 3, 5, 40, 41]), _option("users", [-2, 0, 1, 3]), _option("batch-size", [0, 1, 4]),
        _option("temperature", NUMBERS), _option("draft", drafts), _option("draft-beams", [0, 3, 8]),
        _option("gamma", [0, 1, 2, 3]), _option("threshold", ["nan", "-0.5", "0.5", "2"]),
        _option("draft-width", [0, 2, 10]), _option("min-width", [0, 1, 3]), _option("part", ["test", "valid", "x"]),
        _option("device", ["cpu", "bogus", "cuda:9"]), st.sampled_from([[], ["--replacement"], ["--one-cache"]]),
        st.sampled_from(["fresh"] * 4 + ["folder", "readonly"]))

    codes: list[int] = []

    @FUZZ
    @given(options)
    def run(drawn) -> None:
        *parts, where = drawn
        base = Path(tempfile.mkdtemp(dir=scratch))
        out = {"fresh": base / "recs.jsonl", "folder": base, "readonly": Path("/proc/recs.jsonl")}[where]
        argv = ["recommend", "--target", str(trained["target"]), "--out", str(out)]
        argv += [arg for part in parts for arg in part]
        if "--users" not in argv:
            argv += ["--users", "3"]
        codes.append(_check(argv, out if where == "fresh" else base / "none.jsonl"))

    run()
    assert codes.count(0) >= 5 and codes.count(2) >= 5, codes  # the space holds both outcomes


@pytest.fixture(scope="module")
def tiny_lm(smollm2_dir: Path, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (fast to decode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from recspec.hub import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny") / "lm"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_fuzz_generate(tiny_lm: Path, ml100k, scratch: Path) -> None:
    options = st.tuples(
        _option("decoder", ["sample", "spec-sample", "topk-imp", "beam-sample", "dsbd", "x"]),
        _option("draft-layers", ["0", "0-1", "1", "5", "x"]), _option("draft", [str(tiny_lm), str(scratch / "no")]),
        _option("max-new-tokens", [-1, 0, 1, 3]), _option("temperature", NUMBERS),
        _option("top-k", [-1, 0, 1, 5]), _option("top-p", ["nan", "0", "0.5", "1", "1.5"]),
        _option("gamma", [0, 1, 2]), _option("lenience", ["nan", "0", "0.5", "1", "2"]),
        _option("draft-stop", ["nan", "0", "0.3", "1"]), _option("candidates", [0, 1, 5]),
        _option("beams", [0, 1, 2]), _option("draft-width", [0, 2, 4]),
        _option("threshold", ["nan", "-1", "0.5", "inf"]), _option("count", [-1, 0, 1, 2]),
        _option("batch-size", [0, 1, 2]), _option("device", ["cpu", "cuda:9", "x"]),
        st.sampled_from([[], ["--score"], ["--one-cache"], ["--prompt", "Hello"], ["--prompt", ""]]))

    codes: list[int] = []

    @FUZZ
    @given(options)
    def run(parts) -> None:
        out = Path(tempfile.mkdtemp(dir=scratch)) / "gen.jsonl"
        argv = ["generate", "--target", str(tiny_lm), "--out", str(out), *[arg for part in parts for arg in part]]
        if "--max-new-tokens" not in argv:
            argv += ["--max-new-tokens", "3"]
        if "--count" not in argv:
            argv += ["--count", "2"]
        codes.append(_check(argv, out))

    run()
    assert codes.count(0) >= 5 and codes.count(2) >= 5, codes


@pytest.mark.slow
def test_fuzz_knowledge_generate(tiny_lm: Path, ml100k, scratch: Path) -> None:
    pool = scratch / "old-users.db"  # earlier knowledge: the pool of the drafting methods
    assert _run(["knowledge", "generate", "--target", str(tiny_lm), "--part", "old", "--decoder", "ar", "--limit", "4",
                 "--max-new-tokens", "8", "--out", str(pool)])[0] == 0
    options = st.tuples(
        _option("decoder", ["ar", "hf", "prompt-lookup", "resd", "laser", "x"]), _option("part", ["old", "new", "x"]),
        _option("side", ["user", "item", "x"]), _option("verify", ["greedy", "relaxed", "x"]),
        _option("k", [-1, 0, 2]), _option("p", NUMBERS), _option("max-new-tokens", [-1, 0, 2]),
        _option("draft-nodes", [0, 16, 65]), _option("draft-depth", [0, 4, 13]), _option("max-suffix", [0, 2]),
        _option("grouping", ["router", "global", "random", "x"]), _option("groups", [0, 2]),
        _option("pool", [str(pool), str(pool), str(scratch / "missing.db")]), _option("batch-size", [0, 1, 2]),
        _option("max-prompt-tokens", [0, 16, 1024]), _option("device", ["cpu", "cuda:9"]))

    codes: list[int] = []

    @FUZZ
    @given(options)
    def run(parts) -> None:
        out = Path(tempfile.mkdtemp(dir=scratch)) / "k.db"
        argv = ["knowledge", "generate", "--target", str(tiny_lm), "--out", str(out), "--limit", "1",
                *[arg for part in parts for arg in part]]
        if "--max-new-tokens" not in argv:
            argv += ["--max-new-tokens", "2"]
        if "--decoder" not in argv:
            argv += ["--decoder", "ar"]
        codes.append(_check(argv, out, store=True))

    run()
    assert codes.count(0) >= 3 and codes.count(2) >= 5, codes
