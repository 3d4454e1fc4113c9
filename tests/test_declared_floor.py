"""What setup.cfg declares about torch matches what the committed compatibility run proves.
Not part of the compatibility subset itself: it reads the matrix that subset writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fsdp_builder import versions

ROOT = Path(__file__).resolve().parents[1]


def test_the_declared_floor_is_the_oldest_green_release_of_the_committed_matrix() -> None:
    """setup.cfg declares what a committed compatibility run proves: the oldest release whose
    subset passed, with every release above it that was run green as well."""
    text = (ROOT / "setup.cfg").read_text()
    floor = versions.parse_release(re.search(r"torch>=([\d.]+)", text).group(1))  # type: ignore[union-attr]
    records = json.loads((ROOT / "benchmarks/results/compat.json").read_text())["releases"]
    green = sorted(
        versions.parse_release(release)
        for release, record in records.items()
        if record["exit_code"] == 0 and record["failed"] == 0 and record["errors"] == 0
    )
    assert green, "the matrix has no green release"
    assert floor == green[0], f"setup.cfg declares {floor}, the oldest green release is {green[0]}"
    ran_above = [versions.parse_release(r) for r in records if versions.parse_release(r) >= floor]
    assert sorted(ran_above) == [g for g in green if g >= floor], "a release above the floor is red"
