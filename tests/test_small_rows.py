"""The small-row linear forward: the same product as ``F.linear`` for every row count and shape,
on a real SmolLM2 model too (logits of one call over a few rows)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from recspec.accel.kernel import available
from recspec.accel.small_rows import (MAX_SMALL_ROWS, ONEDNN_ROWS, PACKED_ROWS, OneDnnPack, RowPanels,
                                      SmallRowForward, new_pack, onednn_computes, padded_rows, pads_rows,
                                      small_row_linear, use_small_row_products)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (3, 5, 48), (1, 14, 48), (2, 7, 48), (23, 48), (1, 50, 48),
                                   (1, MAX_SMALL_ROWS, 48), (MAX_SMALL_ROWS + 1, 48), (0, 48)])
def test_small_row_forward_is_the_linear_product(shape, bias) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, layer.weight, layer.bias)
    use_small_row_products(layer)
    out = layer(x)
    assert out.shape == expected.shape and out.is_contiguous()  # row-major, as F.linear's result
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    column_major = x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() > 1 else x
    with torch.inference_mode():  # no gradient: oneDNN's linear from 7 rows on, from 3 over a packed weight,
        for pad in (True, False):  # recspec's kernel over panels where it is built
            for onednn in (True, False):
                for pack in (None, OneDnnPack(), new_pack()):
                    out = small_row_linear(column_major, layer.weight, layer.bias, pad=pad, onednn=onednn, pack=pack)
                    assert out.shape == expected.shape and out.is_contiguous()
                    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_onednn_computes_7_to_128_float32_rows_without_gradient() -> None:
    weight = torch.randn(8, 4)
    x = torch.randn(ONEDNN_ROWS, 4)
    with torch.no_grad():
        assert [onednn_computes(x, weight, None, n) for n in (1, ONEDNN_ROWS - 1, ONEDNN_ROWS, MAX_SMALL_ROWS,
                                                               MAX_SMALL_ROWS + 1)] == [False, False, True, True, False]
        assert not onednn_computes(x.double(), weight.double(), None, ONEDNN_ROWS)
    assert onednn_computes(x, weight, None, ONEDNN_ROWS)  # grad mode on, but nothing requires a gradient
    assert not onednn_computes(x.requires_grad_(), weight, None, ONEDNN_ROWS)
    assert not onednn_computes(x.detach(), weight, torch.zeros(8, requires_grad=True), ONEDNN_ROWS)
    with torch.no_grad():  # over a packed weight from 3 rows
        assert [onednn_computes(x, weight, None, n, packed=True) for n in (1, PACKED_ROWS - 1, PACKED_ROWS,
                                                                            MAX_SMALL_ROWS, MAX_SMALL_ROWS + 1)
                ] == [False, False, True, True, False]


def test_a_packed_weight_follows_its_weight() -> None:
    """The packed copy is made once and made again after an in-place change of the weight (an
    optimiser step, load_state_dict) or when the layer gets another weight tensor: the product
    stays the layer's current one."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 24)
    use_small_row_products(layer)
    pack = layer.forward.pack
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        first = pack.packed
        layer(x)
        assert pack.packed is first  # kept
        layer.weight.mul_(-2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert pack.packed is not first
        layer.load_state_dict({"weight": torch.randn(24, 32), "bias": torch.zeros(24)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(24, 32))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        kept = pack.packed
        view = layer.weight.detach()  # a view of the same memory shares the pack, and its version
        assert pack.of(view) is kept
        view.add_(1.0)
        assert pack.of(layer.weight) is not kept
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    copied = copy.deepcopy(layer)  # a copy starts without the packed weight and makes its own
    assert copied.forward.pack.packed is None and copied.forward.layer is copied
    with torch.no_grad():
        torch.testing.assert_close(copied(x), layer(x))
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)

    layer(x).square().sum().backward()  # with a gradient: MKL's product, no pack used
    optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_padded_row_counts_cover_the_rows() -> None:
    """Every count keeps its rows and stays within the small-row range; a padded count lands on a
    multiple of 8 at most 7 rows up."""
    for rows in range(2, MAX_SMALL_ROWS + 1):
        padded = padded_rows(rows)
        assert rows <= padded <= min(rows + 7, MAX_SMALL_ROWS)
        assert padded == rows or padded % 8 == 0
    assert [padded_rows(n) for n in (9, 10, 15, 16, 20, 21, 25, 32, 33)] == [9, 16, 16, 16, 20, 24, 32, 32, 33]


@pytest.mark.parametrize("rows", [1, 4, 14])
def test_gradients_flow_through_the_small_row_forward(rows: int) -> None:
    """The gradient of a padded product is the plain one."""
    torch.manual_seed(0)
    layer, plain = nn.Linear(16, 8), nn.Linear(16, 8)
    plain.load_state_dict(layer.state_dict())
    use_small_row_products(layer)
    x = torch.randn(rows, 16)
    layer(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_loaded_llms_use_it_and_keep_their_logits(smollm2_dir) -> None:
    from transformers import AutoModelForCausalLM

    from recspec.models.hf import load_causal_lm

    patched = load_causal_lm(smollm2_dir)
    plain = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert isinstance(patched.lm_head.forward, SmallRowForward) and patched.lm_head.forward.layer is patched.lm_head
    assert isinstance(patched.lm_head.forward.pack, RowPanels if available() else OneDnnPack)
    assert not pads_rows(patched) and not pads_rows(plain)  # with the kernel or oneDNN no row count is padded
    ids = torch.arange(100, 116)[None]
    with torch.inference_mode():
        expected = plain(ids).logits
        torch.testing.assert_close(patched(ids).logits, expected, rtol=1e-4, atol=1e-4)
        use_small_row_products(patched, kernel=False)  # oneDNN over packed weights
        assert not pads_rows(patched)
        torch.testing.assert_close(patched(ids).logits, expected, rtol=1e-4, atol=1e-4)
        use_small_row_products(patched, pack=False)  # oneDNN over the plain weights
        torch.testing.assert_close(patched(ids).logits, expected, rtol=1e-4, atol=1e-4)
        for pad in (True, False):  # MKL's products for all rows, padded or not
            use_small_row_products(patched, pad=pad, onednn=False, kernel=False)
            assert pads_rows(patched) == pad
            torch.testing.assert_close(patched(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_bench_rows_times_every_setting(smollm2_dir, tmp_path) -> None:
    """`python -m benchmarks.lab rows` on the real SmolLM2: a cell per size with every setting timed every
    round, the rows each setting computes, and its JSON, Markdown and plot written; the model is
    left with the default products and attention."""
    import json

    from benchmarks.lab.rows import SETTINGS, run

    markdown = run(tmp_path, str(smollm2_dir), past=8, sizes=(1, 14), repeats=1, rounds=2, name="rows")
    results = json.loads((tmp_path / "rows.json").read_text())
    cells = results["cells"]
    one = 1 if available() else 2  # recspec's kernel computes one row as one, MKL's as two
    assert results["row_kernel"] == available()
    assert [(c["nodes"], c["rows_computed"]) for c in cells] == [
        (1, {"mkl": 2, "mkl_padded": 2, "onednn_plain": 2, "unfused": 2, "onednn_packed": 2, "unpacked": one,
             "recspec": one}),
        (14, {"mkl": 14, "mkl_padded": 16, "onednn_plain": 14, "unfused": 14, "onednn_packed": 14, "unpacked": 14,
              "recspec": 14})]
    assert all(set(c["runs_ms"]) == set(SETTINGS) and all(len(t) == 2 for t in c["runs_ms"].values())
               and min(c["ms"].values()) > 0 for c in cells)
    assert (tmp_path / "rows.png").stat().st_size > 0 and "| 14 |" in markdown


def test_bench_rows_pairs_two_settings_call_by_call(smollm2_dir, tmp_path) -> None:
    """`python -m benchmarks.lab rows --pairs`: per size, version 5's products and recspec's default timed pair by
    pair, the median ratio within its quartiles, JSON, Markdown and plot written."""
    import json

    from benchmarks.lab.rows import paired

    markdown = paired(tmp_path, str(smollm2_dir), past=8, sizes=(1, 4), pairs=3, name="pairs")
    results = json.loads((tmp_path / "pairs.json").read_text())
    assert results["settings"] == ["onednn_packed", "recspec"] and [c["nodes"] for c in results["cells"]] == [1, 4]
    for cell in results["cells"]:
        low, _, high = cell["ratio_quartiles"]
        assert min(cell["ms"].values()) > 0 and low <= cell["ratio"] <= high
    assert (tmp_path / "pairs.png").stat().st_size > 0 and "| 4 |" in markdown


def test_bench_rows_against_times_sizes_against_a_base_call(smollm2_dir, tmp_path) -> None:
    """`python -m benchmarks.lab rows --pairs N --against 2`: per size and setting, calls over n nodes against
    calls over 2, the median ratio within its quartiles, JSON,
    Markdown and plot written."""
    import json

    from benchmarks.lab.rows import against

    markdown = against(tmp_path, str(smollm2_dir), past=8, sizes=(2, 6), pairs=3, base=2, name="against")
    results = json.loads((tmp_path / "against.json").read_text())
    assert results["base"] == 2 and sorted(results["cells"]) == ["onednn_packed", "recspec"]
    for cells in results["cells"].values():
        assert [c["nodes"] for c in cells] == [2, 6]
        for cell in cells:
            low, _, high = cell["ratio_quartiles"]
            assert cell["ms"] > 0 and cell["base_ms"] > 0 and low <= cell["ratio"] <= high
    assert (tmp_path / "against.png").stat().st_size > 0 and "| 6 |" in markdown

