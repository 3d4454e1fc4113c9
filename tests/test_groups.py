"""Group factories and the strategy clamping rules, on a one-rank world or with stand-ins."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import ShardingStrategy

from fsdp_builder import (
    AutoHybridGroups,
    BaseGroupFactory,
    ConfigurationError,
    CPUDevice,
    DefaultGroups,
    FSDPBuilder,
    GivenGroup,
    HybridGroups,
    MeshGroups,
    ProcessGroups,
    ShardingOptions,
)
from fsdp_builder.planning.context import BackendCapabilities, ConfigureContext
from fsdp_builder.planning.ignored import resolve_ignored
from fsdp_builder.planning.plan import plan_units
from fsdp_builder.planning.wrap import WrapPolicy
from fsdp_builder.runtime.environment import effective_strategy

FULL, HYBRID, NONE = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy.NO_SHARD,
)


@attrs.define
class FakeGroup:
    """Stands in for a ProcessGroup where only rank()/size() are read."""

    n: int

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self.n


def groups(shard: int, replicate: int | None = None) -> Any:
    return ProcessGroups(
        shard_group=FakeGroup(shard),  # type: ignore[arg-type]
        replicate_group=None if replicate is None else FakeGroup(replicate),  # type: ignore[arg-type]
    )


def test_the_data_parallel_world_spans_both_groups() -> None:
    g = groups(4, 4)
    assert g.data_parallel_size == 16


def test_world_of_one_clamps_to_no_shard_with_a_warning() -> None:
    with pytest.warns(
        UserWarning, match="NO_SHARD instead of FULL_SHARD since the world size is 1"
    ):
        opts, _ = effective_strategy(ShardingOptions(strategy=FULL), groups(1))
    assert opts.strategy is NONE


def test_no_shard_across_ranks_warns_as_deprecated() -> None:
    with pytest.warns(FutureWarning, match="NO_SHARD sharding strategy is deprecated"):
        opts, _ = effective_strategy(ShardingOptions(strategy=NONE), groups(2))
    assert opts.strategy is NONE


def test_hybrid_with_one_rank_per_shard_group_replicates_over_replicate_group() -> None:
    g = groups(1, 4)
    with pytest.warns(UserWarning, match="NO_SHARD over the replicate group"):
        opts, out = effective_strategy(ShardingOptions(strategy=HYBRID), g)
    assert opts.strategy is NONE and out.shard_group is g.replicate_group


def test_full_shard_over_several_ranks_is_kept() -> None:
    opts, out = effective_strategy(ShardingOptions(strategy=FULL), groups(4))
    assert opts.strategy is FULL and out.world_size == 4


def context(strategy: ShardingStrategy) -> ConfigureContext:
    """What the configure stage hands a factory's check for a small model."""
    model = nn.Linear(2, 2)
    ignored = resolve_ignored(model)
    return ConfigureContext(
        model=model,
        plan=plan_units(model, WrapPolicy(), ignored),
        ignored=ignored,
        options=ShardingOptions(strategy=strategy),
        backend=BackendCapabilities("fsdp2", "FullyShardBuilder", True, True),
        device=torch.device("cpu"),
    )


def test_factories_refuse_strategies_they_cannot_serve(world1: None) -> None:
    world = dist.group.WORLD
    assert world is not None
    with pytest.raises(ConfigurationError, match=r"`GivenGroup`.*HYBRID_SHARD needs a shard group"):
        GivenGroup(world).check_context(context(HYBRID))
    with pytest.raises(ConfigurationError, match=r"`HybridGroups`.*FULL_SHARD shards over one"):
        HybridGroups(world, world).check_context(context(FULL))
    with pytest.raises(ConfigurationError, match=r"`AutoHybridGroups`.*FULL_SHARD does not"):
        AutoHybridGroups(devices_per_node=1).check_context(context(FULL))
    with pytest.raises(ConfigurationError, match=r"world size 1 is not a multiple of 2"):
        AutoHybridGroups(devices_per_node=2).check_context(context(HYBRID))


