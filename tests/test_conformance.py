"""The conformance matrix (``conformance.py``): a pairwise cover of its axes in the default run,
the full product behind ``-m conformance_full``. Each cell's ranks build, gather and train once;
the cell must equal its plain-PyTorch oracle or be refused as the oracle says, on every rank.
One spawn per world size runs all of that world's cells; none may hang (the builds are bounded
with ``.timeout`` and every spawn with a deadline)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conformance import (
    Cell,
    Expected,
    anchors,
    expected,
    full_product,
    judge,
    judge_across,
    pairwise,
    rank_cells,
    write_checkpoints,
)
from isolated import Spawns, values

PAIRWISE = pairwise()
FULL = full_product()
# World-size-1 builds that the draws promised equal everywhere are compared with.
ANCHORED = PAIRWISE + [c for c in anchors() if c not in PAIRWISE]


class Matrix:
    """The oracles of a set of cells, and one spawn per world size that runs them."""

    def __init__(self, cells: list[Cell], timeout: float) -> None:
        self.cells = cells
        self._expected: dict[Cell, Expected] = {}
        self.spawns = Spawns(rank_cells, timeout=timeout)
        self._paths: dict[str, str] | None = None

    def expected(self, cell: Cell) -> Expected:
        if cell not in self._expected:
            self._expected[cell] = expected(cell)
        return self._expected[cell]

    def paths(self, folder: Path) -> dict[str, str]:
        if self._paths is None:
            self._paths = write_checkpoints(folder)
        return self._paths

    def results(self, cell: Cell, folder: Path) -> list[dict]:
        cells = [(c, self.expected(c).local) for c in self.cells if c.world == cell.world]
        return values(self.spawns(cell.world, cells, self.paths(folder)), cell.key)

    def across(self, folder: Path) -> dict[Cell, str]:
        """The verdicts of :func:`judge_across` over every cell that built on every rank."""
        judged: dict[Cell, tuple[Expected, list[dict] | None]] = {}
        for cell in self.cells:
            try:
                judged[cell] = (self.expected(cell), self.results(cell, folder))
            except pytest.fail.Exception:
                judged[cell] = (self.expected(cell), None)  # its own test reports it
        return judge_across(judged)


DEFAULT = Matrix(ANCHORED, timeout=600)
# The full product: about an hour on 2 cores (benchmarks/results/conformance.md).
EVERY = Matrix(FULL, timeout=4 * 3600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cell", ANCHORED, ids=[c.key for c in ANCHORED])
def test_pairwise_cell_equals_its_oracle(cell: Cell, folder: Path) -> None:
    verdict = judge(cell, DEFAULT.expected(cell), DEFAULT.results(cell, folder))
    assert verdict is None, verdict


@pytest.mark.timeout(900)
def test_draws_promised_equal_are_equal_across_cells(folder: Path) -> None:
    """``DeterministicInit`` and ``StreamInit`` (FSDP2's default): the same full weights at
    every world size, on both backends and in every group layout of the default run."""
    wrong = DEFAULT.across(folder)
    assert not wrong, "\n".join(f"{c.key}: {why}" for c, why in wrong.items())


@pytest.mark.conformance_full
@pytest.mark.timeout(4 * 3600)
def test_full_draws_promised_equal_are_equal_across_cells(folder: Path) -> None:
    wrong = EVERY.across(folder)
    assert not wrong, "\n".join(f"{c.key}: {why}" for c, why in wrong.items())


@pytest.mark.conformance_full
@pytest.mark.timeout(4 * 3600)
@pytest.mark.parametrize("cell", FULL, ids=[c.key for c in FULL])
def test_full_cell_equals_its_oracle(cell: Cell, folder: Path) -> None:
    verdict = judge(cell, EVERY.expected(cell), EVERY.results(cell, folder))
    assert verdict is None, verdict


def test_the_cover_holds_every_pair() -> None:
    """The default run's cells cover every pair of axis values that some valid cell has."""
    n = len(Cell._fields)
    every = {(i, c[i], j, c[j]) for c in FULL for i in range(n) for j in range(i + 1, n)}
    covered = {(i, c[i], j, c[j]) for c in PAIRWISE for i in range(n) for j in range(i + 1, n)}
    assert every == covered
