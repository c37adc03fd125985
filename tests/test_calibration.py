"""The call-cost model F + r * n: the fit, and the record kept beside a model (reused only when it
matches the weights, device, threads and prompt length, and its digest checks out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recspec.accel import packed_attention, small_rows
from recspec.accel.packed_attention import ATTENTION_VERSION
from recspec.accel.small_rows import PRODUCTS_VERSION, use_small_row_products
from recspec.calibration import calibration_path, call_cost
from recspec.decoding.cost import CallCost, batch_nodes, fit_call_cost
from recspec.errors import RecspecError
from recspec.fileio import read_json, write_json_atomic


def test_fit_recovers_a_line_and_stays_non_negative() -> None:
    cost = fit_call_cost([1, 4, 16, 64], [0.012 + 0.0007 * n for n in (1, 4, 16, 64)])
    assert cost.fixed_s == pytest.approx(0.012) and cost.per_token_s == pytest.approx(0.0007)
    assert cost.call_s(10) == pytest.approx(0.019)
    flat = fit_call_cost([1, 64], [0.02, 0.019])  # noise on a flat curve: no negative slope
    assert flat.per_token_s == 0 and flat.fixed_s == pytest.approx(0.0195)
    steep = fit_call_cost([10, 20], [0.001, 0.004])  # an intercept below zero: through the origin
    assert steep.fixed_s == 0 and steep.per_token_s == pytest.approx((10 * 0.001 + 20 * 0.004) / (10**2 + 20**2))
    assert CallCost.from_json(cost.to_json()) == cost
    padded = CallCost(0.05, 0.002, padded=True)
    assert CallCost.from_json(padded.to_json()) == padded
    assert [padded.free_tokens(n) for n in (1, 9, 10, 15, 16, 17, 21)] == [1, 9, 16, 16, 16, 17, 24]
    assert [cost.free_tokens(n) for n in (1, 10, 21)] == [1, 10, 21]
    with pytest.raises(RecspecError, match="two or more token counts"):
        fit_call_cost([4, 4], [0.1, 0.2])


def test_batch_nodes_maximise_a_batchs_expected_tokens_per_second() -> None:
    """The node count is the exhaustive argmax over ``n`` of (B + the rows' chances of the first n
    nodes) / C(B (n + 1)); a batch of rows sizes its trees smaller than one of those rows alone,
    since it pays every node of every row."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, width = (int(v) for v in torch.randint(1, 17, (2,), generator=generator))
        chances = torch.sort(torch.rand(rows, width, generator=generator), dim=1, descending=True).values
        chances[torch.rand(rows, width, generator=generator) < 0.2] = 0.0  # shorter trees: no chance past them
        cost = CallCost(float(torch.rand(1, generator=generator)) * 0.1, float(torch.rand(1, generator=generator)) * 0.01)
        rates = [(rows + float(chances[:, :n].sum())) / cost.call_s(rows * (n + 1)) for n in range(width + 1)]
        assert batch_nodes(chances, cost) == max(range(width + 1), key=lambda n: (rates[n], -n))
    row, cost = torch.tensor([[0.9, 0.5, 0.1]]), CallCost(1.0, 0.1)
    assert batch_nodes(row, cost) == 2  # rates 0.91, 1.58, 1.85, 1.79
    assert batch_nodes(row.expand(16, 3), cost) == 1  # rates 6.15, 7.24, 6.62, 5.76
    assert batch_nodes(row, CallCost(1.0, 10.0)) == 0  # nodes dearer than what they bring
    assert batch_nodes(torch.zeros(4, 0), cost) == 0


