"""User-supplied strategies that answer wrongly: a ``shard_placement_fn`` or a ``DeviceResolver``
answering differently per rank, a ``GroupFactory`` whose groups do not cover the ranks that build
or do not form a (replicate, shard) grid, and strategies returning the wrong kind of object; and
FSDP1's CPU offload on a machine without an accelerator. Each is refused on every rank in the
configure or groups stage, naming the strategy and what it returned, with the model untouched.

One spawn of 2 ranks runs every scenario, each on its own (see ``isolated``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor, Shard
from typing_extensions import override

from fsdp_builder import (
    BaseDeviceResolver,
    BaseGroupFactory,
    CPUDevice,
    FSDPBuilder,
    FullyShardBuilder,
    ProcessGroups,
    ShardingBuilder,
)


class Pair(nn.Module):
    """Two square layers (every dim splits over 2 ranks) under a root of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _model() -> Pair:
    torch.manual_seed(5)
    return Pair()


def attempt(builder: Callable[[], ShardingBuilder], model: nn.Module) -> dict[str, Any]:
    """Configure the builder and build, and say what was raised and whether the model was left
    as it was."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        builder().build(model)
    except Exception as exc:
        after = dict(model.named_parameters())
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "stage": getattr(exc, "stage", None),
            "untouched": not any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
            and not any(isinstance(p, DTensor) for p in after.values())
            and before.keys() == after.keys()
            and all(torch.equal(before[n], after[n]) for n in before),
        }
    return {"type": None, "message": ""}


# -- shard_placement_fn: the answers are agreed ------------------------------------------------


def _rank_dim(param: nn.Parameter) -> Shard | None:
    """Rank 0 shards the weights by rows, rank 1 by columns."""
    return Shard(dist.get_rank()) if param.ndim == 2 else None


def _columns(param: nn.Parameter) -> Shard | None:
    return Shard(-1) if param.ndim == 2 else None


def placement_per_rank() -> dict[str, Any]:
    builder = FullyShardBuilder().device(CPUDevice()).wrap(nn.Linear)
    return attempt(lambda: builder.shard_placement_fn(_rank_dim), _model())


def placement_per_rank_per_unit() -> dict[str, Any]:
    """The same through a unit's own override (per_unit), not the build's function."""
    builder = FullyShardBuilder().device(CPUDevice()).wrap(nn.Linear)
    per_unit = builder.per_unit(lambda m, fqn: {"shard_placement_fn": _rank_dim} if fqn else None)
    return attempt(lambda: per_unit, _model())


def placement_alike() -> dict[str, Any]:
    """The same answers on every rank build, and the gathered weights are the model's own."""
    model = _model()
    expected = {n: t.clone() for n, t in model.state_dict().items()}
    built = FullyShardBuilder().device(CPUDevice()).wrap(nn.Linear).shard_placement_fn(_columns)
    sharded = built.build(model)
    full = {n: t.full_tensor() for n, t in sharded.state_dict().items()}
    return {
        "equal": full.keys() == expected.keys()
        and all(torch.equal(full[n], expected[n]) for n in expected)
    }


# -- group factories of one's own -------------------------------------------------------------


class WorldTwice(BaseGroupFactory):
    """Hybrid groups that are both the whole world: no (replicate, shard) grid."""

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        world = dist.group.WORLD
        assert world is not None
        return ProcessGroups(shard_group=world, replicate_group=world)


class OneRankShards(BaseGroupFactory):
    """A shard group of one rank each, while every rank of the world builds together."""

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        # Every rank creates every group, in the same order.
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        own = groups[dist.get_rank()]
        assert own is not None
        return ProcessGroups(shard_group=own)


