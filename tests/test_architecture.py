"""The contract between the pipeline and the strategies: declared hooks, per-build runs, quiet
logging, and what the wheel installs."""

from __future__ import annotations

import ast
import copy
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from helpers import full_state_dict
from models import demo_units, eager_init_by_unit, meta_demo
from torch import nn

from fsdp_builder import (
    BaseMaterializer,
    BaseSynchronizer,
    BroadcastFromRank0,
    ConfigurationError,
    CPUDevice,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    ResetParameters,
    VerifyReplicas,
)
from fsdp_builder.materializers.initializers import Materializer
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer

CFG = DemoConfig(vocab=32, dim=16, heads=2, layers=2, seq=4)
ROOT = Path(__file__).resolve().parents[1]


# -- declared hooks ---------------------------------------------------------------------------


def test_a_misspelled_hook_is_refused_when_the_class_is_made() -> None:
    misspelled = r"`Quiet.communicate`.*did you mean `communicates`"
    with pytest.raises(ConfigurationError, match=misspelled):

        class Quiet(BaseMaterializer):
            communicate = False

    with pytest.raises(ConfigurationError, match=r"`Sync.synchronise`.*did you mean `synchronize`"):

        class Sync(BaseSynchronizer):
            def synchronise(self, unit: Any, env: Any) -> int:
                return 0


def test_helpers_far_from_any_hook_name_are_accepted() -> None:
    class Mine(BaseMaterializer):
        scale = 0.5

        def init_module(self, module: nn.Module, fqn: str) -> None:
            return None

    assert Mine().scale == 0.5


def test_a_protocol_implementation_missing_a_hook_is_named() -> None:
    class Bare:
        """The old two-method shape, without the declared hooks."""

        def check(self, plan: Any, ignored: Any) -> None:
            return None

        def materialize(self, unit: Any, env: Any) -> int:
            return 0

    assert not isinstance(Bare(), Materializer)
    lacks = r"lacks check_context, communicates, prepare, shard_first"
    with pytest.raises(ConfigurationError, match=lacks):
        FSDPBuilder().materialize(Bare())  # type: ignore[arg-type]


def test_a_class_where_an_instance_is_expected_says_how_to_make_one() -> None:
    with pytest.raises(ConfigurationError, match=r"Did you mean `ResetParameters\(\)`"):
        FSDPBuilder().materialize(ResetParameters)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"Did you mean `BroadcastFromRank0\(\)`"):
        FSDPBuilder().synchronize(BroadcastFromRank0)  # type: ignore[arg-type]


def test_no_hook_of_ours_is_looked_up_with_getattr() -> None:
    hooks = (
        "prepare",
        "communicates",
        "shard_first",
        "supports_shard_first",
        "shard_communicates",
        "prepare_groups",
    )
    found = [
        f"{path.name}: {line.strip()}"
        for path in (ROOT / "fsdp_builder").rglob("*.py")
        for line in path.read_text().splitlines()
        if "getattr(" in line and any(f'"{h}"' in line for h in hooks)
    ]
    assert not found, found


def test_shard_first_has_one_name_and_the_earlier_ones_still_answer(world1: None) -> None:
    """``Environment.shard_first`` / ``shard_first_for(unit)``; ``shards_first`` and
    ``sharded_first(unit)``, the names before them, give the same answers with a warning."""
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).sharding("none")
    with torch.device("meta"):
        model = DemoTransformer(CFG)
    builder.build(model)
    env = builder.environment
    assert env is not None
    root = env.plan.root
    with pytest.warns(DeprecationWarning, match=r"Environment.shards_first.*shard_first") as seen:
        assert env.shards_first == env.shard_first
    with pytest.warns(DeprecationWarning, match=r"sharded_first\(unit\).*shard_first_for"):
        assert env.sharded_first(root) == env.shard_first_for(root)
    assert seen[0].filename == __file__  # pointed at the caller


# -- per-build state ------------------------------------------------------------------------


def test_strategies_shared_by_cloned_builders_keep_no_state(world1: None) -> None:
    torch.manual_seed(0)
    source = full_state_dict(DemoTransformer(CFG))
    load = FromStateDict(source)
    sync = BroadcastFromRank0(bucket_bytes=1024)
    verify = VerifyReplicas()
    snapshot = copy.deepcopy((sync, verify))
    tensors = {k: v.clone() for k, v in source.items()}
    first = FullyShardBuilder().device(CPUDevice()).wrap(Block).sharding("none")
    first.materialize(load).synchronize(sync, verify)
    twin = first.clone()
    for builder in (first, twin):
        model = builder.build(meta_demo(CFG))
        got = full_state_dict(model)
        assert got.keys() == source.keys()
        assert all(torch.equal(got[k], source[k]) for k in source)
    # The same objects, unchanged: nothing of either build stayed on them.
    assert (sync, verify) == snapshot
    assert load.source is source and all(torch.equal(source[k], tensors[k]) for k in tensors)
    for strategy in (load, sync, verify):
        assert not hasattr(strategy, "__dict__"), type(strategy).__name__


