"""FSDP2 (fully_shard) builds: option mapping, mesh checks, training parity with a single-process
reference on 2 and 4 gloo ranks, shard-first initialization and state-dict scattering.

Every scenario of one world size runs in one spawn (starting ranks dominates the cost here), each
on its own (see ``isolated``): a broken scenario fails only the tests that read it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from helpers import deterministic_model, full_state_dict, local_bytes, reference
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

import fsdp_builder.materializers.initializers as materializers
from fsdp_builder import (
    AutoHybridGroups,
    BaseGroupFactory,
    BroadcastFromRank0,
    ConfigurationError,
    CPUDevice,
    DeterministicInit,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    InitWeights,
    MaterializationError,
    MeshGroups,
    ProcessGroups,
    ShardingOptions,
    StreamInit,
    VerifyReplicas,
)
from fsdp_builder.backends.fsdp2 import (
    FullyShardBackend,
    check_fsdp1_only_options,
    ignored_params_kwargs,
    mixed_precision_policy,
    offload_policy,
)
from fsdp_builder.materializers.sharded import ShardFirstReset
from fsdp_builder.runtime import fast_storage, tree
from fsdp_builder.tools.cli import DEMO_SEED
from fsdp_builder.tools.cli import main as cli_main
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, make_model, train

# Whichever test first reads a world size's results starts its spawn (deadline 240 s).
pytestmark = pytest.mark.timeout(300)

STEPS = 3
CFG = DemoConfig(layers=2)
# FSDP2's default, every unit sharded first (by default these small units are filled whole).
SHARDWISE = StreamInit(whole_below=0)


# -- helpers run inside the ranks ----------------------------------------------------------------


def _builder(strategy: str, groups: Any = None) -> FullyShardBuilder:
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).sharding(strategy)
    if groups is not None:
        builder.groups(groups)
    return builder


def _hybrid_groups(kind: str) -> Any:
    world = dist.get_world_size()
    if kind == "mesh":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return AutoHybridGroups(devices_per_node=2)


def _sharded_modules(model: nn.Module) -> int:
    return sum(isinstance(m, FSDPModule) for m in model.modules())


def _first_mlp_weight(model: nn.Module) -> DTensor:
    """The first block's first MLP weight of a demo model after fully_shard: a DTensor."""
    block = cast(Block, cast(DemoTransformer, model).blocks[0])
    return cast(DTensor, cast(nn.Linear, block.mlp[0]).weight)


def _build_train(builder: FullyShardBuilder, model: nn.Module) -> dict[str, Any]:
    sharded = builder.build(model)
    env = builder.environment
    initial = full_state_dict(sharded)
    param_local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in sharded.parameters()
    )
    losses = train(sharded, CFG, STEPS, dist.get_rank(), dist.get_world_size())
    return {
        "strategy": env.strategy.name,
        "mesh": list(_first_mlp_weight(sharded).device_mesh.shape),
        "fsdp_modules": _sharded_modules(sharded),
        "units": len(env.plan),
        "initial": initial,
        "losses": losses,
        "final": full_state_dict(sharded),
        "param_local_numel": param_local,
        "model_numel": env.plan.numel,
    }


def _expect_error(fn: Callable[[], object], error: type[BaseException]) -> str:
    try:
        fn()
    except error as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _FixedGroups(BaseGroupFactory):
    """A custom factory handing back a given mesh (bypasses MeshGroups' own checks)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def create(self, strategy: ShardingStrategy, device: torch.device) -> ProcessGroups:
        return ProcessGroups(shard_group=self.mesh.get_group(self.mesh.ndim - 1), mesh=self.mesh)


def _raw_reset_parameters_on_meta() -> dict[str, torch.Tensor]:
    """The defect: fully_shard on meta, then to_empty + reset_parameters on every rank."""
    torch.manual_seed(0)
    model = make_model(CFG, device="meta")
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # type: ignore[arg-type]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for m in model.modules():
            init = materializers.initializer_of(m)
            if init is not None and list(m.parameters(recurse=False)):
                init()
    return full_state_dict(model)


class OddBlock(nn.Module):
    """Parameters whose first dim does not split evenly: 5 rows, and 1 row (most ranks hold
    nothing of it); BatchNorm brings buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 5)
        self.down = nn.Linear(5, 1)
        self.norm = nn.BatchNorm1d(1)


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OddBlock() for _ in range(2))
        self.table = nn.Embedding(3, 7)


def _odd_model(device: str) -> OddModel:
    torch.manual_seed(13)
    with torch.device(device):
        return OddModel()


def _odd_source() -> dict[str, torch.Tensor]:
    """Distinct values everywhere (running stats included), some in float64 and one stored
    transposed (not contiguous): the load converts and slices what it is given."""
    state = _odd_model("cpu").state_dict()
    out: dict[str, torch.Tensor] = {}
    for i, (name, value) in enumerate(state.items()):
        if value.is_floating_point():
            value = value + i
            value = value.double() if i % 2 else value
        out[name] = value
    out["blocks.0.up.weight"] = out["blocks.0.up.weight"].t().contiguous().t()
    return out


