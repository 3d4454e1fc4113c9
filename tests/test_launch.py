"""``run_ranks``' shared cores: with ``$FSDP_BUILDER_RANK_SLOTS`` set, a launch holds its share
of the machine's cores (lock files) while its ranks run, so launches from several processes (the
test run's workers) never start more ranks than cores at once."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from fsdp_builder.tools.launch import RANK_SLOTS, rank_slots, run_ranks

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


def test_a_launch_holds_one_slot_per_rank_up_to_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = tmp_path / "slots"
    monkeypatch.setenv(RANK_SLOTS, str(prefix))
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    with rank_slots(2) as held:
        assert held == 2
        assert [_locked(Path(f"{prefix}.{i}")) for i in range(3)] == [True, True, False]
    assert not any(_locked(Path(f"{prefix}.{i}")) for i in range(3))
    with rank_slots(8) as held:  # more ranks than cores: every core's slot
        assert held == 3
        assert all(_locked(Path(f"{prefix}.{i}")) for i in range(3))


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
