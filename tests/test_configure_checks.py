"""Every refusal happens in the configure stage: before any collective, with the model untouched,
naming the argument and a fix. Each case watches the collectives and the agreements of the
build: the first thing the ranks do together must be the "configure" agreement carrying the
error, and the model (module types, state) must be what it was."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_builder import (
    BaseSynchronizer,
    ConfigurationError,
    CPUDevice,
    DeterministicInit,
    FromCheckpoint,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    InitWeights,
    ResetParameters,
    ShardingBuilder,
)
from fsdp_builder.backends.registry import BACKENDS
from fsdp_builder.builder import builder_for
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import plan_units
from fsdp_builder.planning.wrap import WrapPolicy
from fsdp_builder.runtime.agreement import Agreement
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer

ROOT = Path(__file__).resolve().parents[1]
CFG = DemoConfig(vocab=16, dim=8, heads=2, layers=2, seq=4)

# What ranks do together: torch.distributed's collectives and group creation.
COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "new_group",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


@contextlib.contextmanager
def watching() -> Iterator[list[tuple[Any, ...]]]:
    """Record, in order, each collective call and each agreement (its stage and whether it
    carried this rank's error)."""
    log: list[tuple[Any, ...]] = []

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            log.append(("collective", name))
            return real(*args, **kwargs)

        return call

    real_agree = Agreement.agree

    def agree(self: Agreement, stage: str, error: BaseException | None, *a: Any, **k: Any) -> Any:
        log.append(("agree", stage, error is not None))
        return real_agree(self, stage, error, *a, **k)

    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, counted(name, getattr(dist, name))))
        stack.enter_context(mock.patch.object(Agreement, "agree", agree))
        yield log


def snapshot(model: nn.Module) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
    """Module types by name and every state's name, shape, dtype, device and bytes."""
    types = [(name, type(m).__name__) for name, m in model.named_modules()]
    states = []
    for name, t in model.state_dict(keep_vars=True).items():
        local = t.to_local() if isinstance(t, DTensor) else t
        data = None if local.is_meta else local.detach().cpu().numpy().tobytes()
        states.append((name, tuple(t.shape), t.dtype, t.device.type, data))
    return types, states


def attempt(build: Callable[[nn.Module], Any], model: nn.Module) -> dict[str, Any]:
    """Build and expect a ConfigurationError: its message, what ran together before it, and
    whether the model is untouched."""
    before = snapshot(model)
    with watching() as log:
        try:
            build(model)
        except ConfigurationError as exc:
            message = str(exc)
        else:
            raise AssertionError("the build was not refused")
    return {"message": message, "log": log, "untouched": snapshot(model) == before}


def assert_refused_in_configure(outcome: dict[str, Any], argument: str, fix: str) -> None:
    assert re.search(argument, outcome["message"]), outcome["message"]
    assert re.search(fix, outcome["message"]), outcome["message"]
    # The first thing ranks did together is the configure agreement, carrying the error.
    assert outcome["log"][:1] == [("agree", "configure", True)], outcome["log"]
    assert outcome["untouched"]


def refused(
    build: Callable[[nn.Module], Any], model: nn.Module, argument: str, fix: str
) -> dict[str, Any]:
    outcome = attempt(build, model)
    assert_refused_in_configure(outcome, argument, fix)
    return outcome


def demo() -> DemoTransformer:
    torch.manual_seed(0)
    return DemoTransformer(CFG)


class ScalarBelowChild(nn.Module):
    """A scalar parameter next to a child that is wrapped first."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.tensor(2.0))


# -- the backend owns its knowledge ----------------------------------------------------------


def backend_name_comparisons() -> re.Pattern[str]:
    """A backend name compared (``==``, ``!=``, ``in``) or used as a table's key."""
    quoted = "[\"'](?:" + "|".join(map(re.escape, BACKENDS)) + ")[\"']"
    return re.compile(rf"(?:==|!=|\bin\b)\s*[(\[{{]?\s*{quoted}|{quoted}\s*(?:==|!=|:)")