class _FailingState(dict[str, torch.Tensor]):
    """Reads fine while the source is checked, then fails on one key when the weights are read."""

    def __init__(self, state: dict[str, torch.Tensor], bad: str) -> None:
        super().__init__(state)
        self.bad = bad
        self.reads = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == self.bad:
            self.reads += 1
            if self.reads > 1:
                raise OSError("disk went away")
        return super().__getitem__(key)


def _odd_builder(strategy: str, groups: Any) -> FullyShardBuilder:
    builder = FullyShardBuilder().device(CPUDevice()).wrap(OddBlock).sharding(strategy)
    if groups is not None:
        builder.groups(groups)
    return builder


def _load_odd(strategy: str, groups: Any) -> dict[str, torch.Tensor]:
    """Uneven shapes and converted dtypes, loaded through FromStateDict."""
    source = _odd_source() if dist.get_rank() == 0 else None
    loaded = _odd_builder(strategy, groups).materialize(FromStateDict(source))
    return full_state_dict(loaded.build(_odd_model("meta")))


def _load_read_error(strategy: str, groups: Any) -> str:
    """A source that fails half-way through the load."""
    failing = _FailingState(_odd_source(), "blocks.1.up.weight") if dist.get_rank() == 0 else None
    builder = _odd_builder(strategy, groups).materialize(FromStateDict(failing))
    return _expect_error(lambda: builder.build(_odd_model("meta")), Exception)


# The training scenarios of each world size: "strategy/groups".
TRAIN = {
    2: ["full/None", "grad_op/None", "none/None", "hybrid/auto"],
    4: ["full/None", "grad_op/None", "hybrid/mesh", "hybrid/auto"],
}


def _groups_of(kind: str | None) -> Any:
    return _hybrid_groups(kind) if kind and kind != "None" else None


def _train_case(key: str) -> dict[str, Any]:
    """Training parity: start the build from the reference weights (seeded meta-free model)."""
    strategy, groups = key.split("/")
    return _build_train(_builder(strategy, _groups_of(groups)), make_model(CFG))


def _deterministic_case(cls: type[FSDPBuilder | FullyShardBuilder]) -> dict[str, torch.Tensor]:
    """The same weights from both backends (and any world size) with DeterministicInit."""
    b = cls().device(CPUDevice()).wrap(Block).materialize(DeterministicInit(seed=3))
    return full_state_dict(b.build(make_model(CFG, device="meta")))


def _shard_first_layout(world: int) -> tuple[str, str | None]:
    """The strategy and groups of the shard-first and loading scenarios."""
    return ("hybrid", "mesh") if world == 4 else ("full", None)


def _shard_first_case(world: int) -> dict[str, Any]:
    """Shard-first: only local shards are allocated, and they differ across ranks."""
    strategy, groups = _shard_first_layout(world)
    builder = _builder(strategy, _groups_of(groups))
    builder.materialize(ShardFirstReset(seed=5))
    sharded = builder.build(make_model(CFG, device="meta"))
    env = builder.environment
    out: dict[str, Any] = {
        "param_bytes": local_bytes(sharded),
        "model_bytes": env.plan.nbytes,
        "largest_unit_bytes": env.plan.largest_unit_bytes,
        "shard_size": env.groups.world_size,
        "initial": full_state_dict(sharded),
    }
    out["losses"] = train(sharded, CFG, STEPS, dist.get_rank(), world)
    return out


def _shard_first_synced_case(world: int) -> dict[str, torch.Tensor]:
    """Synchronizers on sharded units: a shard travels among its replicas only, so broadcasting
    keeps distinct shards distinct, and verification passes where replicas agree."""
    strategy, groups = _shard_first_layout(world)
    builder = _builder(strategy, _groups_of(groups))
    builder.materialize(ShardFirstReset(seed=5)).synchronize(BroadcastFromRank0(), VerifyReplicas())
    return full_state_dict(builder.build(make_model(CFG, device="meta")))


def _from_state_dict_case(world: int) -> dict[str, Any]:
    """Loading: FromStateDict shards first with FSDP2, so rank 0 scatters its tensors and the
    others receive only their slices."""
    rank = dist.get_rank()
    strategy, groups = _shard_first_layout(world)
    source = make_model(CFG, seed=7).state_dict() if rank == 0 else None
    builder = _builder(strategy, _groups_of(groups))
    loaded = builder.materialize(FromStateDict(source)).build(make_model(CFG, device="meta"))
    return {
        "state": full_state_dict(loaded),
        "received": sum(r.bytes for r in builder.report.records if r.stage == "materialize"),
        "model_bytes": builder.environment.plan.nbytes,
        "shard_size": builder.environment.groups.world_size,
        "losses": train(loaded, CFG, STEPS, rank, world),
    }


