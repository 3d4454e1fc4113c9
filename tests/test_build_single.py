"""Builds in a one-rank world: build-once rule, clamping warnings, events and the report."""

from __future__ import annotations

import gc

import pytest
import structlog
import torch
from structlog.testing import capture_logs
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FSDPBuilder,
    InitFn,
    MaterializationError,
    ResetParameters,
)
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, make_model

CFG = DemoConfig(layers=2)


def test_build_returns_wrapper_and_keeps_environment(world1: None) -> None:
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block)
    with pytest.warns(
        UserWarning, match="NO_SHARD instead of FULL_SHARD since the world size is 1"
    ):
        sharded = builder.build(make_model(CFG))
    assert isinstance(sharded, FullyShardedDataParallel)
    env = builder.environment
    assert env.strategy.name == "NO_SHARD" and env.world_size == 1 and env.rank == 0
    assert env.device == torch.device("cpu")
    assert env.groups.data_parallel_size == 1
    assert [u.fqn for u in builder.plan] == ["blocks.0", "blocks.1", ""]
    assert {s["name"] for s in builder.report.stages()} == {
        "materialize",
        "move",
        "synchronize",
        "shard",
    }


def test_building_twice_is_an_error_and_clone_builds_again(world1: None) -> None:
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block)
    builder.build(make_model(CFG))
    with pytest.raises(ConfigurationError, match=r"build` was already called.*clone\(\)"):
        builder.build(make_model(CFG))
    assert isinstance(builder.clone().build(make_model(CFG)), FullyShardedDataParallel)


def test_meta_model_is_materialized_per_unit(world1: None) -> None:
    with torch.device("meta"):
        model = DemoTransformer(CFG)
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(ResetParameters())
    sharded = builder.build(model)
    assert not any(p.is_meta for p in sharded.parameters())
    materialized = [r for r in builder.report.records if r.stage == "materialize"]
    assert [r.unit for r in materialized] == ["blocks.0", "blocks.1", "<root>"]
    assert sum(r.bytes for r in materialized) == builder.plan.nbytes