def test_no_code_outside_backends_branches_on_a_backend_name() -> None:
    comparison = backend_name_comparisons()
    # What the pattern is for: the branches and tables that lived in estimate.py and cli.py.
    for former in (
        'if backend == "fsdp1":',
        'FullyShardBuilder() if backend == "fsdp2" else FSDPBuilder()',
        'return {"fsdp1": "FSDPBuilder", "fsdp2": "FullyShardBuilder"}.get(name)',
    ):
        assert comparison.search(former), former
    package = ROOT / "fsdp_builder"
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).parts[0] != "backends"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if comparison.search(line)
    ]
    assert not found, "ask the backend object (fsdp_builder.backends) instead:\n" + "\n".join(found)


def test_every_backend_names_its_builder_and_layout() -> None:
    plan = plan_units(demo(), WrapPolicy(classes=(Block,)), IgnoredStates())
    for name, backend in BACKENDS.items():
        assert type(builder_for(name)).__name__ == backend.builder
        for unit in plan:
            # Split over one rank a unit is kept whole; over more, never more than whole.
            assert backend.kept_bytes(unit, 1) == unit.param_bytes
            assert 0 < backend.kept_bytes(unit, 4) <= unit.param_bytes
    with pytest.raises(ConfigurationError, match=r"'fsdp3' is not a backend.*'fsdp1', 'fsdp2'"):
        builder_for("fsdp3")


# -- the configure context, and the hooks that came before it --------------------------------


class RefusesInCheck(ResetParameters):
    """A user subclass written against ``check(plan, ignored)``."""

    def check(self, plan: Any, ignored: Any) -> None:
        raise ConfigurationError(f"`RefusesInCheck` got an invalid `plan`: {len(plan)} units. Fix.")


class SeesTheContext(BaseSynchronizer):
    communicates = False

    def __init__(self, seen: list[ConfigureContext]) -> None:
        self.seen = seen

    def check_context(self, context: ConfigureContext) -> None:
        self.seen.append(context)
        raise ConfigurationError("`SeesTheContext` got an invalid `context`: planted. Fix.")

    def synchronize(self, unit: Any, env: Any) -> int:
        return 0


def test_a_materializer_checking_the_plan_still_refuses_in_configure(world1: None) -> None:
    """The former ``check(plan, ignored)`` hook still refuses, with a deprecation warning
    naming the one hook that replaces it."""
    build = FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(RefusesInCheck()).build
    with pytest.warns(DeprecationWarning, match=r"RefusesInCheck.check.*check_context"):
        refused(build, demo(), r"`RefusesInCheck` got an invalid `plan`: 3 units", r"Fix")


def test_any_role_may_check_the_whole_context(world1: None) -> None:
    seen: list[ConfigureContext] = []
    model = demo()
    build = FullyShardBuilder().device(CPUDevice()).wrap(Block).synchronize(SeesTheContext(seen))
    refused(build.build, model, r"`SeesTheContext` got an invalid `context`", r"Fix")
    [context] = seen
    assert context.model is model and len(context.plan) == 3
    assert (context.backend.name, context.backend.builder) == ("fsdp2", "FullyShardBuilder")
    assert context.backend.supports_shard_first and context.world_size == 1


# -- FSDP1: a scalar parameter below a wrapped child -----------------------------------------


def test_plain_fsdp1_leaves_a_scalar_model_half_built(world1: None) -> None:
    """The pattern as torch runs it: the child is wrapped, then the root refuses the scalar."""
    model = ScalarBelowChild()
    model.body[0] = FullyShardedDataParallel(model.body[0], device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match="scalar parameters"):
        FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    assert isinstance(model.body[0], FullyShardedDataParallel)


