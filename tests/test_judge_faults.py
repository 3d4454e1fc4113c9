"""The conformance judge is itself tested: honest results of a few cells pass, and each planted
fault (``judge_faults.py``) is reported wrong."""

from __future__ import annotations

import pytest
from conformance import Cell, Expected, expected, judge, judge_across
from judge_faults import (
    ANCHORS,
    BROADCAST,
    CELLS,
    FAULTS,
    REFUSED,
    Fault,
    Results,
    honest_results,
    verdict,
)


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> dict[Cell, Results]:
    return honest_results(tmp_path_factory.mktemp("judge_faults"), timeout=600)


@pytest.mark.timeout(900)
def test_honest_results_are_judged_right(honest: dict[Cell, Results]) -> None:
    for cell in CELLS + ANCHORS:
        assert judge(cell, expected(cell), honest[cell]) is None, cell.key
    judged: dict[Cell, tuple[Expected, Results | None]] = {
        c: (expected(c), results) for c, results in honest.items()
    }
    assert judge_across(judged) == {}


@pytest.mark.timeout(900)
def test_the_collective_count_sees_collectives(honest: dict[Cell, Results]) -> None:
    """The count a refusal is held to is not blind: a broadcast build shows its broadcasts,
    and the refused build the agreement's gathers, told apart."""
    assert "broadcast" in honest[BROADCAST][0]["collectives"]
    refused = honest[REFUSED]
    assert all(r["agreements"] > 0 and r["collectives"] == [] for r in refused)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_a_planted_fault_is_reported_wrong(fault: Fault, honest: dict[Cell, Results]) -> None:
    assert verdict(fault, honest) is not None, f"the judge accepted: {fault.name}"


def test_every_fault_plants_something() -> None:
    """A fault's cell is one the honest run has (so the fault is fed real results)."""
    assert {f.cell for f in FAULTS} <= set(CELLS)