def test_the_former_validate_still_checks_the_strategy(world1: None) -> None:
    """``validate(strategy)``, the hook before ``check_context``: a direct call still refuses,
    and a factory overriding it still refuses the build, each with a DeprecationWarning."""
    world = dist.group.WORLD
    assert world is not None
    with (
        pytest.warns(DeprecationWarning, match=r"GivenGroup.validate\(strategy\).*check_context"),
        pytest.raises(ConfigurationError, match=r"HYBRID_SHARD needs a shard group"),
    ):
        GivenGroup(world).validate(HYBRID)
    group: dist.ProcessGroup = world

    class OnlyFull(BaseGroupFactory):
        def validate(self, strategy: ShardingStrategy) -> None:
            if strategy is not FULL:
                raise ConfigurationError(f"`OnlyFull` cannot serve {strategy.name}. Fix.")

        def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
            return ProcessGroups(shard_group=group)

    builder = FSDPBuilder().device(CPUDevice()).groups(OnlyFull()).sharding("hybrid")
    with (
        pytest.warns(DeprecationWarning, match=r"OnlyFull.validate\(strategy\)") as seen,
        pytest.raises(ConfigurationError, match=r"`OnlyFull` cannot serve HYBRID_SHARD"),
    ):
        builder.build(nn.Linear(2, 2))
    assert any(w.filename == __file__ for w in seen)  # pointed at the build call


def test_mesh_dimensions_must_fit_the_strategy(world1: None) -> None:
    one, two = init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1, 1))
    MeshGroups(one).check_context(context(FULL))
    MeshGroups(two).check_context(context(HYBRID))
    with pytest.raises(ConfigurationError, match=r"HYBRID_SHARD needs a 2-D \(replicate, shard\)"):
        MeshGroups(one).check_context(context(HYBRID))
    with pytest.raises(ConfigurationError, match=r"FULL_SHARD shards over one dimension"):
        MeshGroups(two).check_context(context(FULL))
    with pytest.raises(ConfigurationError, match=r"a 3-D mesh of shape \(1, 1, 1\) cannot be used"):
        MeshGroups(init_device_mesh("cpu", (1, 1, 1)))
    with pytest.raises(ConfigurationError, match=r"`mesh`.*DeviceMesh, got str"):
        MeshGroups("mesh")  # type: ignore[arg-type]


def test_mesh_dims_refusals_offer_a_fix_the_mesh_accepts(world1: None) -> None:
    unnamed = init_device_mesh("cpu", (1, 1))
    with pytest.raises(ConfigurationError, match=r"the mesh \(1, 1\) has no dim names") as info:
        MeshGroups(unnamed, dims=("dp",))
    assert "mesh_dim_names=" in str(info.value)
    named = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data", "model"))
    with pytest.raises(ConfigurationError, match=r"\['dp'\] are not dims") as info:
        MeshGroups(named, dims=("dp",))
    fix = re.search(r"dims=\('(\w+)',\)", str(info.value))
    assert fix is not None and fix.group(1) == "data"
    assert MeshGroups(named, dims=(fix.group(1),)).dims == ("data",)  # the fix works
    with pytest.raises(ConfigurationError, match=r"expected a dim name or a tuple.*got int 1"):
        MeshGroups(named, dims=1)  # type: ignore[arg-type]


def test_created_groups(world1: None) -> None:
    dev = torch.device("cpu")
    default = DefaultGroups().create(FULL, dev)
    assert default.world_size == 1 and default.replicate_group is None
    mesh = init_device_mesh("cpu", (1, 1))
    hybrid = MeshGroups(mesh).create(HYBRID, dev)
    assert hybrid.mesh is mesh and hybrid.replicate_group is not None
    auto = AutoHybridGroups(devices_per_node=1).create(HYBRID, dev)
    assert (auto.world_size, auto.replicate_size) == (1, 1)


def test_factories_need_an_initialized_world() -> None:
    with pytest.raises(ConfigurationError, match=r"`DefaultGroups` needs an initialized"):
        DefaultGroups().check_context(context(FULL))