def _mesh3(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (1, world // 2, 2), mesh_dim_names=("a", "b", "c"))


def _small_mesh(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (world, 1), mesh_dim_names=("x", "y"))["y"]


def _meshgroups_3d(world: int) -> str:
    mesh3 = _mesh3(world)
    return _expect_error(lambda: MeshGroups(mesh3), ConfigurationError)


def _factory_3d(world: int) -> str:
    builder = _builder("full", _FixedGroups(_mesh3(world)))
    return _expect_error(lambda: builder.build(make_model(CFG)), ConfigurationError)


def _factory_size(world: int) -> str:
    builder = _builder("full", _FixedGroups(_small_mesh(world)))
    return _expect_error(lambda: builder.build(make_model(CFG)), ConfigurationError)


def _meshgroups_size(world: int) -> str:
    small = _small_mesh(world)
    return _expect_error(lambda: _builder("full", small).build(make_model(CFG)), ConfigurationError)


# Bad meshes, refused on every rank alike.
ERRORS: dict[str, Callable[[int], str]] = {
    "meshgroups_3d": _meshgroups_3d,
    "factory_3d": _factory_3d,
    "factory_size": _factory_size,
    "meshgroups_size": _meshgroups_size,
}


def cases(world: int) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    """Every scenario of one world size, keyed as the tests read them."""
    for key in TRAIN[world]:
        yield ("train", key), partial(_train_case, key)
    yield ("deterministic", "fsdp1"), partial(_deterministic_case, FSDPBuilder)
    yield ("deterministic", "fsdp2"), partial(_deterministic_case, FullyShardBuilder)
    yield "shard_first", partial(_shard_first_case, world)
    yield "shard_first_synced", partial(_shard_first_synced_case, world)
    yield "raw_defect", _raw_reset_parameters_on_meta
    yield "from_state_dict", partial(_from_state_dict_case, world)
    # Uneven shards, dtype conversion and a failing read, on the same groups.
    strategy, groups = _shard_first_layout(world)
    yield ("load", "odd"), lambda: _load_odd(strategy, _groups_of(groups))
    yield ("load", "read_error"), lambda: _load_read_error(strategy, _groups_of(groups))
    yield "settled_odd", _settled_odd_case
    for name, check in ERRORS.items():
        yield ("errors", name), partial(check, world)
    for name in TIED:
        yield ("tied", name), partial(_tied_case, name)
    for name in ROW_WRITES:
        yield ("row_writes", name), partial(_row_writes_case, name)
    for name in [*REFUSED_ROW_WRITES, "init_weights"]:
        yield ("row_write_refused", name), partial(_row_write_refused_case, name)
    yield "init_weights_starts", _init_weights_starts_case
    for name in CHECKPOINTED:
        yield ("checkpointed_records", name), partial(_checkpointed_records_case, name)


def _settled_odd_case() -> dict[str, Any]:
    """The default materializer's shard-first build of uneven shards (these units are small
    enough to be filled whole by default): what FSDP2 records of each parameter after the build
    (its padded shard, as ``to_empty`` on the FSDP module leaves it), and the full weights."""
    builder = FullyShardBuilder().device(CPUDevice()).wrap(OddBlock).materialize(SHARDWISE)
    model = builder.build(_odd_model("meta"))
    assert builder.report.records[0].stage == "shard"
    records = [
        (
            not r._sharded_param_data.is_meta,
            r._sharded_param_data.numel() == math.prod(r.padded_sharded_param_size),
            r._sharded_param_data.data_ptr() == r.sharded_param._local_tensor.data_ptr()
            or not r.sharded_param._local_tensor.numel(),
        )
        for r in _fsdp_params(model)
    ]
    return {"records": records, "state": full_state_dict(model)}


def rank_main(world: int) -> Results:
    """Everything one world size checks, in one spawn: each scenario's result or error."""
    return run_each(cases(world))


class TiedLM(nn.Module):
    """The demo blocks between an embedding and a head that share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(CFG, device=str(torch.empty(0).device))
        self.inner.head.weight = self.inner.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)


def _tied_model(device: str) -> TiedLM:
    torch.manual_seed(11)
    with torch.device(device):
        return TiedLM()


TIED = ["reset", "shard_first"]


def _tied_case(name: str) -> dict[str, Any]:
    materializer = ShardFirstReset(seed=1) if name == "shard_first" else None
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    if materializer is not None:
        builder.materialize(materializer)
    model = builder.build(_tied_model("meta" if materializer else "cpu"))
    inner = cast(DemoTransformer, model.inner)
    return {
        "tied": inner.head.weight is inner.embed.weight,
        "initial": full_state_dict(model),
        "losses": train(model, CFG, STEPS, dist.get_rank(), dist.get_world_size()),
    }


class Striped(nn.Module):
    """Writes rows of its weight after drawing it: a stepped slice and the last row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(13, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight)
            self.weight[1:12:4].fill_(7.0)
            self.weight.data[-1].zero_()


class RowWritten(nn.Module):
    """Initializers that write single rows: ``Embedding``'s padding row, ``Striped``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4, padding_idx=5)
        self.striped = Striped()

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for m in (self.embed, self.striped):
            m.reset_parameters()


ROW_WRITES = {
    "default": None,
    "stream_shard_by_shard": lambda: StreamInit(whole_below=0),
    "shard_first": lambda: ShardFirstReset(seed=3),
    "init_weights": lambda: InitWeights(seed=3),
}


def _row_writes_case(name: str) -> dict[str, torch.Tensor]:
    make = ROW_WRITES[name]
    builder = FullyShardBuilder().device(CPUDevice())
    if make is not None:
        builder.materialize(make())
    with torch.device("meta"):
        model = RowWritten()
    return full_state_dict(builder.build(model))


class InnerLinear(nn.Linear):
    """A unit of its own, sharded before the root's initializer runs."""


class Reinitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = InnerLinear(16, 16)
        self.head = nn.Linear(16, 16)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for m in (self.inner, self.head):
            m.reset_parameters()


def _init_weights_starts_case() -> dict[str, dict[str, torch.Tensor]]:
    """``InitWeights`` on a model that starts real and on one that starts on meta."""
    out = {}
    for start in ("cpu", "meta"):
        torch.manual_seed(dist.get_rank())  # real starts that differ between ranks
        with torch.device(start):
            model = Reinitialized()
        builder = FullyShardBuilder().device(CPUDevice()).wrap(InnerLinear)
        out[start] = full_state_dict(builder.materialize(InitWeights(seed=4)).build(model))
    return out


CHECKPOINTED = {
    "stream": lambda: StreamInit(whole_below=0),
    "shard_first": lambda: ShardFirstReset(seed=3),
    "checkpoint_free": lambda: DeterministicInit(seed=3),
}


def _checkpointed_records_case(name: str) -> list[bool]:
    """Whether, right after the build, each FSDP2 record of a checkpointed unit's parameter
    reads the storage the module's parameter holds (what the optimizer steps)."""
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).activation_checkpointing(Block)
    model = builder.materialize(CHECKPOINTED[name]()).build(make_model(CFG, device="meta"))
    out = []
    for module in model.modules():
        params = fast_storage.fsdp2_params(module) or []
        for record in params:
            held = getattr(record._module_info.module, record._module_info.param_name)
            storage = held._local_tensor.untyped_storage()._cdata
            same = storage == record._sharded_param_data.untyped_storage()._cdata
            out.append(same and record.sharded_param is held)
    return out


class NestedRowWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight[1][2:4].zero_()  # a view of the row's copy: not traced to the shard


class StaleRowWrite(NestedRowWrite):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            row = self.weight[1]  # a copy, then the parameter written again
            self.weight.normal_()
            row.mul_(2)  # eager doubles the new row; the copy holds the old one


class NestedInitWeights(nn.Sequential):
    """A whole-model initializer (InitWeights) that writes through a view of a row copy."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        cast(NestedRowWrite, self[0]).reset_parameters()


REFUSED_ROW_WRITES = {"nested": NestedRowWrite, "stale": StaleRowWrite}


def _row_write_refused_case(name: str) -> str:
    with torch.device("meta"):
        model = (
            NestedInitWeights(NestedRowWrite())
            if name == "init_weights"
            else nn.Sequential(REFUSED_ROW_WRITES[name]())
        )
    materializer = InitWeights(seed=3) if name == "init_weights" else ShardFirstReset(seed=3)
    try:
        FullyShardBuilder().device(CPUDevice()).materialize(materializer).build(model)
    except MaterializationError as exc:
        return str(exc)
    return "built"


# -- the spawns -------------------------------------------------------------------------------

SIZES = [2, 4]
SPAWNS = Spawns(rank_main, timeout=240)


def scenario(size: int, key: Hashable) -> list[Any]:
    """Scenario ``key`` on ``size`` ranks, per rank; one spawn per size, whichever test asks
    first."""
    return values(SPAWNS(size, size), key)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), name


@functools.cache
def _plain_reference(size: int) -> dict[str, Any]:
    return reference(make_model(CFG), CFG, STEPS, size)


def _reference_from(state: dict[str, torch.Tensor], world: int) -> dict[str, Any]:
    model = make_model(CFG)
    model.load_state_dict(state)
    return reference(model, CFG, STEPS, world)


def _repeated(full: torch.Tensor, parts: int) -> bool:
    chunks = full.chunk(parts)
    return len(chunks) == parts and all(torch.equal(chunks[0], c) for c in chunks[1:])


def _random_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters an initializer draws at random (not constants such as zero biases)."""
    return {k: v for k, v in state.items() if v.ndim == 2 and float(v.std()) > 0}


# -- multi-rank results -----------------------------------------------------------------------

TRAIN_CASES = [(size, key) for size in SIZES for key in TRAIN[size]]


@pytest.mark.parametrize(("size", "key"), TRAIN_CASES)
def test_training_matches_single_process_reference(size: int, key: str) -> None:
    ranks = scenario(size, ("train", key))
    ref = _plain_reference(size)
    for rank in range(size):
        got = ranks[rank]
        assert torch.allclose(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"][rank]), atol=1e-5, rtol=0
        ), (key, rank, got["losses"], ref["losses"][rank])
        _close(got["final"], ref["state_dict"])


# The device mesh each training scenario shards over.
MESHES = {
    "full/None": lambda size: [size],
    "grad_op/None": lambda size: [size],
    "none/None": lambda size: [size, 1],
    "hybrid/auto": lambda size: [size // 2, 2],
    "hybrid/mesh": lambda size: [size // 2, 2],
}


@pytest.mark.parametrize(("size", "key"), TRAIN_CASES)
def test_strategies_map_to_meshes_and_reshard(size: int, key: str) -> None:
    result = scenario(size, ("train", key))[0]
    assert result["mesh"] == MESHES[key](size)
    if key.startswith("hybrid/"):
        assert result["strategy"] == "HYBRID_SHARD"
    if key == "none/None":
        assert result["param_local_numel"] == CFG_NUMEL
    assert result["fsdp_modules"] == result["units"]


CFG_NUMEL = sum(p.numel() for p in make_model(CFG, device="meta").parameters())


@pytest.mark.parametrize("size", SIZES)
def test_deterministic_init_gives_the_same_weights_on_both_backends(size: int) -> None:
    fsdp1 = scenario(size, ("deterministic", "fsdp1"))[0]
    per_rank = scenario(size, ("deterministic", "fsdp2"))
    fsdp2 = per_rank[0]
    assert fsdp1.keys() == fsdp2.keys()
    for name in fsdp1:
        assert torch.equal(fsdp1[name], fsdp2[name]), name
    for rank in range(1, size):
        for name in fsdp2:
            assert torch.equal(per_rank[rank][name], fsdp2[name]), name


@pytest.mark.parametrize("size", SIZES)
def test_plain_reset_parameters_on_meta_repeats_one_shard(size: int) -> None:
    """The defect the shard-first materializer exists for: every rank draws the same numbers."""
    weights = _random_weights(scenario(size, "raw_defect")[0])
    assert weights and all(_repeated(w, size) for w in weights.values())


@pytest.mark.parametrize("size", SIZES)
def test_shard_first_shards_differ_and_replicas_agree(size: int) -> None:
    ranks = scenario(size, "shard_first")
    state = ranks[0]["initial"]
    shards = ranks[0]["shard_size"]
    weights = _random_weights(state)
    assert weights
    repeated = [k for k, w in weights.items() if _repeated(w, shards)]
    assert not repeated, repeated
    for rank in range(1, size):  # the gathered weights agree on every rank (replicas too)
        for name, value in state.items():
            assert torch.equal(ranks[rank]["initial"][name], value), name


@pytest.mark.parametrize("name", sorted(ROW_WRITES))
def test_rows_an_initializer_writes_on_a_sharded_parameter_are_as_in_eager(name: str) -> None:
    # DTensor gathers ``weight[i]`` into a copy; a write into the copy once left the shard as
    # drawn: Embedding's padding row stayed random on 2 ranks. Eager's written rows are
    # constants, so they are compared by value, the drawn rest by being drawn.
    eager = RowWritten().state_dict()
    for state in scenario(2, ("row_writes", name)):
        for key in ("embed.weight", "striped.weight"):
            written = torch.zeros(eager[key].shape[0], dtype=torch.bool)
            written[[5] if key == "embed.weight" else [1, 5, 9, 12]] = True
            assert torch.equal(state[key][written], eager[key][written]), (name, key)
            assert (state[key][~written] != 0).all() and (state[key][~written] != 7).all()


@pytest.mark.parametrize(("name", "op"), [("nested", "zero_"), ("stale", "mul_")])
def test_a_row_write_that_cannot_reach_its_shard_is_refused(name: str, op: str) -> None:
    cls = REFUSED_ROW_WRITES[name].__name__
    for message in scenario(2, ("row_write_refused", name)):
        assert re.search(
            rf"'0' \({cls}\).*aten\.{op}.*copy of a sharded parameter", message, re.S
        ), message


def test_init_weights_refuses_a_row_write_that_cannot_reach_its_shard() -> None:
    for message in scenario(2, ("row_write_refused", "init_weights")):
        assert re.search(
            r"`InitWeights`: the model's init_weights\(\) cannot run on local shards.*"
            r"aten\.zero_.*copy of a sharded parameter.*StreamInit",
            message,
            re.S,
        ), message


@pytest.mark.parametrize("size", SIZES)
def test_init_weights_draws_each_shard_apart_whether_the_model_starts_real_or_on_meta(
    size: int,
) -> None:
    # A real model once drew every rank's shard of an inner unit under one seed: its halves
    # repeated. Plain init_weights draws each element independently, so no shard repeats
    # another, and the states are all overwritten, so where they started cannot matter.
    for rank, starts in enumerate(scenario(size, "init_weights_starts")):
        for name, value in starts["cpu"].items():
            assert not _repeated(value, size), (rank, name)
            assert torch.equal(value, starts["meta"][name]), (rank, name)


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_checkpointed_units_leave_fsdp2_reading_the_parameters_the_optimizer_steps(
    name: str,
) -> None:
    # A checkpointed unit is sharded through its wrapper; its shards were once given storage
    # module by module, leaving FSDP2's records on the meta shards until the first forward.
    for records in scenario(2, ("checkpointed_records", name)):
        assert records and all(records), records


@pytest.mark.parametrize("size", SIZES)
def test_synchronizers_keep_shard_first_shards(size: int) -> None:
    initial = scenario(size, "shard_first")[0]["initial"]
    for synced in scenario(size, "shard_first_synced"):
        _close(synced, initial, atol=0)


@pytest.mark.parametrize("size", SIZES)
def test_shard_first_allocates_one_shard_per_rank(size: int) -> None:
    for rank, r in enumerate(scenario(size, "shard_first")):
        expected = r["model_bytes"] / r["shard_size"]
        assert abs(r["param_bytes"] - expected) <= 0.1 * expected + r["largest_unit_bytes"], (
            rank,
            r["param_bytes"],
            expected,
        )
        assert r["param_bytes"] < r["model_bytes"]


@pytest.mark.parametrize("size", SIZES)
def test_shard_first_model_trains_like_the_reference(size: int) -> None:
    ranks = scenario(size, "shard_first")
    ref = _reference_from(ranks[0]["initial"], size)
    for rank in range(size):
        got = torch.tensor(ranks[rank]["losses"])
        assert torch.allclose(got, torch.tensor(ref["losses"][rank]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", SIZES)
def test_state_dict_is_scattered_from_rank0(size: int) -> None:
    ranks = scenario(size, "from_state_dict")
    source = make_model(CFG, seed=7).state_dict()
    ref = reference(make_model(CFG, seed=7), CFG, STEPS, size)
    for rank in range(size):
        r = ranks[rank]
        for name, value in source.items():
            assert torch.equal(r["state"][name], value), name
        assert torch.allclose(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"][rank]), atol=1e-5, rtol=0
        )
    for rank in range(1, size):
        # Each non-source rank receives about its own slices, never the whole model.
        r = ranks[rank]
        expected = r["model_bytes"] / r["shard_size"]
        assert 0 < r["received"] <= 1.1 * expected + 1024, (rank, r["received"], expected)


@pytest.mark.parametrize("size", SIZES)
def test_uneven_shards_load_exactly(size: int) -> None:
    source = _odd_source()
    for got in scenario(size, ("load", "odd")):
        assert got.keys() == source.keys()
        for key, value in source.items():
            assert got[key].dtype == _odd_model("meta").state_dict()[key].dtype, key
            assert torch.equal(got[key], value.to(got[key].dtype)), key


@pytest.mark.parametrize("size", SIZES)
def test_a_failing_read_raises_on_every_rank(size: int) -> None:
    for message in scenario(size, ("load", "read_error")):
        assert "could not read unit 'blocks.1'" in message, message
        assert "disk went away" in message, message


ERROR_PATTERNS = {
    "meshgroups_3d": lambda size: "a 3-D mesh of shape",
    "factory_3d": lambda size: (
        "FullyShardBuilder.groups` got an invalid `mesh`: a 3-D mesh of shape"
    ),
    "factory_size": lambda size: f"the mesh spans 1 ranks but the world has {size}",
    "meshgroups_size": lambda size: f"the mesh spans 1 ranks but the world has {size}",
}
assert ERROR_PATTERNS.keys() == ERRORS.keys()


@pytest.mark.parametrize("name", list(ERRORS))
@pytest.mark.parametrize("size", SIZES)
def test_bad_meshes_are_refused(size: int, name: str) -> None:
    for message in scenario(size, ("errors", name)):
        assert ERROR_PATTERNS[name](size) in message, message


@pytest.mark.parametrize("name", TIED)
@pytest.mark.parametrize("size", SIZES)
def test_tied_parameters_stay_tied(size: int, name: str) -> None:
    ranks = scenario(size, ("tied", name))
    initial = ranks[0]["initial"]
    for rank in range(size):
        assert ranks[rank]["tied"], name
    model = TiedLM.__new__(TiedLM)
    nn.Module.__init__(model)
    model.inner = make_model(CFG)
    model.inner.head.weight = model.inner.embed.weight
    model.load_state_dict(initial)
    ref = reference(model, CFG, STEPS, size)
    for rank in range(size):
        got = torch.tensor(ranks[rank]["losses"])
        assert torch.allclose(got, torch.tensor(ref["losses"][rank]), atol=1e-5, rtol=0)


# -- option mapping (no process group) --------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"limit_all_gathers": False}, "always limits in-flight all-gathers"),
        ({"use_orig_params": False}, "always keeps the original parameters"),
        ({"backward_prefetch": BackwardPrefetch.BACKWARD_POST}, "has no BACKWARD_POST mode"),
        ({"backward_prefetch": None}, "has no None mode"),
        ({"forward_prefetch": True}, "needs the forward prefetch order given explicitly"),
        (
            {"mixed_precision": MixedPrecision(buffer_dtype=torch.float16)},
            "invalid `buffer_dtype`: FSDP2 keeps buffers",
        ),
        (
            {"mixed_precision": MixedPrecision(keep_low_precision_grads=True)},
            "invalid `keep_low_precision_grads`",
        ),
    ],
)
def test_refused_options(changes: dict[str, Any], match: str) -> None:
    options = ShardingOptions().set(**changes)
    with pytest.raises(ConfigurationError, match=match):
        FullyShardBackend().check(options)


@pytest.mark.parametrize(
    "changes",
    [
        {"limit_all_gathers": True},
        {"use_orig_params": True},
        {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": False},
        # Unset options keep their FSDP1 defaults and are not judged.
        {},
    ],
)
def test_accepted_fsdp1_options(changes: dict[str, Any]) -> None:
    check_fsdp1_only_options(ShardingOptions().set(**changes))


def test_mixed_precision_maps_to_policy() -> None:
    mp = MixedPrecision(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
        cast_root_forward_inputs=True,
    )
    root = mixed_precision_policy(mp, is_root=True)
    inner = mixed_precision_policy(mp, is_root=False)
    assert (root.param_dtype, root.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert root.cast_forward_inputs and not inner.cast_forward_inputs


def test_cpu_offload_maps_to_policy() -> None:
    options = ShardingOptions().set(cpu_offload=CPUOffload(offload_params=True))
    assert isinstance(offload_policy(options, torch.device("cuda", 0)), CPUOffloadPolicy)
    # Computing on the CPU, the parameters are already there.
    assert not isinstance(offload_policy(options, torch.device("cpu")), CPUOffloadPolicy)
    assert not isinstance(
        offload_policy(ShardingOptions(), torch.device("cuda", 0)), CPUOffloadPolicy
    )


def test_ignored_params_need_a_torch_that_supports_them() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ignored = frozenset(model[0].parameters())

    def old_fully_shard(module: nn.Module, *, mesh: Any = None) -> nn.Module:
        return module

    assert ignored_params_kwargs(model, ignored)["ignored_params"] == set(ignored)
    assert ignored_params_kwargs(model, frozenset(), old_fully_shard) == {}
    with pytest.raises(ConfigurationError, match=r"has no fully_shard\(ignored_params=...\)"):
        ignored_params_kwargs(model, ignored, old_fully_shard)


def test_shard_first_reset_validates_its_seed() -> None:
    with pytest.raises(ConfigurationError, match="invalid `seed`"):
        ShardFirstReset(seed=-1)


def test_builder_refuses_fsdp1_only_options_before_any_collective(world1: None) -> None:
    builder = FullyShardBuilder().device(CPUDevice()).limit_all_gathers(False)
    with pytest.raises(ConfigurationError, match="always limits in-flight all-gathers"):
        builder.build(make_model(CFG))


def test_single_rank_build_trains(world1: None) -> None:
    with pytest.warns(UserWarning, match="NO_SHARD instead of FULL_SHARD"):
        model = FullyShardBuilder().device(CPUDevice()).wrap(Block).build(make_model(CFG))
    assert isinstance(model, FSDPModule)
    losses = train(model, CFG, STEPS, 0, 1)
    ref = reference(make_model(CFG), CFG, STEPS, 1)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref["losses"][0]), atol=1e-5, rtol=0)


@pytest.mark.timeout(240)
def test_cli_demo_runs_without_sharding(capsys: pytest.CaptureFixture[str]) -> None:
    """NO_SHARD is the strategy FSDP2 has no direct counterpart for; the other strategies run
    through the same command in the multi-rank tests above (each CLI run starts its own ranks).
    The command's own process is tested in test_cli; here it runs in this process."""
    args = ["demo", "--backend", "fsdp2", "--strategy", "none", "--json", "--timeout", "120"]
    assert cli_main([*args, "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["backend"], out["strategy"]) == ("fsdp2", "NO_SHARD")
    # The demo trains on a fixed batch (its losses fall).
    ref = reference(deterministic_model(seed=DEMO_SEED), DemoConfig(), STEPS, 2, fixed_batch=True)
    for rank, losses in enumerate(out["losses_per_rank"]):
        assert torch.allclose(
            torch.tensor(losses), torch.tensor(ref["losses"][rank]), atol=1e-5, rtol=0
        )


def test_ignored_parameters_and_modules_stay_unsharded(world1: None) -> None:
    model = make_model(CFG)
    head = model.head
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).ignore(modules=[head])
    sharded = builder.build(model)
    assert not isinstance(head.weight, DTensor) and not isinstance(head.bias, DTensor)
    assert isinstance(sharded.embed.weight, DTensor)  # type: ignore[union-attr]

    model = make_model(CFG)
    norm_weight = model.norm.weight
    FullyShardBuilder().device(CPUDevice()).ignore(states=[norm_weight]).build(model)
    assert model.norm.weight is norm_weight and not isinstance(norm_weight, DTensor)
    assert isinstance(model.norm.bias, DTensor)


def _fsdp_params(model: nn.Module) -> list[Any]:
    # FSDP2's own records of each sharded parameter (the state its forward starts from).
    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            found += [p for g in groups if g is not None for p in g.fsdp_params]
    return found


def test_shard_first_build_leaves_fsdp_state_as_to_empty_does(world1: None) -> None:
    """After a shard-first build FSDP2 points at the new local shards, as after plain
    ``fully_shard`` on meta + ``to_empty`` (whose ``FSDPModule._apply`` re-points them): no
    meta shard is left for the first forward to replace."""
    with pytest.warns(UserWarning, match="NO_SHARD instead of FULL_SHARD"):
        builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).materialize(SHARDWISE)
        built = builder.build(make_model(CFG, device="meta"))
    assert builder.report.records[0].stage == "shard"
    plain = make_model(CFG, device="meta")
    for block in plain.modules():
        if isinstance(block, Block):
            fully_shard(block)
    fully_shard(plain)
    plain.to_empty(device="cpu")
    for model in (plain, built):
        records = _fsdp_params(model)
        assert len(records) == len(list(model.parameters())) > 0
        for record in records:
            local = record.sharded_param._local_tensor
            assert not record._sharded_param_data.is_meta
            assert record._sharded_param_data.data_ptr() == local.data_ptr()


class _TiedNormBlock(nn.Module):
    # Two Linears sharing one weight, and BatchNorm: parameters and buffers in one module.
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.relu(self.a(x))))


# Each private FSDP2 name the direct way reads, by the tuple of fast_storage that lists it.
HIDDEN = [
    (group, name)
    for group in ("MODULE_NAMES", "GROUP_NAMES", "RECORD_NAMES", "SHARDED_NAMES")
    for name in getattr(fast_storage, group)
]


@pytest.mark.parametrize(
    "hidden", [None, *HIDDEN, ("STATE_NAMES", "*")], ids=lambda h: "direct" if h is None else h[1]
)
def test_shard_storage_keeps_parameters_ties_and_buffers_as_to_empty_does(
    world1: None, hidden: tuple[str, str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default FSDP2 build gives shards storage without ``to_empty``: each Parameter object
    stays the one ``fully_shard`` made and FSDP2 records (as ``to_empty`` keeps them), tied
    slots hold one Parameter, BatchNorm's buffers get storage and their reset values, equal
    shard layouts share one sharding spec, and the model trains like plain ``fully_shard`` +
    ``to_empty`` + ``reset_parameters`` given the same weights. The same through ``to_empty``,
    the way taken on a torch whose FSDP2 lacks what the direct way uses."""
    taken: list[str] = []
    if hidden is not None:
        # A torch without that name: the public to_empty way, with the same results.
        group, name = hidden
        every = getattr(fast_storage, group)
        names = tuple("not_in_this_torch" if name in (n, "*") else n for n in every)
        monkeypatch.setattr(fast_storage, group, names)
        to_empty = tree._to_empty_unit

        def counted(*args: Any) -> int:
            taken.append("to_empty")
            return to_empty(*args)

        monkeypatch.setattr(tree, "_to_empty_unit", counted)

    def make() -> nn.Sequential:
        with torch.device("meta"):
            return nn.Sequential(_TiedNormBlock(), _TiedNormBlock())

    builder = FullyShardBuilder().device(CPUDevice()).wrap(_TiedNormBlock).materialize(SHARDWISE)
    with pytest.warns(UserWarning, match="NO_SHARD"):
        built = builder.build(make())
    assert builder.report.records[0].stage == "shard"
    assert taken == ([] if hidden is None else ["to_empty"] * 2)  # each block's unit
    for block in cast(list[_TiedNormBlock], list(built.children())):
        assert block.b.weight is block.a.weight
        norm = block.norm
        assert norm.running_mean is not None and norm.running_var is not None
        assert torch.equal(norm.running_mean, torch.zeros(8))
        assert torch.equal(norm.running_var, torch.ones(8))
        assert int(cast(torch.Tensor, norm.num_batches_tracked)) == 0
    records = _fsdp_params(built)
    assert len(records) == len(list(built.parameters())) == 10  # one record per tied weight
    for record in records:
        info = record._module_info
        assert getattr(info.module, info.param_name) is record.sharded_param
        local = record.sharded_param._local_tensor
        assert not local.is_meta and record._sharded_param_data.data_ptr() == local.data_ptr()
    layouts = {(tuple(p.shape), p.dtype) for p in built.parameters()}
    assert len({id(cast(DTensor, p)._spec) for p in built.parameters()}) == len(layouts)

    plain = make()
    for child in plain:
        fully_shard(child)
    fully_shard(plain)
    plain.to_empty(device="cpu")
    plain.load_state_dict(built.state_dict())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    outputs = [m(x) for m in (built, plain)]
    assert torch.equal(outputs[0], outputs[1])
    for out in outputs:
        out.square().sum().backward()
    for (name, p), q in zip(built.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(
            cast(DTensor, p.grad).full_tensor(), cast(DTensor, q.grad).full_tensor()
        ), name


@pytest.mark.parametrize("size", SIZES)
def test_uneven_shards_are_settled_and_world_size_invariant(world1: None, size: int) -> None:
    """Uneven shards (5 and 1 rows over 2 and 4 ranks): after the default build FSDP2 holds
    each padded shard, and the full weights are those of a one-rank build (in this process)."""
    ranks = scenario(size, "settled_odd")
    with pytest.warns(UserWarning, match="NO_SHARD"):
        one_rank = _settled_odd_case()
    assert all(all(r) for r in one_rank["records"])
    for got in ranks:
        assert got["records"] and all(all(r) for r in got["records"]), got["records"]
        assert got["state"].keys() == one_rank["state"].keys()
        for key, value in one_rank["state"].items():
            assert torch.equal(got["state"][key], value), key
