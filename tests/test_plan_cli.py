"""``fsdp-builder plan``: the printed plan and estimates agree with the real model."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from fsdp_builder.cli import main
from fsdp_builder.demo import DemoTransformer, demo_model

MIB = 1024 * 1024


def _plan_rows(text: str) -> dict[str, tuple[int, int]]:
    rows: dict[str, tuple[int, int]] = {}
    for line in text.splitlines()[1:]:
        if not line.strip():
            break
        name, params, nbytes = line.split()[:3]
        rows[name] = (int(params.replace(",", "")), int(nbytes.replace(",", "")))
    return rows


def _estimate_rows(text: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 7 and parts[0] in ("fsdp1", "fsdp2"):
            rows[(parts[0], parts[1])] = parts[2:]
    return rows


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model() -> DemoTransformer:
    return demo_model()


@pytest.mark.parametrize("world", [2, 4])
def test_plan_numbers_match_the_model(
    model: DemoTransformer, world: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            ["plan", "fsdp_builder.demo:demo_model", "--wrap", "Block", "--world-size", str(world)]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = _plan_rows(out)

    blocks = {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    assert list(rows) == [*blocks, "<root>", "total"]  # bottom-up, root last
    for name, block in blocks.items():
        assert rows[name] == (_numel(block), _numel(block) * 4)
    total = _numel(model)
    root = total - sum(_numel(b) for b in blocks.values())
    assert rows["<root>"] == (root, root * 4)
    assert rows["total"] == (total, total * 4)

    est = _estimate_rows(out)
    units = [list(b.parameters()) for b in blocks.values()]
    block_ids = {id(p) for ps in units for p in ps}
    units.append([p for p in model.parameters() if id(p) not in block_ids])
    # FSDP1 keeps ceil(unit numel / W) of each flat parameter; FSDP2 ceil(rows / W) of each.
    fsdp1 = sum(_ceil_div(sum(p.numel() for p in ps), world) * 4 for ps in units)
    fsdp2 = sum(
        _ceil_div(p.shape[0], world) * (p.numel() // p.shape[0]) * 4 for p in model.parameters()
    )
    assert est[("fsdp1", "full")][:2] == [str(world), f"{fsdp1 / MIB:.2f}"]
    assert est[("fsdp2", "full")][:2] == [str(world), f"{fsdp2 / MIB:.2f}"]
    assert est[("fsdp2", "none")][1] == f"{total * 4 / MIB:.2f}"
    # Shard-first holds only the shards; a per-unit build adds at most about two units.
    assert est[("fsdp2", "full")][3] == est[("fsdp2", "full")][1]
    largest = max(_numel(b) for b in blocks.values()) * 4
    assert float(est[("fsdp1", "full")][2]) <= (fsdp1 + 2 * largest) / MIB + 0.01
    assert "hybrid: shard groups of" in out


def test_plan_console_command(model: DemoTransformer) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_builder.cli",
            "plan",
            "fsdp_builder.demo:demo_model",
            "--wrap",
            "Block",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert _plan_rows(proc.stdout)["total"][0] == _numel(model)


def test_plan_rejects_unknown_wrap_class() -> None:
    with pytest.raises(SystemExit, match="no module of that class"):
        main(["plan", "fsdp_builder.demo:demo_model", "--wrap", "Nope"])