def test_stage_events_carry_rank_world_unit_in_pipeline_order(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the library must not configure structlog")

    monkeypatch.setattr(structlog, "configure", refuse)
    with capture_logs() as events:
        FSDPBuilder().device(CPUDevice()).wrap(Block).build(make_model(CFG))
    stages = [e for e in events if e["event"] == "build_stage"]
    assert all(e["rank"] == 0 and e["world_size"] == 1 for e in stages)
    order = [(e["unit"], e["stage"]) for e in stages]
    expected = [
        (unit, stage)
        for unit in ("blocks.0", "blocks.1", "<root>")
        for stage in ("materialize", "move", "synchronize", "shard")
    ]
    assert order == expected
    for e in stages:
        assert e["seconds"] >= 0 and e["peak_bytes"] > 0
    done = [e for e in events if e["event"] == "build_done"]
    assert len(done) == 1 and done[0]["units"] == 3


def test_no_process_group_is_a_clear_error() -> None:
    with pytest.raises(
        ConfigurationError, match=r"initialized default process group.*init_process_group"
    ):
        FSDPBuilder().device(CPUDevice()).build(make_model(CFG))


def test_local_strategies_agree_once_after_the_units(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsdp_builder.runtime.agreement as agreement_module

    stages: list[str] = []
    real = agreement_module.agree

    def counting(stage: str, *args: object, **kwargs: object) -> bool:
        stages.append(stage)
        return real(stage, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(agreement_module, "agree", counting)
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block)
    builder.build(make_model(CFG))
    # configure, groups (whose all-gather also settles the unit order), the strategies' runs,
    # then one agreement after every unit was built: no collective follows a local step, so
    # no rank can be left waiting before the end.
    assert stages == ["configure", "groups", "prepare", "finish"]


def test_ignored_states_on_meta_are_refused_before_anything_changes(world1: None) -> None:
    with torch.device("meta"):
        model = DemoTransformer(CFG)
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).ignore(modules=[model.head])
    with pytest.raises(ConfigurationError, match=r"Ignored states are on the meta device: head"):
        builder.build(model)
    assert all(p.is_meta for p in model.parameters())
    assert not any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def test_fsdp2_hybrid_mesh_on_one_rank_falls_back_to_no_shard(world1: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_builder import FullyShardBuilder

    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).sharding("hybrid")
    builder.groups(init_device_mesh("cpu", (1, 1)))
    with pytest.warns(UserWarning, match="NO_SHARD instead of HYBRID_SHARD"):
        builder.build(make_model(CFG))
    assert builder.environment.strategy.name == "NO_SHARD"


def test_the_cyclic_collector_is_paused_for_the_build_and_restored(world1: None) -> None:
    seen: list[bool] = []

    def init(module: torch.nn.Module) -> None:
        seen.append(gc.isenabled())
        raise ValueError("an initializer that fails")

    for enabled in (True, False):
        if not enabled:
            gc.disable()
        try:
            with torch.device("meta"):
                model = torch.nn.Linear(2, 2)
            builder = FSDPBuilder().device(CPUDevice()).materialize(InitFn(init, allocate=True))
            with pytest.raises(MaterializationError, match="an initializer that fails"):
                builder.build(model)
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert seen == [False, False]

    def record(module: torch.nn.Module) -> None:
        seen.append(gc.isenabled())
        assert isinstance(module, torch.nn.Linear)
        module.reset_parameters()

    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    FSDPBuilder().device(CPUDevice()).materialize(InitFn(record, allocate=True)).build(model)
    assert seen[2:] == [False] and gc.isenabled()


def _generation_of(obj: object) -> int | None:
    # Each generation's list is taken before it is searched: taking it may collect younger ones.
    for generation in (2, 1, 0):
        if any(o is obj for o in gc.get_objects(generation=generation)):
            return generation
    return None


def test_what_a_build_allocated_goes_to_the_oldest_generation(world1: None) -> None:
    """Not scanned by a young-generation collection right after the build (it lives on)."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    sharded = FSDPBuilder().device(CPUDevice()).wrap(torch.nn.Linear).build(model)
    # A wrapper the build made.
    inner = next(m for m in sharded.modules() if isinstance(m, FullyShardedDataParallel))
    assert _generation_of(inner) == 2
    assert gc.isenabled()


def test_objects_the_process_froze_stay_frozen_across_a_build(world1: None) -> None:
    frozen_before = gc.get_freeze_count()
    kept: list[object] = [object()]  # a tracked container, frozen below
    gc.freeze()
    try:
        with torch.device("meta"):
            model = torch.nn.Linear(2, 2)
        FSDPBuilder().device(CPUDevice()).build(model)
        # A frozen object is in no generation; unfreezing would put it in the oldest.
        assert _generation_of(kept) is None
        assert gc.get_freeze_count() > 0 and gc.isenabled()
    finally:
        if frozen_before == 0:
            gc.unfreeze()


@pytest.mark.filterwarnings("ignore:Using NO_SHARD")
@pytest.mark.parametrize("kinds", ["all_on_meta", "mixed", "all_whole"])
def test_units_sharded_on_meta_are_all_sharded_before_the_first_is_filled(
    world1: None, kinds: str
) -> None:
    from fsdp_builder import FullyShardBuilder, StreamInit

    with torch.device("meta"):
        model = DemoTransformer(CFG)
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    # Units under ``whole_below`` bytes are filled whole, before they are sharded.
    whole_below = {"all_on_meta": 0, "mixed": block, "all_whole": 10**12}[kinds]
    builder = (
        FullyShardBuilder()
        .device(CPUDevice())
        .wrap(Block)
        .materialize(StreamInit(seed=0, whole_below=whole_below))
    )
    sharded = builder.build(model)
    assert not any(p.is_meta for p in sharded.parameters())
    order = [(r.stage, r.unit) for r in builder.report.records if r.stage in STEPS]
    labels = [u.label for u in builder.plan]
    whole = [u.param_bytes < whole_below for u in builder.plan]
    if kinds == "all_on_meta":
        # Sharded bottom-up, then filled bottom-up.
        assert order == [("shard", u) for u in labels] + [("materialize", u) for u in labels]
        return
    assert any(whole) and (kinds == "all_whole") == all(whole)
    expected = []
    for label, filled_whole in zip(labels, whole, strict=True):
        steps = ("materialize", "shard") if filled_whole else ("shard", "materialize")
        expected += [(step, label) for step in steps]
    assert order == expected


STEPS = ("shard", "materialize")


class _Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        raise RuntimeError("planted")


@pytest.mark.filterwarnings("ignore:Using NO_SHARD")
@pytest.mark.parametrize("name", ["ShardFirstReset", "StreamInit"])
@pytest.mark.parametrize("fails", [False, True])
def test_shard_first_materializers_give_torch_its_generator_back(
    world1: None, name: str, fails: bool
) -> None:
    import fsdp_builder
    from fsdp_builder import FullyShardBuilder

    torch.manual_seed(3)
    with torch.device("meta"):
        model = DemoTransformer(CFG)
        if fails:
            model.blocks[1].add_module("failing", _Failing())
    before = torch.get_rng_state()
    materializer = getattr(fsdp_builder, name)(seed=0)
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).materialize(materializer)
    if fails:
        with pytest.raises(MaterializationError, match="planted"):
            builder.build(model)
    else:
        builder.build(model)
    # Each module's initializer seeded torch's generator; the user's stream goes on unchanged.
    assert torch.equal(torch.get_rng_state(), before)
