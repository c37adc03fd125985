"""The package's layer order (README, Code layout): every import points down the list, and no
module imports another module's private (``_``-prefixed) names."""

from __future__ import annotations

import ast
from pathlib import Path

import recspec

#: Lowest first; a module may import from its own layer and the ones before it.
LAYERS = (
    ("errors", "fileio", "devices", "statefile", "assets", "hub", "data", "eval"),
    ("itemids", "models"),
    ("decoding",),
    ("recommend", "calibration", "turns", "auto", "fit", "knowledge", "align", "hf", "importer"),
    ("bench", "cluster"),
    ("serve", "cli", "api"),
)
ROOT = Path(recspec.__file__).parent
#: Inside ``recspec.decoding``, lowest first (README, Code layout): primitives, the model calls,
#: the plain beam loop, the speculative parts, the round loops and verifiers, each method's wiring.
DECODING = (
    ("warp", "categorical", "support", "cache", "tree", "space", "beams", "cost", "tree_plan"),
    ("prompts", "prefix"),
    ("scorer",),
    ("beam_search", "hf_reference", "chain", "draft_tree"),
    ("frontier", "acceptance", "chain_drafts"),
    ("drafters", "draft_sources", "item_prior", "target_prior"),
    ("rounds",),
    ("verifiers",),
    ("speculative_beam", "dsbd"),
    ("text",),
)


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names)


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