@pytest.fixture
def tiny(tmp_path: Path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    model.save_pretrained(tmp_path / "m")
    return model, tmp_path / "m"


def test_record_is_kept_reused_and_remeasured_when_it_does_not_match(tiny, monkeypatch) -> None:
    model, folder = tiny
    first = call_cost(model, folder, prompt_len=8, repeats=2)
    path = calibration_path(folder, torch.device("cpu"))
    record = read_json(path)
    assert record["prompt_len"] == 8 and record["device"] == "cpu" and len(record["sha256"]) == 64
    assert [n for n, _ in first.samples] == [1, 4, 16, 64] and first.fixed_s >= 0 and first.per_token_s >= 0
    stamp = path.stat().st_mtime_ns
    assert call_cost(model, folder, prompt_len=8, repeats=2) == first and path.stat().st_mtime_ns == stamp

    write_json_atomic(path, {**record, "value": {**record["value"], "fixed_s": 123.0}})  # altered: digest fails
    again = call_cost(model, folder, prompt_len=8, repeats=2)
    assert again.fixed_s != 123.0 and read_json(path)["value"]["fixed_s"] == again.fixed_s

    other = call_cost(model, folder, prompt_len=16, repeats=2)  # another prompt length: measured again
    assert read_json(path)["prompt_len"] == 16 and other.samples != again.samples
    path.write_text("{damaged")
    assert call_cost(model, folder, prompt_len=16, repeats=2).fixed_s >= 0
    assert read_json(path)["prompt_len"] == 16
    assert read_json(path)["padded_rows"] is False and not other.padded
    padded = call_cost(use_small_row_products(model, onednn=False, kernel=False), folder, prompt_len=16, repeats=2)  # padded: again
    assert padded.padded and read_json(path)["padded_rows"] is True and padded.samples != other.samples
    # a newer small-row forward computes the calls another way: the record is measured again
    monkeypatch.setattr(small_rows, "PRODUCTS_VERSION", PRODUCTS_VERSION + 1)
    remeasured = call_cost(model, folder, prompt_len=16, repeats=2)
    assert read_json(path)["products"] == PRODUCTS_VERSION + 1 and remeasured.samples != padded.samples
    monkeypatch.setattr(packed_attention, "ATTENTION_VERSION", ATTENTION_VERSION + 1)  # so does a newer attention
    again = call_cost(model, folder, prompt_len=16, repeats=2)
    assert read_json(path)["attention"] == ATTENTION_VERSION + 1 and again.samples != remeasured.samples


def test_weights_change_invalidates_the_record(tiny) -> None:
    model, folder = tiny
    call_cost(model, folder, prompt_len=8, repeats=2)
    key = read_json(calibration_path(folder, torch.device("cpu")))["weights_sha256"]
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(folder)
    call_cost(model, folder, prompt_len=8, repeats=2)
    assert read_json(calibration_path(folder, torch.device("cpu")))["weights_sha256"] != key


def test_a_record_that_cannot_be_written_still_measures(tiny) -> None:
    model, folder = tiny
    blocked = calibration_path(folder, torch.device("cpu"))
    blocked.mkdir()  # the record's place is taken: writing it fails (as in a read-only folder)
    assert call_cost(model, folder, prompt_len=8, repeats=2).per_token_s >= 0
    assert blocked.is_dir()


def test_round_plans_maximise_levels_per_second() -> None:
    from recspec.decoding.tree_plan import Acceptance, plan_round

    cost = CallCost(0.012, 0.0007)
    free = lambda n: 0.0  # noqa: E731
    perfect = plan_round(lambda j, n: 1.0, 4, cost, 10, free, (10, 15, 20))
    assert perfect.widths == (10, 10, 10) and perfect.steps == 4  # all levels at the narrowest width
    assert perfect.seconds == pytest.approx(cost.call_s(40))
    hopeless = plan_round(lambda j, n: 0.0, 4, cost, 10, free, (10, 20))
    assert hopeless.widths == () and hopeless.rate == pytest.approx(1 / cost.call_s(10))  # plain decoding
    # a width buys acceptance: 15 nodes for 0.9 against 10 for 0.5 (one level left to draft)
    table = Acceptance(({10: 0.5, 15: 0.9},))
    plan = plan_round(table, 2, cost, 10, free, (10, 15))
    assert plan.widths == (15,) and plan.steps == pytest.approx(1.9)
    assert table(1, 12) == 0.5 and table(1, 40) == 0.9 and table(1, 5) == 0.0 and table(3, 15) == 0.9
    assert Acceptance.from_json(table.to_json()) == table
    # a costly draft makes drafting lose: 20 ms per level against a 19 ms plain step
    assert plan_round(lambda j, n: 1.0, 4, cost, 10, lambda n: 0.02, (10,)).widths == ()
    # 16 rows per call: the per-node part grows 16-fold, so the plan stops drafting (alone it drafts)
    accept = lambda j, n: 0.8  # noqa: E731
    assert plan_round(accept, 3, cost, 10, free, (10,)).widths == (10, 10)
    assert plan_round(accept, 3, cost, 10, free, (10,), rows=16).widths == ()


def test_expected_seconds_of_a_batch_follow_the_plans() -> None:
    from recspec.auto import expected_seconds
    from recspec.decoding.tree_plan import Acceptance, CostPlanner

    cost, free = CallCost(0.012, 0.0007), CallCost(0.0, 0.0)

    def planner(rate: float) -> CostPlanner:
        table = Acceptance(({10: rate}, {10: rate}))
        return CostPlanner(table, table, cost, free, free, k=10, prompt_len=20, choices=(10,))

    # a perfect draft: one call over the prompt and two drafted levels
    assert expected_seconds(planner(1.0), 3, False, 0.0) == pytest.approx(cost.call_s(40))
    # a hopeless one: the plans draft nothing, which is tree-beam's prefill and two plain steps
    assert expected_seconds(planner(0.0), 3, False, 0.005) == pytest.approx(0.005 + cost.call_s(20) + 2 * cost.call_s(10))
    # a head: the prefill, then one call over the K pending beams and one drafted level
    assert expected_seconds(planner(1.0), 3, True, 0.0) == pytest.approx(cost.call_s(20) + cost.call_s(20))
    # half the rounds accepted: between the two, by the expectation over where each round stops
    half = expected_seconds(planner(0.5), 3, False, 0.0)
    assert cost.call_s(40) < half < cost.call_s(20) + 2 * cost.call_s(10)


def test_a_record_serves_only_its_own_key(tmp_path: Path) -> None:
    from recspec.calibration import kept_record

    calls = []
    measure = lambda: calls.append(1) or len(calls)  # noqa: E731
    path = tmp_path / "record.json"
    assert kept_record(path, {"a": 1, "b": 2}, measure) == 1
    assert kept_record(path, {"a": 1, "b": 2}, measure) == 1  # kept
    assert kept_record(path, {"a": 1}, measure) == 2  # a key with fewer fields is another key
    assert kept_record(path, {"a": 1}, measure, remeasure=True) == 3
