"""``run_ranks``' shared cores: with ``$FSDP_BUILDER_RANK_SLOTS`` set, a launch holds its share
of the machine's cores (lock files) while its ranks run, and a test holds one while it runs
(handed back while a launch of its own runs), so the test run's workers and their launches
never run more processes than cores at once."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import fsdp_builder.tools.launch as launch
from fsdp_builder.tools.launch import RANK_SLOTS, own_cores, rank_slots, run_ranks

pytestmark = pytest.mark.timeout(120)


def _locked(path: Path) -> bool:
    """Whether another open file description holds ``path``'s lock."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _held(prefix: Path, cores: int) -> list[bool]:
    return [_locked(Path(f"{prefix}.{i}")) for i in range(cores)]


@pytest.fixture()
def slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], Path]:
    """Slots of a machine of ``cores`` cores, in this test's own folder."""

    def make(cores: int) -> Path:
        prefix = tmp_path / "slots"
        monkeypatch.setenv(RANK_SLOTS, str(prefix))
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        return prefix

    return make


def test_a_launch_holds_one_slot_per_rank_up_to_the_cores(slots: Callable[[int], Path]) -> None:
    prefix = slots(3)
    with rank_slots(2) as held:
        assert held == 2
        assert _held(prefix, 3) == [True, True, False]
    assert _held(prefix, 3) == [False, False, False]
    with rank_slots(8) as held:  # more ranks than cores: every core's slot
        assert held == 3
        assert _held(prefix, 3) == [True, True, True]


def test_without_the_variable_nothing_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RANK_SLOTS, raising=False)
    with rank_slots(2) as held:
        assert held == 0


def _rank_view(prefix: str) -> tuple[str | None, bool]:
    """What a rank sees: the variable (removed for its own launches) and slot 0's lock."""
    return os.environ.get(RANK_SLOTS), _locked(Path(f"{prefix}.0"))


def test_ranks_run_while_their_launch_holds_the_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = str(tmp_path / "slots")
    monkeypatch.setenv(RANK_SLOTS, prefix)
    views = run_ranks(_rank_view, 2, prefix, timeout=90)
    assert views == [(None, True), (None, True)]
    assert not _locked(Path(f"{prefix}.0"))


def test_a_launch_hands_back_its_process_core_while_its_ranks_run(
    slots: Callable[[int], Path],
) -> None:
    prefix = slots(3)
    # This test's own cores, not the run's: those are set aside until it ends.
    cores = launch._CORES
    saved = cores.own, cores.prefix
    cores.own = []
    try:
        with own_cores() as own:
            assert own == 1
            assert _held(prefix, 3) == [True, False, False]
            with rank_slots(3) as held:  # all three: the process's own core among them
                assert held == 3
                assert cores.own == []
            assert _held(prefix, 3) == [True, False, False]
            with own_cores() as again:  # held already: nothing more
                assert again == 0
        assert _held(prefix, 3) == [False, False, False]
    finally:
        cores.own, cores.prefix = saved


def test_a_launch_that_cannot_have_its_cores_starts_with_those_it_holds(
    slots: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core that never comes free (a process waiting for this launch holds it) delays the
    launch by SLOT_WAIT_SECONDS, then it starts with the others."""
    prefix = slots(2)
    monkeypatch.setattr(launch, "SLOT_WAIT_SECONDS", 0.2)
    with open(f"{prefix}.0", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        with rank_slots(2) as held:
            assert held == 1
            assert _locked(Path(f"{prefix}.1"))


def test_a_test_holds_a_core_while_it_runs() -> None:
    """The test run's own setting: this test holds one core of the run's slots."""
    if not launch._slot_prefix():
        pytest.skip("the run shares no cores here (no flock)")
    assert len(launch._CORES.own) == 1


@pytest.mark.cores(2)
def test_a_test_marked_with_cores_holds_them_and_its_children_take_none() -> None:
    assert len(launch._CORES.own) == min(2, os.cpu_count() or 1)
    assert RANK_SLOTS not in os.environ
