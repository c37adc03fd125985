"""recspec's small-row kernel (``recspec/accel/kernel.cpp``): the linear product for every row
count, shape and bias; each row's output the same bits whatever rows share its call and whatever
columns share its weight; the build checksummed, made again when damaged, and switched off by
``RECSPEC_ACCEL=0``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from recspec.fileio import CHECKSUMS
from recspec.accel.kernel import available, unsupported
from recspec.accel.policy import SWITCH
from recspec.accel.small_rows import MAX_SMALL_ROWS, OneDnnPack, RowPanels, new_pack, small_row_linear

pytestmark = pytest.mark.skipif(unsupported() is not None or not available(),
                                reason=f"the small-row kernel cannot be built here: {unsupported()}")


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's product over freshly made panels: ``[rows, out]``."""
    return RowPanels().linear(x, weight, bias=bias)


@pytest.mark.parametrize("out_in", [(1, 1), (15, 7), (16, 64), (17, 33), (100, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_the_linear_product(out_in, bias) -> None:
    """Against float64 products: every row count 1..20 and the large ones, output widths that are
    and are not a multiple of the 16-column panel."""
    out, width = out_in
    generator = torch.Generator().manual_seed(out * 1000 + width)
    weight = torch.randn(out, width, generator=generator)
    shift = torch.randn(out, generator=generator) if bias else None
    for rows in (*range(1, 21), 31, 64, MAX_SMALL_ROWS):
        x = torch.randn(rows, width, generator=generator)
        expected = F.linear(x.double(), weight.double(), None if shift is None else shift.double())
        got = product(x, weight, shift)
        assert got.shape == (rows, out) and got.dtype == torch.float32 and got.is_contiguous()
        tolerance = 1e-5 * (1 + x.abs().max().item() * weight.abs().max().item() * width ** 0.5)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=tolerance)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it() -> None:
    """A row computed alone, among 2..30 rows, or at any place in its call: the same bits (one chain of
    multiply-adds per output element, whatever the tile it falls in)."""
    generator = torch.Generator().manual_seed(1)
    weight, shift = torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator)
    rows = torch.randn(30, 96, generator=generator)
    alone = torch.cat([product(rows[i:i + 1], weight, shift) for i in range(30)])
    for count in range(2, 31):
        order = torch.randperm(30, generator=generator)[:count]
        assert torch.equal(product(rows[order], weight, shift), alone[order]), count


def test_concatenated_weights_give_each_ones_bits() -> None:
    """The product over concatenated weights (fused sibling projections) is, column for column,
    each weight's own product."""
    generator = torch.Generator().manual_seed(2)
    parts = [torch.randn(out, 64, generator=generator) for out in (40, 9, 23)]
    x = torch.randn(7, 64, generator=generator)
    fused = RowPanels().linear(x, *parts)
    assert torch.equal(fused, torch.cat([product(x, part, None) for part in parts], dim=1))


def test_the_kernel_serves_small_row_products_and_nothing_else() -> None:
    """A layer's small-row forward keeps panels and computes 1..128 float32 rows with the kernel (the
    same bits as the kernel's own product); more rows, a gradient, or float64 go to torch's products,
    and ``kernel=False`` keeps oneDNN's pack."""
    assert isinstance(new_pack(), RowPanels) and isinstance(new_pack(kernel=False), OneDnnPack)
    torch.manual_seed(3)
    layer = nn.Linear(48, 80)
    x = torch.randn(1, 5, 48)
    pack = new_pack()
    with torch.inference_mode():
        got = small_row_linear(x, layer.weight, layer.bias, pack=pack)
        assert torch.equal(got, product(x[0], layer.weight, layer.bias)[None])
        assert pack.packed is not None and tuple(pack.packed.shape) == (5, 48, 16)  # 80 columns: 5 panels
        many = torch.randn(MAX_SMALL_ROWS + 1, 48)
        torch.testing.assert_close(small_row_linear(many, layer.weight, layer.bias, pack=pack),
                                   F.linear(many, layer.weight, layer.bias))
        doubled = small_row_linear(x.double(), layer.weight.double(), layer.bias.double(), pack=pack)
        assert doubled.dtype == torch.float64
    graded = small_row_linear(x.requires_grad_(), layer.weight, layer.bias, pack=pack)
    graded.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bad_panels_are_refused() -> None:
    weight = torch.randn(20, 8)
    panels = torch.ops.recspec_rows.pack(weight)
    with pytest.raises(RuntimeError, match="panels do not match"):
        torch.ops.recspec_rows.linear(torch.randn(2, 9), panels, 20, None)
    with pytest.raises(RuntimeError, match="panels do not match"):
        torch.ops.recspec_rows.linear(torch.randn(2, 8), panels, 40, None)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        torch.ops.recspec_rows.linear(torch.randn(8, 2).T, panels, 20, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.recspec_rows.linear(torch.randn(2, 8), panels, 20, torch.randn(19))


def _run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``$RECSPEC_CACHE`` at ``cache``."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RECSPEC_CACHE": str(cache), **env})


