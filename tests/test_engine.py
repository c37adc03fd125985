"""The engine's round loop (recspec.decoding.engine.run) over a scripted search: the order of a
round's parts, rows leaving as they finish, the clock's phases. The searches it drives over real
models (items and text) are tested for their outputs in test_speculative, test_dsbd,
test_knowledge_decode, test_text_head, test_specsample and test_tree_sample."""

from __future__ import annotations

import torch

from recspec.decoding.engine import Clock, run


class ScriptedSearch:
    """Rows that finish after their own number of rounds (``rounds_left``); every call logged."""

    def __init__(self, rounds_left: list[int]) -> None:
        self.left = torch.tensor(rounds_left)
        self.rows = list(range(len(rounds_left)))
        self.log: list[tuple] = []

    def draft(self) -> list[int]:
        self.log.append(("draft", tuple(self.rows)))
        return list(self.rows)

    def score(self, draft: list[int]) -> str:
        self.log.append(("score", tuple(draft)))
        return "scored"

    def verify(self, draft: list[int], scored: str) -> str:
        assert scored == "scored"
        self.log.append(("verify", tuple(draft)))
        return "outcome"

    def advance(self, draft: list[int], scored: str, outcome: str) -> torch.Tensor:
        assert outcome == "outcome"
        self.left -= 1
        return self.left == 0

    def settle(self, finished: torch.Tensor) -> bool:
        self.log.append(("settle", tuple(row for row, done in zip(self.rows, finished.tolist()) if done)))
        keep = ~finished
        self.left, self.rows = self.left[keep], [row for row, kept in zip(self.rows, keep.tolist()) if kept]
        return bool(self.rows)


def test_rows_leave_as_they_finish_and_the_loop_ends_with_the_last() -> None:
    search = ScriptedSearch([2, 1, 3])
    run(search, Clock(torch.device("cpu")), torch.zeros(3, dtype=torch.bool))
    assert search.log == [
        ("settle", ()),
        ("draft", (0, 1, 2)), ("score", (0, 1, 2)), ("verify", (0, 1, 2)), ("settle", (1,)),
        ("draft", (0, 2)), ("score", (0, 2)), ("verify", (0, 2)), ("settle", (0,)),
        ("draft", (2,)), ("score", (2,)), ("verify", (2,)), ("settle", (2,)),
    ]


def test_rows_finished_by_the_prefill_never_draft() -> None:
    search = ScriptedSearch([1, 1])
    run(search, Clock(torch.device("cpu")), torch.tensor([True, False]))
    assert search.log[0] == ("settle", (0,))
    assert [entry for entry in search.log if entry[0] == "draft"] == [("draft", (1,))]

    done = ScriptedSearch([1])
    run(done, Clock(torch.device("cpu")), torch.tensor([True]))
    assert done.log == [("settle", (0,))]


def test_the_clock_sums_each_phase_and_keeps_the_last_reading() -> None:
    clock = Clock(torch.device("cpu"))
    search = ScriptedSearch([3])
    run(search, clock, torch.zeros(1, dtype=torch.bool))
    assert clock.seconds["prefill"] == 0.0
    assert clock.seconds["draft"] >= clock.last["draft"] >= 0.0
    assert clock.seconds["verify"] >= clock.last["verify"] >= 0.0
    assert set(clock.last) == {"draft", "verify"}