def test_fsdp1_refuses_a_scalar_below_a_wrapped_child_in_configure(world1: None) -> None:
    build = FSDPBuilder().device(CPUDevice()).wrap(nn.Linear).build
    refused(build, ScalarBelowChild(), r"scalar \(0-dim\).*'scale'", r"1-D tensor of one element")


# -- materializers that need the backend's capabilities ---------------------------------------


class WithInitWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.ones_(self.lin.weight)


def test_init_weights_on_fsdp1_is_refused_in_configure(world1: None) -> None:
    with torch.device("meta"):
        model = WithInitWeights()
    build = FSDPBuilder().device(CPUDevice()).materialize(InitWeights(seed=0)).build
    refused(build, model, r"`InitWeights`.*FSDPBuilder cannot shard a unit on meta", r"Use Fully")


# -- per-unit arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("builder", "fn", "argument", "fix"),
    [
        (
            FullyShardBuilder,
            lambda m, fqn: {"reshard_after_froward": False},
            r"invalid `reshard_after_froward`",
            r"Use 'reshard_after_forward'",
        ),
        (
            FullyShardBuilder,
            lambda m, fqn: {"mp_policy": "bf16"} if fqn else None,
            r"invalid `mp_policy`: expected MixedPrecisionPolicy for unit 'blocks.0'",
            r"Pass a torch.distributed.fsdp.MixedPrecisionPolicy",
        ),
        (
            FSDPBuilder,
            lambda m, fqn: {"forward_prefetch": "yes"},
            r"invalid `forward_prefetch`: 'yes' for unit 'blocks.0' is not valid",
            r"Return what FullyShardedDataParallel's forward_prefetch takes",
        ),
        (
            FSDPBuilder,
            lambda m, fqn: {"sharding_strategy": "quarter"},
            r"invalid `sharding_strategy`: 'quarter' for unit 'blocks.0'",
            r"Return what FullyShardedDataParallel's sharding_strategy takes",
        ),
        (
            FSDPBuilder,
            lambda m, fqn: {"cpu_offload": CPUOffloadPolicy()},
            r"invalid `cpu_offload`: CPUOffloadPolicy for unit 'blocks.0' is fully_shard's",
            r"Return CPUOffload\(offload_params=True\) or a bool",
        ),
        (
            FSDPBuilder,
            lambda m, fqn: {"forward_prefetc": True},
            r"invalid `forward_prefetc`",
            r"Did you mean 'forward_prefetch'",
        ),
        (
            FullyShardBuilder,
            lambda m, fqn: {"reshard_after_forward": 3} if fqn == "blocks.1" else None,
            r"per_unit` got an invalid `reshard_after_forward`: 3 does not divide",
            r"Pass True, False, or one of \[1\]",
        ),
    ],
    ids=[
        "fsdp2-misspelled",
        "fsdp2-mistyped",
        "fsdp1-mistyped",
        "fsdp1-bad-value",
        "fsdp1-offload",
        "fsdp1-typo",
        "fsdp2-reshard",
    ],
)
def test_per_unit_arguments_are_checked_in_configure(
    world1: None,
    builder: Callable[[], ShardingBuilder],
    fn: Callable[[nn.Module, str], Any],
    argument: str,
    fix: str,
) -> None:
    build = builder().device(CPUDevice()).wrap(Block).per_unit(fn).build
    refused(build, demo(), argument, fix)


def test_a_raising_per_unit_function_is_named_with_its_unit(world1: None) -> None:
    table = {"blocks.0": {"reshard_after_forward": True}}
    build = FullyShardBuilder().device(CPUDevice()).wrap(Block).per_unit(lambda m, fqn: table[fqn])
    outcome = refused(
        build.build,
        demo(),
        r"`FullyShardBuilder.per_unit` got an invalid `fn`: the function raised KeyError: "
        r"'blocks.1' for unit 'blocks.1' \(Block\)",
        r"return a dict of arguments, or None, for every unit",
    )
    assert "blocks.0" not in outcome["message"].split("for unit")[1]


