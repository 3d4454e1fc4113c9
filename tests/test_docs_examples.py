"""The code blocks of docs/strategies.md marked ``<!-- runnable: NAME -->`` run as written.

Each block is executed in a one-rank gloo world, in a fresh namespace; a check per block then
asserts that the custom strategy it defines was really used by the build.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

DOC = Path(__file__).resolve().parent.parent / "docs" / "strategies.md"
BLOCK = re.compile(r"<!-- runnable: (?P<name>[\w-]+) -->\s*\n```python\n(?P<code>.*?)\n```", re.S)


def runnable_blocks() -> dict[str, str]:
    blocks: dict[str, str] = {}
    for match in BLOCK.finditer(DOC.read_text()):
        assert match["name"] not in blocks, f"duplicate runnable block {match['name']!r}"
        blocks[match["name"]] = match["code"]
    return blocks


def check_device(ns: dict[str, Any]) -> None:
    assert ns["builder"].environment.device == torch.device("cpu")


def check_groups(ns: dict[str, Any]) -> None:
    group = ns["builder"].environment.groups.shard_group
    assert isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD
    assert "cannot serve HYBRID_SHARD" in ns["refusal"]


def check_materializer(ns: dict[str, Any]) -> None:
    assert ns["materialized"] == ["0", "2"]
    params = list(ns["sharded"].parameters())
    assert params and not any(p.is_meta for p in params)
    out = ns["sharded"](torch.ones(1, 8))
    assert out.shape == (1, 2) and bool(torch.isfinite(out).all())


def check_broadcast(ns: dict[str, Any]) -> None:
    assert ns["synchronized"] == ["0", "2", "<root>"]
    comm = [r.comm_bytes for r in ns["builder"].report.records if r.stage == "synchronize"]
    assert comm == [(8 * 8 + 8) * 4, (8 * 2 + 2) * 4, 0]


def check_verify(ns: dict[str, Any]) -> None:
    assert ns["checked"] == ["<root>"]


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "device": check_device,
    "groups": check_groups,
    "materializer": check_materializer,
    "broadcast": check_broadcast,
    "verify": check_verify,
}


@pytest.fixture
def one_rank_world(world1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared one-rank world, without a device override from the environment."""
    monkeypatch.delenv("TRAIN_DEVICE", raising=False)


def test_every_runnable_block_has_a_check() -> None:
    assert sorted(runnable_blocks()) == sorted(CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_runnable_block(name: str, one_rank_world: None) -> None:
    code = runnable_blocks()[name]
    namespace: dict[str, Any] = {"__name__": f"docs_strategies_{name}"}
    with warnings.catch_warnings():
        # One rank: the builder switches to NO_SHARD and says so.
        warnings.filterwarnings("ignore", message="Using NO_SHARD", category=UserWarning)
        exec(compile(code, f"{DOC}:{name}", "exec"), namespace)
    CHECKS[name](namespace)