CHECK = ("import torch; from recspec.accel.kernel import available, build_dir; print(available()); "
         "w = torch.randn(20, 8); x = torch.randn(3, 8); "
         "print(torch.equal(torch.ops.recspec_rows.linear(x, torch.ops.recspec_rows.pack(w), 20, None), "
         "torch.ops.recspec_rows.linear(x, torch.ops.recspec_rows.pack(w), 20, None)) if available() else '-'); "
         "print(build_dir())")


def test_the_build_is_checksummed_checked_and_made_again_when_damaged(tmp_path) -> None:
    """A fresh cache builds the kernel once (saying so) with a checksum listing; the next process
    loads it without building; a damaged library is noticed, built again and works."""
    first = _run(CHECK, tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[:2] == ["True", "True"] and "building the small-row kernel" in first.stderr
    folder = Path(first.stdout.splitlines()[2])
    listing = json.loads((folder / CHECKSUMS).read_text())["files"]
    assert "recspec_rows.so" in listing
    again = _run(CHECK, tmp_path)
    assert again.stdout.splitlines()[:2] == ["True", "True"] and "building" not in again.stderr
    library = folder / "recspec_rows.so"
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))
    mended = _run(CHECK, tmp_path)
    assert mended.returncode == 0, mended.stderr
    assert mended.stdout.splitlines()[:2] == ["True", "True"]
    assert "damaged" in mended.stderr and "building the small-row kernel" in mended.stderr


def test_a_failed_build_says_why_and_falls_back(tmp_path) -> None:
    """A compiler that fails (``CXX=false``): one warning naming the failed build, nothing left in
    the cache, and layers keep oneDNN's packs."""
    code = ("from recspec.accel.small_rows import new_pack; from recspec.accel.kernel import available; "
            "print(available(), type(new_pack()).__name__)")
    failed = _run(code, tmp_path, CXX="false")
    assert failed.returncode == 0, failed.stderr
    assert failed.stdout.split() == ["False", "OneDnnPack"] and "did not build" in failed.stderr
    assert not [path for path in (tmp_path / "kernels").iterdir() if path.is_dir()]


def test_the_switch_turns_the_kernel_off(tmp_path) -> None:
    """``RECSPEC_ACCEL=0``: nothing is built, layers keep oneDNN's packs."""
    code = ("from recspec.accel.small_rows import new_pack; from recspec.accel.kernel import available; "
            "print(available(), type(new_pack()).__name__)")
    off = _run(code, tmp_path, **{SWITCH: "0"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "OneDnnPack"] and not (tmp_path / "kernels").exists()


def test_bench_products_times_a_calls_products_side_by_side(smollm2_dir, tmp_path) -> None:
    """`python -m benchmarks.lab rows --products` on the real SmolLM2: the 121 weights one call streams (q, k, v
    and gate, up concatenated per layer, 538 MB), each product timed every pass, JSON, Markdown and
    plot written."""
    from benchmarks.lab.rows import PRODUCTS, call_weights, products
    from recspec.models.hf import load_causal_lm

    weights = call_weights(load_causal_lm(smollm2_dir))
    assert len(weights) == 30 * 4 + 1 and sum(w.numel() for w in weights) * 4 / 1e6 == pytest.approx(538, rel=0.01)
    assert sorted({tuple(w.shape) for w in weights}) == [(576, 576), (576, 1536), (960, 576), (3072, 576),
                                                         (49152, 576)]
    markdown = products(tmp_path, str(smollm2_dir), sizes=(1, 3), repeats=2, name="products")
    results = json.loads((tmp_path / "products.json").read_text())
    assert [c["rows"] for c in results["cells"]] == [1, 3] and results["weights"] == 121
    for cell in results["cells"]:
        assert set(cell["runs_ms"]) == set(PRODUCTS) and all(len(t) == 2 and min(t) > 0 for t in cell["runs_ms"].values())
        assert cell["speedup_over_best_torch"] > 0
    assert (tmp_path / "products.png").stat().st_size > 0 and "| 3 |" in markdown