# -- options that depend on the group or the machine ------------------------------------------


def test_plain_fully_shard_refuses_a_reshard_size_that_does_not_divide(world1: None) -> None:
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=2)


def test_a_reshard_size_that_does_not_divide_the_world_is_refused_in_configure(
    world1: None,
) -> None:
    build = FullyShardBuilder().device(CPUDevice()).wrap(Block).reshard_after_forward(2).build
    refused(
        build,
        demo(),
        r"invalid `reshard_after_forward`: 2 does not divide the world size of 1 rank",
        r"Pass True, False, or one of \[1\]",
    )


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinned memory works here")
def test_pinned_offload_without_an_accelerator_is_refused_when_set_or_per_unit(
    world1: None,
) -> None:
    with pytest.raises(ConfigurationError, match=r"invalid `pin_memory`.*pin_memory=False"):
        FullyShardBuilder().cpu_offload(CPUOffloadPolicy(pin_memory=True))
    pinned = {"offload_policy": CPUOffloadPolicy(pin_memory=True)}
    build = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    build.per_unit(lambda m, fqn: pinned if fqn else None)
    refused(build.build, demo(), r"invalid `pin_memory`", r"CPUOffloadPolicy\(pin_memory=False\)")


# -- composition: compile and activation checkpointing ----------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument", "fix"),
    [
        ({"backend": "no_such_backend"}, r"invalid `backend`.*'no_such_backend'", r"'eager'"),
        ({"backend": 3}, r"invalid `backend`: expected a backend name", r"backend='inductor'"),
        ({"mode": "fastest"}, r"invalid `mode`: 'fastest'", r"'max-autotune'"),
    ],
)
def test_compile_arguments_are_refused_when_set(
    kwargs: dict[str, Any], argument: str, fix: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"{argument}.*{fix}"):
        FullyShardBuilder().compile(**kwargs)


def test_compile_per_unit_without_units_is_refused_in_configure(world1: None) -> None:
    build = FullyShardBuilder().device(CPUDevice()).compile(backend="eager").build
    refused(build, demo(), r"invalid `per_unit`", r"\.wrap\(BlockClass\)")


class NotInTheModel(nn.Module):
    pass


def test_checkpointing_a_class_not_in_the_model_names_the_blocks(world1: None) -> None:
    build = FSDPBuilder().device(CPUDevice()).wrap(Block).activation_checkpointing(NotInTheModel)
    refused(
        build.build,
        demo(),
        r"activation_checkpointing` got an invalid `policy`: it chooses no module of "
        r"DemoTransformer",
        r"Classes of DemoTransformer that look like blocks: Block; pass those, e.g. "
        r"`\.activation_checkpointing\(Block\)`",
    )


def test_checkpointing_what_the_model_has_still_builds(world1: None) -> None:
    model = demo()
    FSDPBuilder().device(CPUDevice()).wrap(Block).activation_checkpointing(Block).build(model)
    assert any("CheckpointWrapper" in type(m).__name__ for m in model.modules())


# -- shard_placement_fn: what fully_shard would refuse per parameter --------------------------


def _raises(p: nn.Parameter) -> Shard | None:
    raise ValueError("no rule for this shape")


@pytest.mark.parametrize(
    ("fn", "argument", "fix"),
    [
        (
            _raises,
            r"shard_placement_fn` got an invalid `fn`: it raised for 'blocks.0.norm1.weight' "
            r"\(shape \[8\], unit 'blocks.0'\): ValueError: no rule for this shape",
            r"return Shard\(dim\) or None for every parameter",
        ),
        (
            lambda p: Replicate(),
            r"invalid `fn`: it returned Replicate\(\) for '[\w.]+'",
            r"Return None \(dim 0\) or Shard\(dim\) with -\d <= dim < \d",
        ),
        (
            lambda p: Shard(p.ndim),
            r"invalid `fn`: it returned Shard\(dim=\d\) for '[\w.]+' \(shape",
            r"Return None \(dim 0\) or Shard\(dim\)",
        ),
    ],
    ids=["raises", "not-a-shard", "no-such-dim"],
)
def test_placement_answers_fully_shard_refuses_are_refused_in_configure(
    world1: None, fn: Callable[[nn.Parameter], Any], argument: str, fix: str
) -> None:
    build = FullyShardBuilder().device(CPUDevice()).wrap(Block).shard_placement_fn(fn).build
    refused(build, demo(), argument, fix)


