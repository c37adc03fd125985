"""The package's layer order (README, Code layout): every import points down the list, and no
module imports another module's private (``_``-prefixed) names. The research benchmarks live in
the repository (``benchmarks/lab``, not installed): the package never imports them, and only the
command line imports the benchmarks it keeps (``recspec bench``)."""

from __future__ import annotations

import ast
from pathlib import Path

import recspec

#: Lowest first; a module may import from its own layer and the ones before it.
LAYERS = (
    ("errors", "extras", "fileio", "devices", "statefile", "assets", "ready", "hub", "data", "eval"),
    ("itemids", "models", "accel", "precision"),
    ("decoding",),
    ("recommend", "calibration", "turns", "auto", "fit", "knowledge", "align", "dropin_contract", "hf", "importer"),
    ("bench", "cluster"),
    ("serve", "cli", "api", "custom_generate_repo"),
)
ROOT = Path(recspec.__file__).parent
#: The repository's research benchmarks (``python -m benchmarks.lab``).
LAB = ROOT.parent / "benchmarks" / "lab"
#: The one product module that imports ``recspec.bench``: its commands run the kept benchmarks.
BENCH_USERS = ("recspec.cli",)
#: Inside ``recspec.decoding``, lowest first (README, Code layout): primitives, the model calls,
#: the plain beam loop, the speculative parts and the engine's round loop, its searches over items
#: and text and the verifiers, each method's wiring.
DECODING = (
    ("registry", "warp", "categorical", "support", "cache", "tree", "space", "beams", "cost", "tree_plan"),
    ("prompts", "prefix"),
    ("scorer",),
    ("beam_search", "hf_reference", "text_cache", "head_cache", "draft_tree"),
    ("frontier", "acceptance", "drafting", "engine"),
    ("drafters", "draft_sources", "item_prior", "target_prior"),
    ("rounds", "text_rounds"),
    ("verifiers", "chains", "head_trees"),
    ("speculative_beam", "dsbd"),
    ("text",),
)


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _imported_modules() -> list[tuple[str, str, int]]:
    """(module, the module it imports, line) for every import statement under recspec/."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("recspec", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out += [(module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                out.append((module, node.module, node.lineno))
    return out


def _imports() -> list[tuple[str, ast.ImportFrom]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("recspec", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        if module == "recspec":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("recspec."):
                out.append((module, node))
    return out


def test_every_module_has_a_layer() -> None:
    tops = {path.relative_to(ROOT).parts[0].removesuffix(".py") for path in ROOT.rglob("*.py")} - {"__init__"}
    assert tops == {name for names in LAYERS for name in names}


def test_imports_point_down_the_layers() -> None:
    upward = [f"{module} imports {node.module} (line {node.lineno})" for module, node in _imports()
              if _layer(node.module) > _layer(module)]
    assert not upward, upward


def test_no_private_names_are_imported() -> None:
    private = [f"{module} imports {alias.name} from {node.module}" for module, node in _imports()
               for alias in node.names if alias.name.startswith("_")]
    assert not private, private


def _decoding_layer(module: str) -> int:
    name = module.split(".")[2]
    return next(i for i, names in enumerate(DECODING) if name in names)


def test_decoding_modules_have_a_layer() -> None:
    names = {path.stem for path in (ROOT / "decoding").glob("*.py")} - {"__init__"}
    assert names == {name for names in DECODING for name in names}


def test_decoding_imports_point_down() -> None:
    upward = [f"{module} imports {node.module} (line {node.lineno})" for module, node in _imports()
              if module.startswith("recspec.decoding.") and node.module.startswith("recspec.decoding.")
              and _decoding_layer(node.module) > _decoding_layer(module)]
    assert not upward, upward


def test_the_package_never_imports_the_lab() -> None:
    """Nothing under recspec/ imports ``benchmarks`` (the moved experiments), and no module of
    ``recspec.bench`` is named after one of them (which would bring a moved one back)."""
    lab = [f"{module} imports {name} (line {line})" for module, name, line in _imported_modules()
           if name == "benchmarks" or name.startswith("benchmarks.")]
    assert not lab, lab
    moved = {path.stem for path in LAB.glob("*.py")} - {"__init__", "__main__", "cli"}
    assert moved, f"no lab modules under {LAB}"
    back = sorted(moved & {path.stem for path in (ROOT / "bench").glob("*.py")})
    assert not back, back


def test_only_the_command_line_imports_the_benchmarks() -> None:
    """Product modules do not depend on benchmark code: outside recspec/bench/, only
    :data:`BENCH_USERS` import ``recspec.bench``."""
    users = [f"{module} imports {name} (line {line})" for module, name, line in _imported_modules()
             if (name == "recspec.bench" or name.startswith("recspec.bench.")) and not module.startswith("recspec.bench")
             and module not in BENCH_USERS]
    assert not users, users


#: Public top-level names defined in more than one module on purpose: true re-exports only (none).
SAME_NAME_ALLOWED: frozenset[str] = frozenset()
#: The transformers Hub folder shipped as package data: transformers loads its ``generate`` by that
#: name (``generate(custom_generate=...)``), so its names are transformers' to choose.
HUB_FOLDER = "custom_generate_repo"


def test_one_name_per_idea() -> None:
    """No two public top-level classes or functions under recspec/ share a name (issue 66: one
    name per idea); a name imported from another module is a re-export, not a definition."""
    defined: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == HUB_FOLDER:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            public = not node.name.startswith("_") if hasattr(node, "name") else False
            if public and isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in defined.items() if len(paths) > 1 and name not in SAME_NAME_ALLOWED}
    assert not shared, shared
