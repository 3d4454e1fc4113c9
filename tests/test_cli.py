"""The entry points a user runs first: ``python -m fsdp_builder demo``, its JSON report, the
torchrun form, the help texts and ``bench``'s checks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import deterministic_model, reference

from fsdp_builder.tools.cli import DEMO_SEED, build_parser, main
from fsdp_builder.tools.demo import DemoConfig

# What these tests start runs ranks (torchrun, the command line, the harness) on both cores.
pytestmark = pytest.mark.cores(2)

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_builder", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=cwd,
    )


def reference_losses(steps: int, world: int) -> list[list[float]]:
    ref = reference(
        deterministic_model(seed=DEMO_SEED), DemoConfig(), steps, world, fixed_batch=True
    )
    losses: list[list[float]] = ref["losses"]
    return losses


def assert_no_python_warnings(stderr: str) -> None:
    assert "Warning" not in stderr, stderr


@pytest.mark.timeout(240)
def test_demo_json_report_matches_reference() -> None:
    proc = run_cli("demo", "--json", "--strategy", "grad_op")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["backend"] == "fsdp1"
    assert report["strategy"] == "SHARD_GRAD_OP"
    assert [s["name"] for s in report["stages"]] == ["materialize", "move", "synchronize", "shard"]
    assert all(s["seconds"] >= 0 and s["peak_bytes"] > 0 for s in report["stages"])
    ref = reference_losses(3, 2)
    for rank, losses in enumerate(report["losses_per_rank"]):
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref[rank]), atol=1e-5)
        assert losses == sorted(losses, reverse=True), "a fixed batch: the losses fall"
    # Progress goes to stderr, the report alone to stdout.
    assert "starting 2 rank(s)" in proc.stderr and "training 3 step(s)" in proc.stderr
    assert_no_python_warnings(proc.stderr)


@pytest.mark.timeout(240)
def test_demo_prints_readable_report_with_no_steps() -> None:
    proc = run_cli("demo", "--world-size", "2", "--backend", "fsdp2", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    assert "build report: backend=fsdp2 strategy=FULL_SHARD" in proc.stdout
    assert "no training steps (--steps 0)" in proc.stdout and "totals:" in proc.stdout
    assert "losses:" not in proc.stdout
    assert "training" not in proc.stderr
    # FSDP2's warning about views returned by wrapped modules is filtered (see cli.py).
    assert_no_python_warnings(proc.stderr)


@pytest.mark.timeout(240)
def test_demo_with_activation_checkpointing_and_compile_trains_the_same(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Run in this process: the report's values are the subject (the tests above run the command).
    args = ["demo", "--json", "--backend", "fsdp2", "--activation-checkpointing", "--compile"]
    assert main([*args, "eager", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["activation_checkpointing"] is True and report["compile"] == "eager"
    ref = reference_losses(3, 2)
    for rank, losses in enumerate(report["losses_per_rank"]):
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref[rank]), atol=1e-5)


@pytest.mark.timeout(240)
def test_demo_under_torchrun_reports_every_rank() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",  # torchrun picks its own free port: no race with other tests
            "-m",
            "fsdp_builder",
            "demo",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "only rank 0 prints"
    report = json.loads(lines[0])
    assert report["world_size"] == 2
    ref = reference_losses(3, 2)
    assert len(report["losses_per_rank"]) == 2
    for rank, losses in enumerate(report["losses_per_rank"]):
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref[rank]), atol=1e-5)
    assert report["losses"] == report["losses_per_rank"][0]
    assert_no_python_warnings(proc.stderr)


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["demo", "--strategy", "diagonal"], "invalid choice: 'diagonal'"),
        (["demo", "--steps", "-1"], "--steps must be at least 0"),
        (["demo", "--world-size", "0"], "--world-size must be at least 1"),
        (["plan", "x:y", "--optimizer", "lion"], "invalid choice: 'lion'"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_subcommand_and_option_has_help() -> None:
    parser = build_parser()
    subs = _subparsers(parser)
    assert sorted(subs) == ["bench", "demo", "plan"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            assert all(helps.get(name) for name in subs), helps
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_python_dash_m_help_shows_the_torchrun_form() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "torchrun --nproc-per-node 2 -m fsdp_builder demo" in proc.stdout


def test_bench_outside_a_checkout_says_where_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="run it from a checkout of the repository"):
        main(["bench", "--smoke"])


def test_bench_names_missing_extras_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def without_matplotlib(name: str, *args: object) -> object:
        return None if name == "matplotlib" else real(name)

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(importlib.util, "find_spec", without_matplotlib)
    # The harness must not even be imported (it would start timing work).
    monkeypatch.delitem(sys.modules, "benchmarks.harness", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["bench", "--smoke"])
    assert "needs matplotlib" in str(info.value)
    assert "pip install -e '.[bench]'" in str(info.value)
    assert "benchmarks.harness" not in sys.modules