def test_a_child_sharded_before_the_build_is_not_taken_for_tensor_parallelism(
    world1: None,
) -> None:
    # Its DTensors are FSDP's own: the loaders and DeterministicInit build around it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model[0])
    built = FullyShardBuilder().device(CPUDevice()).materialize(FromStateDict(state)).build(model)
    for name, value in built.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(full, state[name]), name
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    first = cast(nn.Linear, model[0])
    kept = first.weight.detach().clone()
    fully_shard(first)
    FullyShardBuilder().device(CPUDevice()).materialize(DeterministicInit(seed=1)).build(model)
    assert torch.equal(cast(DTensor, first.weight).full_tensor(), kept)


# -- timeout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [float("inf"), 1e300])
def test_an_unbounded_timeout_is_refused_with_the_way_to_have_none(seconds: float) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"invalid `seconds`: .* is not a bound.*leave \.timeout\(\.\.\.\) out",
    ):
        FSDPBuilder().timeout(seconds)


# -- two ranks: the same refusal on every rank, before anything is shared ---------------------


def dp_slice(builder: Callable[[], ShardingBuilder]) -> dict[str, Any]:
    """FSDP over mesh["dp"] of a (dp=1, tp=2) mesh, with no parameter placed on "tp"."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    build = builder().device(CPUDevice()).wrap(Block).groups(mesh["dp"]).build
    return attempt(build, demo())


def tp_loader(materializer: Any, on_meta: bool) -> dict[str, Any]:
    """FSDP2 over mesh["dp"] of a (dp=1, tp=2) mesh, each Block's MLP placed on "tp"."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta" if on_meta else "cpu"):
        model = demo()
    for block in model.blocks:
        mlp = cast(Block, block).mlp
        parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).groups(mesh["dp"])
    return attempt(builder.materialize(materializer).build, model)


def scalar_fsdp1() -> dict[str, Any]:
    return attempt(FSDPBuilder().device(CPUDevice()).wrap(nn.Linear).build, ScalarBelowChild())


