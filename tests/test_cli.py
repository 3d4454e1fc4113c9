"""The two entry points a user runs first: ``fsdp-builder demo`` and its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from fsdp_builder.cli import DEMO_SEED
from fsdp_builder.demo import DemoConfig, deterministic_model, reference


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_builder.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_demo_json_report_matches_reference() -> None:
    proc = run_cli("demo", "--json", "--strategy", "grad_op")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["backend"] == "fsdp1"
    assert report["strategy"] == "SHARD_GRAD_OP"
    assert [s["name"] for s in report["stages"]] == ["materialize", "move", "synchronize", "shard"]
    assert all(s["seconds"] >= 0 and s["peak_bytes"] > 0 for s in report["stages"])
    ref = reference(deterministic_model(seed=DEMO_SEED), DemoConfig(), 3, 2)
    for rank, losses in enumerate(report["losses_per_rank"]):
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref["losses"][rank]), atol=1e-5)


def test_demo_prints_readable_report() -> None:
    proc = run_cli("demo", "--world-size", "2", "--strategy", "none")
    assert proc.returncode == 0, proc.stderr
    assert "build report: backend=fsdp1 strategy=NO_SHARD" in proc.stdout
    assert "rank 1 losses:" in proc.stdout and "totals:" in proc.stdout


def test_bad_arguments_exit_with_usage() -> None:
    proc = run_cli("demo", "--strategy", "diagonal")
    assert proc.returncode == 2 and "invalid choice: 'diagonal'" in proc.stderr


def test_demo_under_torchrun_uses_its_environment() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",  # torchrun picks its own free port: no race with other tests
            "-m",
            "fsdp_builder.cli",
            "demo",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and "losses_per_rank" not in report
    ref = reference(deterministic_model(seed=DEMO_SEED), DemoConfig(), 3, 2)
    assert torch.allclose(torch.tensor(report["losses"]), torch.tensor(ref["losses"][0]), atol=1e-5)