class _FailAtRoot(BaseSynchronizer):
    communicates = False

    def synchronize(self, unit: Any, env: Any) -> int:
        if unit.is_root:
            raise RuntimeError("planted failure at the root unit")
        return 0


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_failing_build_closes_the_checkpoint_on_rank_0(world1: None, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file(full_state_dict(DemoTransformer(CFG)), str(path))
    builder = (
        FSDPBuilder()
        .device(CPUDevice())
        .wrap(Block)
        .sharding("none")
        .materialize(FromStateDict(path))
        .synchronize(_FailAtRoot())
    )
    with pytest.raises(RuntimeError, match="planted failure at the root unit"):
        builder.build(meta_demo(CFG))
    assert not _mapped(path)
    # The same source still loads once the failure is gone: nothing was left open or half-set.
    ok = FSDPBuilder().device(CPUDevice()).wrap(Block).sharding("none")
    ok.materialize(FromStateDict(path)).build(meta_demo(CFG))
    assert not _mapped(path)


# -- logging --------------------------------------------------------------------------------

_BUILD = textwrap.dedent(
    """
    import logging, os, sys
    import torch.distributed as dist
    from fsdp_builder import CPUDevice, FSDPBuilder
    from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer

    if sys.argv[1] == "debug":
        logging.basicConfig(level=logging.DEBUG)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = DemoConfig(vocab=32, dim=16, heads=2, layers=2, seq=4)
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).sharding("none")
    builder.build(DemoTransformer(cfg))
    # What the build printed is all there is to see: leave without torch's C++ teardown, which
    # under load has aborted the interpreter at exit ("terminate called without an active
    # exception") after a build that printed nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def _run_build(mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    return subprocess.run(
        [sys.executable, "-c", _BUILD, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.mark.timeout(150)
def test_a_build_prints_nothing_without_logging_configuration() -> None:
    done = _run_build("quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == ""


@pytest.mark.timeout(150)
def test_stdlib_debug_logging_shows_the_build_events_with_rank_and_unit() -> None:
    done = _run_build("debug")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    stages = [line for line in lines if "fsdp_builder" in line and "build_stage" in line]
    # Three units (two blocks and the root), four stages each.
    assert len(stages) == 12, done.stderr
    assert all("rank=0" in line and "world_size=1" in line for line in stages)
    assert any("unit='blocks.0'" in line for line in stages)
    assert "event='build_done'" in done.stderr


def test_a_configured_structlog_gets_the_events(world1: None) -> None:
    from structlog.testing import capture_logs

    with capture_logs() as events:
        FSDPBuilder().device(CPUDevice()).wrap(Block).sharding("none").build(DemoTransformer(CFG))
    stages = [e for e in events if e["event"] == "build_stage"]
    assert len(stages) == 12
    assert all(e["rank"] == 0 and e["world_size"] == 1 and "unit" in e for e in stages)


def test_a_logger_that_drops_debug_gets_no_stage_events_and_the_report_is_whole(
    world1: None,
) -> None:
    """Stage events are built only for a logger that passes debug events on; the records
    (what ``report`` holds) do not depend on it."""
    import logging

    from structlog.testing import capture_logs

    # Undone after the test by conftest's _structlog_defaults.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).sharding("none")
    with capture_logs() as events:
        builder.build(DemoTransformer(CFG))
    assert [e for e in events if e["event"] == "build_stage"] == []
    assert [e["event"] for e in events if e["event"] == "build_done"] == ["build_done"]
    records = [(r.unit, r.stage) for r in builder.report.records]
    assert records == [
        (unit, stage)
        for unit in ("blocks.0", "blocks.1", "<root>")
        for stage in ("materialize", "move", "synchronize", "shard")
    ]
    assert all(r.peak_bytes > 0 for r in builder.report.records)


@pytest.mark.parametrize("route", ["captured", "filtered"])
def test_initial_weights_are_unchanged_by_the_logging_route(world1: None, route: str) -> None:
    """Events are side effects only: whether they are built and captured (a debug logger) or
    never built (a logger that drops debug), the weights are plain PyTorch's from the same seed
    (so building the events draws no random number either)."""
    import logging

    from structlog.testing import capture_logs

    if route == "filtered":  # undone after the test by conftest's _structlog_defaults
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).sharding("none")
    torch.manual_seed(3)
    with capture_logs() as events:
        built = full_state_dict(builder.materialize(ResetParameters()).build(meta_demo(CFG)))
    stages = [e for e in events if e["event"] == "build_stage"]
    assert len(stages) == (12 if route == "captured" else 0)
    expected = meta_demo(CFG)
    torch.manual_seed(3)
    eager_init_by_unit(demo_units(expected))
    assert built.keys() == expected.state_dict().keys()
    assert all(torch.equal(built[k], v) for k, v in expected.state_dict().items())


# -- imports -----------------------------------------------------------------------------------


def _tools_imports() -> dict[str, set[str]]:
    """Each module of fsdp_builder.tools and the modules of fsdp_builder.tools it imports,
    imports inside functions included (a lazy import is still a dependency)."""
    folder = ROOT / "fsdp_builder" / "tools"
    modules = {path.stem for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        named: list[str] = []
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "fsdp_builder.tools":
                named += [f"fsdp_builder.tools.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                named.append(node.module)
            elif isinstance(node, ast.Import):
                named += [alias.name for alias in node.names]
        graph[name] = {
            n.split(".")[2] for n in named if n.startswith("fsdp_builder.tools.")
        } & modules - {name}
    return graph


def test_no_import_cycle_among_the_tools_modules() -> None:
    graph = _tools_imports()
    assert "dryrun" in graph["cli"]  # the command line runs the dry run, a library module
    in_cycle = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        if start in seen:
            in_cycle.append(start)
    assert not in_cycle, {m: sorted(graph[m]) for m in in_cycle}


# -- packaging ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_wheel_installs_the_library_only(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("fsdp_builder-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"fsdp_builder"}, sorted(packages)
    assert "fsdp_builder/py.typed" in names