def _columns(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.ndim == 2 else None


def uneven_columns() -> dict[str, Any]:
    """The second unit's weight has 5 columns: 2 ranks cannot split them evenly. Plain
    fully_shard refuses it only when it reaches that unit, after the first was sharded."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(5, 4))
    build = FullyShardBuilder().device(CPUDevice()).wrap(nn.Linear).shard_placement_fn(_columns)
    outcome = attempt(build.build, model)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(5, 4))
    fully_shard(plain[0], shard_placement_fn=_columns)
    try:
        fully_shard(plain[1], shard_placement_fn=_columns)
    except NotImplementedError as exc:
        outcome["plain"] = str(exc)
    return outcome


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "uneven_columns": uneven_columns,
    "dp_slice_fsdp2": lambda: dp_slice(FullyShardBuilder),
    "dp_slice_fsdp1": lambda: dp_slice(FSDPBuilder),
    "scalar_fsdp1": scalar_fsdp1,
    "tp_state_dict": lambda: tp_loader(FromStateDict(None), on_meta=False),
    "tp_checkpoint_on_meta": lambda: tp_loader(FromCheckpoint("model.safetensors"), on_meta=True),
    "tp_checkpoint_rank0": lambda: tp_loader(
        FromCheckpoint("model.safetensors", shared_filesystem=False), on_meta=False
    ),
    "tp_deterministic": lambda: tp_loader(DeterministicInit(seed=0), on_meta=True),
}


def rank_main() -> Results:
    cases: list[tuple[Hashable, Callable[[], Any]]] = list(SCENARIOS.items())
    return run_each(cases)


SPAWNS = Spawns(rank_main, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["dp_slice_fsdp2", "dp_slice_fsdp1"])
def test_a_data_parallel_slice_without_tp_placements_is_refused_in_configure(name: str) -> None:
    outcomes = values(SPAWNS(2), name)
    for outcome in outcomes:
        assert_refused_in_configure(
            outcome,
            r"`MeshGroups` got an invalid `mesh`: .*no parameter is placed on its other dims "
            r"\('tp',\)",
            r"parallelize_module\(model, mesh\['tp'\], plan\) before build\(\)",
        )
    assert len({o["message"] for o in outcomes}) == 1


@pytest.mark.timeout(300)
def test_two_ranks_refuse_a_scalar_below_a_wrapped_child_alike() -> None:
    outcomes = values(SPAWNS(2), "scalar_fsdp1")
    for outcome in outcomes:
        assert_refused_in_configure(outcome, r"scalar \(0-dim\)", r"1-D tensor of one element")
    assert len({o["message"] for o in outcomes}) == 1


@pytest.mark.timeout(300)
def test_an_uneven_split_of_another_dim_is_refused_before_any_unit_is_sharded() -> None:
    outcomes = values(SPAWNS(2), "uneven_columns")
    for outcome in outcomes:
        assert "uneven sharding on dim 1" in outcome["plain"]
        assert re.search(
            r"`FullyShardBuilder.shard_placement_fn` got an invalid `fn`: it places '1.weight' "
            r"\(shape \[4, 5\], unit '1'\) on Shard\(dim=1\), but fully_shard splits a dim "
            r"other than 0 only evenly and 5 is not a multiple of the shard group's 2 ranks",
            outcome["message"],
        ), outcome["message"]
        assert "Return Shard(0) or None for it" in outcome["message"]
        # Known only once the shard group exists: refused there, before the first unit changed.
        assert outcome["log"][0] == ("agree", "configure", False)
        assert outcome["untouched"]
    assert len({o["message"] for o in outcomes}) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "argument", "fix"),
    [
        (
            "tp_state_dict",
            r"`FromStateDict` got an invalid `model`: these states are DTensors placed before the "
            r"build \(tensor parallelism\): 'blocks.0.mlp.0.weight'.*rank 0 sends whole units",
            r"Use FromCheckpoint\(path\), where each rank reads its own part",
        ),
        (
            "tp_checkpoint_on_meta",
            r"`FromCheckpoint` got an invalid `model`: these tensor-parallel states are on the "
            r"meta device: 'blocks.0.mlp.0.weight'",
            r"`model.to_empty\(device=...\)` after parallelize_module, then its "
            r"`init_weights\(\)`\), then load",
        ),
        (
            "tp_deterministic",
            r"`DeterministicInit` got an invalid `model`: these states are DTensors placed before "
            r"the build \(tensor parallelism\): 'blocks.0.mlp.0.weight'.*draw per shard",
            r"Use StreamInit\(seed\), whose full weights are the same with tensor parallelism",
        ),
        (
            "tp_checkpoint_rank0",
            r"`FromCheckpoint` got an invalid `model`: these states are DTensors placed",
            r"Use FromCheckpoint\(path\), where each rank reads",
        ),
    ],
)
def test_materializers_refuse_tensor_parallel_states_they_cannot_fill(
    name: str, argument: str, fix: str
) -> None:
    outcomes = values(SPAWNS(2), name)
    for outcome in outcomes:
        assert_refused_in_configure(outcome, argument, fix)
    assert len({o["message"] for o in outcomes}) == 1