class CrossedPairs(BaseGroupFactory):
    """On 4 ranks, shard groups [0, 1] and [2, 3] but replicate groups [0, 3] and [1, 2]: the
    sizes cover the world, yet each replicate group pairs a shard's first rank with the other
    shard's second, whose halves differ."""

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 3]), dist.new_group([1, 2])]
        rank = dist.get_rank()
        shard, replicate = shards[rank // 2], replicas[0 if rank in (0, 3) else 1]
        assert shard is not None and replicate is not None
        return ProcessGroups(shard_group=shard, replicate_group=replicate)


class PairFactory(BaseGroupFactory):
    """Returns a (shard, replicate) tuple instead of ProcessGroups."""

    @override
    def create(self, strategy: ShardingStrategy, device: torch.device) -> Any:
        return (dist.group.WORLD, None)


def with_factory(builder: ShardingBuilder, factory: BaseGroupFactory) -> dict[str, Any]:
    return attempt(lambda: builder.device(CPUDevice()).wrap(nn.Linear).groups(factory), _model())


def world_twice(builder: type[ShardingBuilder]) -> dict[str, Any]:
    return with_factory(builder().sharding("hybrid"), WorldTwice())


def crossed(builder: type[ShardingBuilder]) -> dict[str, Any]:
    return with_factory(builder().sharding("hybrid"), CrossedPairs())


# -- device resolvers of one's own ------------------------------------------------------------


class Returns(BaseDeviceResolver):
    """Resolves to a fixed answer, right or wrong."""

    explicit = True

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    @override
    def resolve(self, module: nn.Module, params: Any, rank: int) -> Any:
        return self.answer


class PerRankType(BaseDeviceResolver):
    """The CPU on rank 0; on rank 1, the accelerator that rank's machine has."""

    explicit = True

    @override
    def resolve(self, module: nn.Module, params: Any, rank: int) -> torch.device:
        return torch.device("cpu") if rank == 0 else torch.device("xpu", 0)


def device_types_differ() -> dict[str, Any]:
    """Rank 1 stands on a machine with an accelerator (there an 'xpu'), rank 0 on one without:
    the resolved device types differ although the resolver is the same object on both."""

    def builder() -> ShardingBuilder:
        return FSDPBuilder().device(PerRankType()).wrap(nn.Linear)

    if dist.get_rank() == 0:
        return attempt(builder, _model())
    xpu = torch.device("xpu")
    with (
        mock.patch.object(torch.accelerator, "current_accelerator", return_value=xpu),
        mock.patch.object(torch.accelerator, "is_available", return_value=True),
        mock.patch.object(torch.accelerator, "device_count", return_value=1),
    ):
        return attempt(builder, _model())


def with_resolver(answer: Any) -> dict[str, Any]:
    return attempt(lambda: FullyShardBuilder().device(Returns(answer)).wrap(nn.Linear), _model())


def offload_fsdp1() -> dict[str, Any]:
    builder = FSDPBuilder().device(CPUDevice()).wrap(nn.Linear)
    return attempt(lambda: builder.cpu_offload(CPUOffload(offload_params=True)), _model())


def offload_fsdp1_per_unit() -> dict[str, Any]:
    offload = CPUOffload(offload_params=True)
    builder = FSDPBuilder().device(CPUDevice()).wrap(nn.Linear)
    per_unit = builder.per_unit(lambda module, fqn: {"cpu_offload": offload} if fqn else None)
    return attempt(lambda: per_unit, _model())


def fault_ranks() -> Results:
    def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
        if dist.get_world_size() == 4:
            for name, builder in (("fsdp1", FSDPBuilder), ("fsdp2", FullyShardBuilder)):
                yield f"crossed_{name}", partial(crossed, builder)
            return
        yield "placement_per_rank", placement_per_rank
        yield "placement_per_rank_per_unit", placement_per_rank_per_unit
        yield "placement_alike", placement_alike
        for name, builder in (("fsdp1", FSDPBuilder), ("fsdp2", FullyShardBuilder)):
            yield f"world_twice_{name}", partial(world_twice, builder)
            yield f"one_rank_{name}", partial(with_factory, builder(), OneRankShards())
        yield "pair_factory", partial(with_factory, FullyShardBuilder(), PairFactory())
        yield "device_types", device_types_differ
        yield "resolver_meta", partial(with_resolver, torch.device("meta"))
        yield "resolver_cuda", partial(with_resolver, torch.device("cuda", 0))
        yield "resolver_str", partial(with_resolver, "cpu")
        yield "offload_fsdp1", offload_fsdp1
        yield "offload_fsdp1_per_unit", offload_fsdp1_per_unit

    return run_each(cases(), stall_seconds=20)


SPAWNS = Spawns(fault_ranks, timeout=180)


def _refused_alike(
    key: str, kind: str, pattern: str, stage: str | None = None, world: int = 2
) -> list[Any]:
    got = values(SPAWNS(world), key)
    for rank in got:
        assert rank["type"] == kind, rank
        assert re.search(pattern, rank["message"], re.S), rank["message"]
        assert rank["untouched"], rank
        if stage is not None:
            assert rank["stage"] == stage, rank
    return got


@pytest.mark.parametrize("key", ["placement_per_rank", "placement_per_rank_per_unit"])
def test_placement_answers_that_differ_between_ranks_are_refused_in_configure(key: str) -> None:
    got = _refused_alike(
        key,
        "RankDisagreementError",
        r"rank 1 has shard_placement_fn\('first\.weight'\)=Shard\(dim=1\) but rank 0 has "
        r"shard_placement_fn\('first\.weight'\)=Shard\(dim=0\)",
        stage="configure",
    )
    assert got[0]["message"] == got[1]["message"]


def test_placement_answers_alike_on_every_rank_still_build_the_models_weights() -> None:
    assert values(SPAWNS(2), "placement_alike") == [{"equal": True}] * 2


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_a_hybrid_factory_giving_the_world_twice_is_refused(backend: str) -> None:
    _refused_alike(
        f"world_twice_{backend}",
        "ConfigurationError",
        r"`WorldTwice.create` returned a shard group of 2 rank\(s\) and a replicate group of 2 "
        r"rank\(s\), which span 4 data-parallel rank\(s\), but 2 ranks build together.*"
        r"do not form a \(replicate, shard\) grid",
    )


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_hybrid_groups_of_the_right_sizes_that_form_no_grid_are_refused(backend: str) -> None:
    builder = "FSDPBuilder" if backend == "fsdp1" else "FullyShardBuilder"
    _refused_alike(
        f"crossed_{backend}",
        "ConfigurationError",
        rf"`{builder}.groups` got an invalid `groups`: the shard groups \[\[0, 1\], \[2, 3\]\] "
        r"and the replicate group \[\d, \d\] do not form a grid",
        world=4,
    )


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_a_factory_giving_one_rank_shard_groups_in_a_world_of_two_is_refused(
    backend: str,
) -> None:
    got = _refused_alike(
        f"one_rank_{backend}",
        "ConfigurationError",
        r"`OneRankShards.create` returned a shard group of 1 rank\(s\), which span 1 "
        r"data-parallel rank\(s\), but 2 ranks build together.*never exchange gradients",
    )
    assert "world size is 1" not in got[0]["message"]


def test_a_factory_returning_a_tuple_is_named() -> None:
    _refused_alike(
        "pair_factory",
        "ConfigurationError",
        r"`PairFactory.create` returned tuple \(ProcessGroup, None\), not ProcessGroups. Return "
        r"ProcessGroups\(shard_group=",
    )


def test_resolved_device_types_that_differ_between_ranks_are_refused_in_configure() -> None:
    got = _refused_alike(
        "device_types",
        "RankDisagreementError",
        r"rank 1 has resolved device type='xpu' but rank 0 has resolved device type='cpu'",
        stage="configure",
    )
    assert got[0]["message"] == got[1]["message"]


@pytest.mark.parametrize(
    ("key", "returned"),
    [
        ("resolver_meta", r"returned device\(type='meta'\)"),
        ("resolver_str", r"returned str 'cpu'"),
    ],
)
def test_a_resolver_returning_no_usable_device_is_named(key: str, returned: str) -> None:
    _refused_alike(key, "ConfigurationError", r"`Returns.resolve` .*" + returned)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_resolver_returning_cuda_without_cuda_is_named() -> None:
    _refused_alike(
        "resolver_cuda",
        "ConfigurationError",
        r"`Returns.resolve` .*returned device\(type='cuda', index=0\).*has no cuda",
    )


@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine without one")
@pytest.mark.parametrize(
    ("key", "where"),
    [("offload_fsdp1", "cpu_offload"), ("offload_fsdp1_per_unit", "per_unit")],
)
def test_fsdp1_cpu_offload_without_an_accelerator_is_refused_in_configure(
    key: str, where: str
) -> None:
    _refused_alike(
        key,
        "ConfigurationError",
        rf"`FSDPBuilder.{where}` got an invalid `offload_params`: CPUOffload\(offload_params=True\)"
        r".*this machine has no accelerator.*Drop cpu_offload",
    )
