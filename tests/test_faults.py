"""Fault injection: bad configuration, bad sources, ranks that disagree, die or are slow, and
models torch would refuse at shard time. Every case asserts the exception type (on every rank),
a message naming the thing at fault and the fix, and the model untouched where the build stopped
before changing it. No case asserts a duration shorter than a wait it is meant to replace: on a
loaded machine any step can be slow. A wait that the build's own bound ends is told apart from
one it does not by the process group's timeout, which is many times the bound (see
``GROUP_TIMEOUT``); calls that refuse before any collective are bounded by pytest's timeout.

Single-process cases run here; multi-rank cases run in a few spawns, each running many cases in
turn (spawning is the expensive part on a small machine): one group for sources and divergent
ranks, one for a rank that dies (the group is dead afterwards) and one for a slow rank.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
import torch
import torch.distributed as dist
from attrs import frozen
from helpers import check_model
from isolated import START_METHOD, Results, Spawns, run_each, values
from torch import nn
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_builder import (
    BaseMaterializer,
    BroadcastFromRank0,
    CommunicationError,
    ConfigurationError,
    CPUDevice,
    DefaultGroups,
    DeterministicInit,
    Environment,
    ExplicitDevice,
    FromCheckpoint,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    InitFn,
    MaterializationError,
    RankDisagreementError,
    ResetParameters,
    ShardingBuilder,
    Unit,
    VerifyReplicas,
)
from fsdp_builder.backends.fsdp1 import FSDP1Backend
from fsdp_builder.backends.fsdp2 import FullyShardBackend
from fsdp_builder.planning.ignored import is_wrapped
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer
from fsdp_builder.tools.launch import RankFailure, run_ranks

CFG = DemoConfig(vocab=32, dim=16, heads=2, layers=2, seq=4)
# Seconds a multi-rank build may wait for a peer in these tests.
BOUND = 3.0
# The process groups' timeout in the multi-rank spawns (and their deadline): a wait the build's
# bound did not end would last this long, so an error that comes sooner shows the bound worked,
# however slowly the loaded machine ran the rest of the build.
GROUP_TIMEOUT = 600.0
# The build's bound where a rank dies or sleeps: long enough that no honest step of a loaded
# machine (a rank arriving late at the configure agreement) runs past it.
DEATH_BOUND = 15.0


# -- helpers ----------------------------------------------------------------------------------


def meta_model(layers: int = 2) -> DemoTransformer:
    with torch.device("meta"):
        return DemoTransformer(DemoConfig(vocab=32, dim=16, heads=2, layers=layers, seq=4))


def real_model(seed: int = 0) -> DemoTransformer:
    torch.manual_seed(seed)
    return DemoTransformer(CFG)


def snapshot(model: nn.Module) -> list[Any]:
    """What 'untouched' compares: module types (no wrapper added) and every state's identity,
    device, dtype, shape, grad flag and (off meta) a checksum."""
    out: list[Any] = [(name, type(m).__name__) for name, m in model.named_modules()]
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    for name, t in named:
        total = None if t.is_meta else float(t.detach().double().nan_to_num().sum())
        out.append((name, id(t), str(t.device), t.dtype, tuple(t.shape), t.requires_grad, total))
    return out


def unwrapped(model: nn.Module) -> bool:
    return not any(is_wrapped(m) for m in model.modules())


def attempt(make: Callable[[], nn.Module], build: Callable[[nn.Module], Any]) -> dict[str, Any]:
    """Run one faulty build; what it raised, how fast, and whether the model was left as it
    was (states and structure) and unwrapped."""
    model = make()
    before = snapshot(model)
    started = time.perf_counter()
    caught: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            build(model)
        caught = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
        error: BaseException | None = None
    except Exception as exc:
        error = exc
    seconds = time.perf_counter() - started
    return {
        "type": None if error is None else type(error).__name__,
        "message": None if error is None else str(error),
        "seconds": seconds,
        "untouched": snapshot(model) == before and unwrapped(model),
        "warnings": caught,
        "cause": None if error is None or error.__cause__ is None else str(error.__cause__),
        "cause_type": None
        if error is None or error.__cause__ is None
        else type(error.__cause__).__name__,
        "missing": list(getattr(error, "missing_ranks", []) or []),
        "stage": getattr(error, "stage", None),
    }


def check_result(
    result: dict[str, Any],
    kind: type[BaseException],
    match: str,
    untouched: bool,
    bound: float | None = None,
) -> None:
    """``bound``: the process group's timeout, where the build's own bound must end a wait."""
    import re

    assert result["type"] == kind.__name__, result
    assert re.search(match, result["message"], re.S), (match, result["message"])
    if bound is not None:
        assert result["seconds"] < bound, result
    if untouched:
        assert result["untouched"], result


# -- configuration: fluent calls and strategy objects (no process group) -----------------------


class NotAModule:
    pass


def _any(value: Any) -> Any:
    """A wrong value passed where the type checker would object: the point of the case."""
    return value


def _bad_mixed_precision_object() -> Any:
    return FSDPBuilder().mixed_precision(MixedPrecision(param_dtype=_any("bf16")))


CONFIG_FAULTS: list[tuple[str, Callable[[], Any], str]] = [
    (
        "materializer class",
        lambda: FSDPBuilder().materialize(_any(ResetParameters)),
        r"ResetParameters\(\)",
    ),
    (
        "synchronizer class",
        lambda: FSDPBuilder().synchronize(_any(BroadcastFromRank0)),
        r"BroadcastFromRank0\(\)",
    ),
    (
        "second synchronizer class",
        lambda: FSDPBuilder().synchronize(BroadcastFromRank0(), _any(VerifyReplicas)),
        r"VerifyReplicas\(\)",
    ),
    ("device resolver class", lambda: FSDPBuilder().device(_any(CPUDevice)), r"CPUDevice\(\)"),
    (
        "group factory class",
        lambda: FSDPBuilder().groups(_any(DefaultGroups)),
        r"DefaultGroups\(\)",
    ),
    (
        "materializer not a strategy",
        lambda: FSDPBuilder().materialize(_any("reset")),
        r"does not implement Materializer",
    ),
    ("no synchronizer", lambda: FSDPBuilder().synchronize(), r"at least one"),
    (
        "dtype name typo",
        lambda: FSDPBuilder().mixed_precision(param_dtype="bf17"),
        r"'bf17' is not a floating dtype name.*bfloat16",
    ),
    (
        "integer dtype name",
        lambda: FSDPBuilder().mixed_precision(reduce_dtype="int64"),
        r"reduce_dtype.*'int64'.*torch.bfloat16",
    ),
    (
        "integer dtype",
        lambda: FSDPBuilder().mixed_precision(param_dtype=torch.int32),
        r"torch.int32 is not a floating-point dtype.*torch.bfloat16",
    ),
    (
        "dtype of wrong type",
        lambda: FSDPBuilder().mixed_precision(param_dtype=_any(3)),
        r"expected a torch.dtype or a dtype name.*'bf16'",
    ),
    (
        "dtype name inside MixedPrecision",
        _bad_mixed_precision_object,
        r"param_dtype.*not a torch.dtype.*param_dtype='bf16'",
    ),
    (
        "policy and keywords",
        lambda: FSDPBuilder().mixed_precision(MixedPrecision(), param_dtype="bf16"),
        r"either a policy object or the dtypes",
    ),
    (
        "cast flag not a bool",
        lambda: FullyShardBuilder().mixed_precision(cast_forward_inputs=_any("yes")),
        r"cast_forward_inputs.*True or False",
    ),
    (
        "FSDP1 output dtype",
        lambda: FSDPBuilder().mixed_precision(output_dtype="bf16"),
        r"no output dtype.*FullyShardBuilder",
    ),
    (
        "FSDP2 policy on FSDP1",
        lambda: FSDPBuilder().mixed_precision(MixedPrecisionPolicy()),
        r"MixedPrecisionPolicy is fully_shard's.*MixedPrecision\(",
    ),
    (
        "FSDP2 buffer dtype",
        lambda: FullyShardBuilder().mixed_precision(buffer_dtype="bf16"),
        r"does not cast them.*Drop buffer_dtype",
    ),
    (
        "mixed precision twice",
        lambda: (
            FSDPBuilder().mixed_precision(param_dtype="bf16").mixed_precision(param_dtype="fp32")
        ),
        r"already set.*clone\(\)",
    ),
    (
        "wrap a non-module class",
        lambda: FSDPBuilder().wrap(int),
        r"class int is not an nn.Module subclass.*wrap\(TransformerBlock\)",
    ),
    (
        "wrap a plain class",
        lambda: FSDPBuilder().wrap(NotAModule),
        r"NotAModule is not an nn.Module subclass",
    ),
    (
        "one-argument predicate",
        lambda: FSDPBuilder().wrap(lambda m: True),
        r"cannot be called as .*\(module, fqn\).*lambda module, fqn",
    ),
    (
        "three-argument predicate",
        lambda: FSDPBuilder().wrap(lambda m, n, x: True),
        r"cannot be called as .*\(module, fqn\)",
    ),
    (
        "empty class list",
        lambda: FSDPBuilder().wrap([]),
        r"empty collection.*wrap\(TransformerBlock\)",
    ),
    (
        "class list with a string",
        lambda: FSDPBuilder().wrap([Block, "Linear"]),
        r"'Linear'.*module classes",
    ),
    ("wrap a number", lambda: FSDPBuilder().wrap(42), r"int is not a wrap policy.*module classes"),
    (
        "checkpoint a torch policy",
        lambda: FSDPBuilder().activation_checkpointing(ModuleWrapPolicy({Block})),
        r"torch wrap policy.*module classes",
    ),
    (
        "checkpoint a one-argument predicate",
        lambda: FSDPBuilder().activation_checkpointing(lambda m: True),
        r"\(module, fqn\)",
    ),
    (
        "sharding typo",
        lambda: FSDPBuilder().sharding("fulll"),
        r"'fulll' is not a sharding strategy.*'full'",
    ),
    (
        "sharding twice",
        lambda: FSDPBuilder().sharding("full").sharding("grad_op"),
        r"already set.*clone\(\)",
    ),
    (
        "zero timeout",
        lambda: FSDPBuilder().timeout(0),
        r"positive number of seconds.*timeout\(120\)",
    ),
    ("timeout as text", lambda: FSDPBuilder().timeout(_any("10")), r"positive number of seconds"),
    ("device gibberish", lambda: FSDPBuilder().device("gpu0"), r"'gpu0' is not a device.*'cuda:0'"),
    ("device as a bool", lambda: FSDPBuilder().device(True), r"True is not a device"),
    (
        "ignore a bare module",
        lambda: FSDPBuilder().ignore(modules=_any(nn.Linear(1, 1))),
        r"expected an iterable.*\[item\]",
    ),
    (
        "ignore modules and states",
        lambda: FSDPBuilder().ignore(modules=[nn.Linear(1, 1)], states=[nn.Linear(1, 1)]),
        r"both `modules` and `states`.*only `states=",
    ),
    (
        "ignore mixed kinds",
        lambda: FSDPBuilder().ignore(states=[nn.Linear(1, 1), nn.Parameter(torch.ones(1))]),
        r"mix of types.*separate builds",
    ),
    (
        "cpu offload as text",
        lambda: FSDPBuilder().cpu_offload(_any("yes")),
        r"expected a bool.*CPUOffload",
    ),
    (
        "prefetch typo",
        lambda: FSDPBuilder().prefetch(backward="sideways"),
        r"'sideways' is not a backward prefetch mode.*BACKWARD_PRE",
    ),
    (
        "per_unit not callable",
        lambda: FSDPBuilder().per_unit(_any(3)),
        r"expected a callable.*lambda module, fqn",
    ),
    (
        "reshard factor zero",
        lambda: FullyShardBuilder().reshard_after_forward(0),
        r"positive int.*True, False",
    ),
    (
        "flag as text",
        lambda: FSDPBuilder().limit_all_gathers(_any("no")),
        r"expected a bool.*True or False",
    ),
    (
        "state dict of wrong type",
        lambda: FromStateDict(_any(42)),
        r"expected a state dict, a path or None.*state_dict\(\)",
    ),
    (
        "InitFn allocate not a bool",
        lambda: InitFn(print, allocate=_any("yes")),
        r"`InitFn` got an invalid `allocate`: expected True or False, got str 'yes'\. Pass "
        r"allocate=True",
    ),
    (
        "nonfinite mode typo",
        lambda: FromStateDict({}, nonfinite="explode"),
        r"nonfinite.*'explode'.*'warn'.*'error'.*'ignore'",
    ),
    (
        "checkpoint nonfinite typo",
        lambda: FromCheckpoint("x.safetensors", nonfinite="raise"),
        r"nonfinite.*'raise'.*'error'",
    ),
    (
        "build a non-module",
        lambda: FSDPBuilder().build(_any("model")),
        r"expected an nn.Module.*model to shard",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "call", "match"), CONFIG_FAULTS, ids=[c[0] for c in CONFIG_FAULTS]
)
def test_configuration_faults_are_refused_at_the_call(
    case: str, call: Callable[[], Any], match: str
) -> None:
    assert not dist.is_initialized()  # refused with no process group: no collective can run
    with pytest.raises(ConfigurationError, match=match):
        call()


def test_dtype_names_convert_for_both_backends() -> None:
    fsdp1 = FSDPBuilder().mixed_precision(param_dtype="bf16", reduce_dtype="float32")
    policy = fsdp1.config.options.mixed_precision
    assert isinstance(policy, MixedPrecision)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    fsdp2 = FullyShardBuilder().mixed_precision(param_dtype="bfloat16", output_dtype="torch.fp16")
    policy2 = fsdp2.config.options.mixed_precision
    assert isinstance(policy2, MixedPrecisionPolicy)
    assert (policy2.param_dtype, policy2.output_dtype) == (torch.bfloat16, torch.float16)
    assert FullyShardBuilder().mixed_precision(param_dtype="FP32").config.options.mixed_precision
    # Predicates of the right arity (extra defaulted arguments, *args) are accepted.
    FSDPBuilder().wrap(lambda module, fqn, depth=0: False)
    FSDPBuilder().wrap(lambda *args: False)


# -- configure-stage refusals on one rank (model untouched) -----------------------------------


def _other_model_module(model: nn.Module) -> FSDPBuilder:
    return FSDPBuilder().device(CPUDevice()).ignore([real_model().head])


def _other_model_param(model: nn.Module) -> FSDPBuilder:
    return FSDPBuilder().device(CPUDevice()).ignore(states=[real_model().head.weight])


DEVICE_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
ONE_RANK_FAULTS: list[tuple[str, Callable[[nn.Module], ShardingBuilder], str]] = [
    # Without CUDA: cuda:0, 0 and cuda:1; with n GPUs: indices n and n+1, which do not exist.
    (
        "cuda index string",
        lambda m: FSDPBuilder().device(f"cuda:{DEVICE_COUNT}"),
        r"cuda:\d.*(CUDA is not available|GPU\(s\)).*(cpu|below)",
    ),
    (
        "cuda index int",
        lambda m: FullyShardBuilder().device(DEVICE_COUNT),
        r"cuda:\d.*(CUDA is not available|GPU\(s\))",
    ),
    (
        "ExplicitDevice cuda:1",
        lambda m: FSDPBuilder().device(ExplicitDevice(f"cuda:{DEVICE_COUNT + 1}")),
        r"cuda:\d.*(CUDA is not available|GPU\(s\))",
    ),
    (
        "ignored module of another model",
        _other_model_module,
        r"not part of the model.*Linear module 0.*same model object",
    ),
    (
        "ignored parameter of another model",
        _other_model_param,
        r"not part of the model.*parameter 0 of shape \[32, 16\]",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "configure", "match"), ONE_RANK_FAULTS, ids=[c[0] for c in ONE_RANK_FAULTS]
)
def test_configure_stage_refusals_leave_the_model_untouched(
    world1: None, case: str, configure: Callable[[nn.Module], ShardingBuilder], match: str
) -> None:
    result = attempt(meta_model, lambda m: configure(m).build(m))
    check_result(result, ConfigurationError, match, untouched=True)


# -- models torch refuses at shard time, refused from the plan --------------------------------


class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))


class WithInteger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)


def transposed() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight = nn.Parameter(torch.randn(4, 3).t())
    return model


def half_frozen() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return model


def two_dtypes() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].double()
    return model


def fsdp1_wrapped() -> nn.Module:
    return FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))


def fully_sharded() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    return model


REFUSED: list[tuple[str, Callable[[], nn.Module], Callable[[], ShardingBuilder], str]] = [
    (
        "scalar parameter (FSDP1)",
        WithScalar,
        FSDPBuilder,
        r"scalar \(0-dim\).*'scale'.*unit '<root>'.*1-D tensor of one element",
    ),
    (
        "scalar parameter (FSDP2)",
        WithScalar,
        FullyShardBuilder,
        r"scalar \(0-dim\).*'scale'.*unit '<root>'.*1-D tensor of one element",
    ),
    (
        "non-contiguous parameter (FSDP2)",
        transposed,
        FullyShardBuilder,
        r"non-contiguous.*'0.weight'.*contiguous\(\)",
    ),
    (
        "integer parameter (FSDP1)",
        WithInteger,
        FSDPBuilder,
        r"non-floating.*'steps' \(torch.int64.*register_buffer",
    ),
    (
        "mixed requires_grad (FSDP1)",
        half_frozen,
        FSDPBuilder,
        r"unit '<root>' mixes.*'1.weight'.*'0.weight'.*use_orig_params\(True\)",
    ),
    (
        "two dtypes in a unit (FSDP1)",
        two_dtypes,
        FSDPBuilder,
        r"several dtypes.*'1.weight' is torch.float64.*Cast the model",
    ),
    (
        "root wrapped by FSDP1",
        fsdp1_wrapped,
        FSDPBuilder,
        r"already sharded at its root.*FullyShardedDataParallel.*before it was sharded",
    ),
    (
        "root wrapped by fully_shard",
        fully_sharded,
        FullyShardBuilder,
        r"already sharded at its root.*fully_shard.*before it was sharded",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "make", "builder", "match"), REFUSED, ids=[c[0] for c in REFUSED])
def test_models_torch_refuses_are_refused_from_the_plan(
    world1: None,
    case: str,
    make: Callable[[], nn.Module],
    builder: Callable[[], ShardingBuilder],
    match: str,
) -> None:
    """``check_model`` (the configure stage's check) refuses, naming the parameter and the fix,
    before anything changes."""
    model = make()
    before = snapshot(model)
    b = builder()
    backend = FSDP1Backend() if isinstance(b, FSDPBuilder) else FullyShardBackend()
    with pytest.raises(ConfigurationError, match=match):
        check_model(backend, b.plan_for(model), b.config.options)
    assert snapshot(model) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "make", "builder", "match"), REFUSED, ids=[c[0] for c in REFUSED])
def test_build_refuses_models_torch_refuses_before_changing_them(
    world1: None,
    case: str,
    make: Callable[[], nn.Module],
    builder: Callable[[], ShardingBuilder],
    match: str,
) -> None:
    """The configure stage runs check_model: build() raises before any collective, the model
    untouched (a model sharded at its root before the build stays as it was)."""
    model = make()
    before = snapshot(model)
    with pytest.raises(ConfigurationError, match=match):
        builder().device(CPUDevice()).build(model)
    assert snapshot(model) == before


@pytest.mark.timeout(60)
def test_what_torch_accepts_passes_the_plan_checks(world1: None) -> None:
    # Frozen and trainable parts in one unit are fine with use_orig_params, or in their own units.
    check_model(
        FSDP1Backend(),
        FSDPBuilder().plan_for(half_frozen()),
        FSDPBuilder().use_orig_params().config.options,
    )
    model = half_frozen()
    check_model(
        FSDP1Backend(), FSDPBuilder().wrap(nn.Linear).plan_for(model), FSDPBuilder().config.options
    )
    # Children already sharded keep their units: only the root is planned.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    check_model(
        FullyShardBackend(), FullyShardBuilder().plan_for(model), FullyShardBuilder().config.options
    )
    # Integer parameters are fully_shard's to keep; strides are FSDP1's.
    check_model(
        FullyShardBackend(),
        FullyShardBuilder().plan_for(WithInteger()),
        FullyShardBuilder().config.options,
    )
    check_model(FSDP1Backend(), FSDPBuilder().plan_for(transposed()), FSDPBuilder().config.options)


# -- multi-rank: sources and divergent ranks, one spawn ---------------------------------------


def source_state(seed: int = 123) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in real_model(seed).state_dict().items()}


def _fsdp1() -> FSDPBuilder:
    return FSDPBuilder().device(CPUDevice()).wrap(Block).timeout(BOUND * 3)


def _fsdp2() -> FullyShardBuilder:
    return FullyShardBuilder().device(CPUDevice()).wrap(Block).timeout(BOUND * 3)


def _load(
    kind: Callable[[], ShardingBuilder], source: Any, **kw: Any
) -> Callable[[nn.Module], Any]:
    """Build with FromStateDict; ``source`` is rank 0's (a value, or a callable making it)."""

    def build(model: nn.Module) -> Any:
        value = None
        if dist.get_rank() == 0:
            value = source() if callable(source) else source
        return kind().materialize(FromStateDict(value, **kw)).build(model)

    return build


def _checkpoint(
    kind: Callable[[], ShardingBuilder], path: str, **kw: Any
) -> Callable[[nn.Module], Any]:
    return lambda model: kind().materialize(FromCheckpoint(path, **kw)).build(model)


def _meta_state() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(DemoTransformer(CFG).state_dict())


def _dtensor_state() -> dict[str, torch.Tensor]:
    """Rank 0's state dict holding DTensors (a sharded model's state dict)."""
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    mesh = DeviceMesh.from_group(dist.new_group([0], use_local_synchronization=True), "cpu")
    return {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in source_state().items()}


def _with(**changes: Any) -> dict[str, torch.Tensor]:
    state = source_state()
    for key, value in changes.items():
        state[key.replace("__", ".")] = value
    return state


def _nan_state() -> dict[str, torch.Tensor]:
    state = source_state()
    state["blocks.0.mlp.0.weight"][0, 0] = math.nan
    state["head.weight"][-1, -1] = math.inf  # FSDP2: only the last rank's shard holds it
    return state


def _diverge(rank1: Callable[[], ShardingBuilder]) -> Callable[[nn.Module], Any]:
    """Rank 0 builds with the plain FSDP1 builder, rank 1 with ``rank1``'s."""

    def build(model: nn.Module) -> Any:
        b = _fsdp1() if dist.get_rank() == 0 else rank1()
        return b.build(model)

    return build


def _rank1_model(layers: int = 3, dtype: torch.dtype | None = None) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = meta_model(layers if dist.get_rank() == 1 else 2)
        if dtype is not None and dist.get_rank() == 1:
            model.to(dtype)
        return model

    return make


@frozen
class Faulty(BaseMaterializer):
    """ResetParameters, except on the first unit: rank ``die`` exits, rank ``fail`` raises,
    rank ``sleep`` sleeps ``seconds``, rank ``skip`` leaves it on meta."""

    communicates: ClassVar[bool] = False
    die: int = -1
    fail: int = -1
    sleep: int = -1
    seconds: float = 0.0
    skip: int = -1

    def materialize(self, unit: Unit, env: Environment) -> int:
        if unit.fqn == "blocks.0":
            if env.rank == self.die:
                os._exit(1)
            if env.rank == self.sleep:
                time.sleep(self.seconds)
            if env.rank == self.fail:
                raise MaterializationError(f"planted failure of rank {env.rank} in 'blocks.0'")
            if env.rank == self.skip:
                return 0
        return ResetParameters().materialize(unit, env)


def _one_rank_ignores_the_head(model: nn.Module) -> Any:
    if dist.get_rank() == 0:
        return _fsdp1().build(model)
    return _fsdp1().ignore([cast(Any, model).head]).build(model)


def _one_rank_ignores_a_stranger(model: nn.Module) -> Any:
    if dist.get_rank() == 0:
        return _fsdp1().build(model)
    return _fsdp1().ignore([real_model().head]).build(model)


# (key, make model, build, expected type, message pattern, untouched)
def group_cases(
    paths: dict[str, str],
) -> list[
    tuple[str, Callable[[], nn.Module], Callable[[nn.Module], Any], type[BaseException], str, bool]
]:
    not_sd = r"is not a state dict.*state_dict\(\)"
    differs = r"rank 1 has {0}=.*but rank 0 has {0}=.*same builder calls on every rank"
    return [
        # sources: FromStateDict (rank 0 reads) on both backends
        ("text file", meta_model, _load(_fsdp1, paths["text"]), ConfigurationError, not_sd, True),
        ("csv file", meta_model, _load(_fsdp2, paths["csv"]), ConfigurationError, not_sd, True),
        (
            "random bytes",
            meta_model,
            _load(_fsdp1, paths["random"]),
            ConfigurationError,
            not_sd,
            True,
        ),
        (
            "random bytes (FSDP2)",
            meta_model,
            _load(_fsdp2, paths["random"]),
            ConfigurationError,
            not_sd,
            True,
        ),
        (
            "truncated safetensors",
            meta_model,
            _load(_fsdp2, paths["truncated"]),
            ConfigurationError,
            r"safetensors could not read it.*state_dict\(\)",
            True,
        ),
        ("empty file", meta_model, _load(_fsdp1, paths["empty"]), ConfigurationError, not_sd, True),
        (
            "a list, not a dict",
            meta_model,
            _load(_fsdp1, paths["list"]),
            ConfigurationError,
            r"holds a list.*state_dict\(\)",
            True,
        ),
        (
            "a training checkpoint",
            meta_model,
            _load(_fsdp2, paths["nested"]),
            ConfigurationError,
            r"'model'.*not tensors.*pass that inner dict",
            True,
        ),
        (
            "no such file",
            meta_model,
            _load(_fsdp1, paths["absent"]),
            ConfigurationError,
            r"does not exist on rank 0.*rank 0 can read",
            True,
        ),
        (
            "a folder",
            meta_model,
            _load(_fsdp2, paths["folder"]),
            ConfigurationError,
            r"it is not a file",
            True,
        ),
        (
            "rank 0 passes None",
            meta_model,
            _load(_fsdp1, None),
            ConfigurationError,
            r"rank 0 was given None.*file path",
            True,
        ),
        (
            "meta tensors (FSDP1)",
            meta_model,
            _load(_fsdp1, _meta_state),
            ConfigurationError,
            r"meta",
            True,
        ),
        (
            "meta tensors (FSDP2)",
            meta_model,
            _load(_fsdp2, _meta_state),
            ConfigurationError,
            r"meta",
            True,
        ),
        (
            "DTensors (FSDP2)",
            meta_model,
            _load(_fsdp2, _dtensor_state),
            ConfigurationError,
            r"DTensor",
            True,
        ),
        (
            "wrong shape",
            meta_model,
            _load(_fsdp1, partial(_with, head__bias=torch.zeros(3))),
            ConfigurationError,
            r"wrong shape.*'head.bias' is \[3\].*\[32\].*same architecture",
            True,
        ),
        (
            "missing key (FSDP2)",
            meta_model,
            _load(_fsdp2, lambda: {k: v for k, v in source_state().items() if k != "norm.weight"}),
            ConfigurationError,
            r"1 missing key.*norm.weight",
            True,
        ),
        (
            "wrapper prefix",
            meta_model,
            _load(_fsdp1, lambda: {f"module.{k}": v for k, v in source_state().items()}),
            ConfigurationError,
            r"strip 'module.'",
            True,
        ),
        (
            "NaN refused (FSDP1)",
            meta_model,
            _load(_fsdp1, _nan_state, nonfinite="error"),
            MaterializationError,
            r"NaN or inf.*'blocks.0.mlp.0.weight'.*nonfinite='warn'",
            False,
        ),
        (
            "inf refused on one shard (FSDP2)",
            meta_model,
            _load(_fsdp2, _nan_state, nonfinite="error"),
            MaterializationError,
            r"NaN or inf.*'blocks.0.mlp.0.weight'.*nonfinite=",
            False,
        ),
        # sources: FromCheckpoint (every rank reads)
        (
            "checkpoint: text file",
            meta_model,
            _checkpoint(_fsdp2, paths["text"]),
            ConfigurationError,
            r"notes.txt",
            True,
        ),
        (
            "checkpoint: truncated",
            meta_model,
            _checkpoint(_fsdp2, paths["truncated"]),
            ConfigurationError,
            r"truncated.safetensors",
            True,
        ),
        (
            "checkpoint: empty folder",
            meta_model,
            _checkpoint(_fsdp1, paths["folder"]),
            ConfigurationError,
            r"holds no .safetensors file, index or DCP .metadata.*Pass the path",
            True,
        ),
        (
            "checkpoint: wrong shapes",
            meta_model,
            _checkpoint(_fsdp1, paths["small"]),
            ConfigurationError,
            r"shape",
            True,
        ),
        (
            "checkpoint: NaN refused (FSDP2)",
            meta_model,
            _checkpoint(_fsdp2, paths["nan"], nonfinite="error"),
            MaterializationError,
            r"NaN or inf.*'head.bias'.*nonfinite='warn'",
            False,
        ),
        (
            "checkpoint: NaN refused (FSDP1)",
            meta_model,
            _checkpoint(_fsdp1, paths["nan"], nonfinite="error"),
            MaterializationError,
            r"NaN or inf.*'head.bias'",
            False,
        ),
        # divergent ranks caught by the plan agreement
        (
            "different model",
            _rank1_model(layers=3),
            lambda m: _fsdp1().build(m),
            RankDisagreementError,
            r"rank\(s\) 1.*(planned units|blocks.2)",
            True,
        ),
        (
            "different dtype",
            _rank1_model(layers=2, dtype=torch.bfloat16),
            lambda m: _fsdp1().build(m),
            RankDisagreementError,
            r"rank\(s\) 1.*bfloat16",
            True,
        ),
        (
            "different wrap policy",
            meta_model,
            _diverge(lambda: FSDPBuilder().device(CPUDevice()).wrap(nn.Linear).timeout(BOUND * 3)),
            RankDisagreementError,
            differs.format("wrap"),
            True,
        ),
        (
            "configure fails on one rank",
            meta_model,
            _one_rank_ignores_a_stranger,
            RankDisagreementError,
            r"rank\(s\) 1.*not part of the model",
            True,
        ),
        (
            # The ignored objects are not compared (ranks may ignore different ones); what they
            # change, the states a unit shards, is.
            "one rank ignores a module",
            real_model,
            _one_rank_ignores_the_head,
            RankDisagreementError,
            r"rank\(s\) 1.*in unit '<root>', rank 0 has head\.weight.* that rank 1 does not",
            True,
        ),
        (
            "one rank fails a unit",
            meta_model,
            lambda m: _fsdp1().materialize(Faulty(fail=1)).build(m),
            RankDisagreementError,
            r"unit 'blocks.0' failed on rank\(s\) 1.*planted failure of rank 1",
            False,
        ),
        (
            # Plain FSDP1 would give them values of its own (reset_parameters), unsaid.
            "one rank leaves a unit on meta",
            meta_model,
            lambda m: _fsdp1().materialize(Faulty(skip=1)).build(m),
            RankDisagreementError,
            r"stage 'materialize' of unit 'blocks.0' failed on rank\(s\) 1.*`Faulty` left "
            r"states of unit 'blocks.0' on the meta device on rank 1: blocks.0.norm1.weight, "
            r"blocks.0.norm1.bias, .*fix its materialize\(\)",
            False,
        ),
        (
            # Rank 0 would go on to send; rank 1 has nothing to receive into.
            "one rank leaves a unit on meta before a broadcast",
            meta_model,
            lambda m: (
                _fsdp2().materialize(Faulty(skip=1)).synchronize(BroadcastFromRank0()).build(m)
            ),
            RankDisagreementError,
            r"stage 'materialize' of unit 'blocks.0' failed on rank\(s\) 1.*`Faulty` left "
            r"states of unit 'blocks.0' on the meta device on rank 1",
            False,
        ),
        ("NaN warned by default", meta_model, _load(_fsdp1, _nan_state), type(None), "", False),
        (
            "NaN warned by default (FSDP2 checkpoint)",
            meta_model,
            _checkpoint(_fsdp2, paths["nan"]),
            type(None),
            "'head.bias'",
            False,
        ),
        (
            "NaN let through",
            meta_model,
            _load(_fsdp2, _nan_state, nonfinite="ignore"),
            type(None),
            "",
            False,
        ),
    ]


def divergent_config_cases() -> list[tuple[str, Callable[[], ShardingBuilder], str]]:
    """Rank 1's builder differs from rank 0's plain FSDP1 builder in one setting (the
    whole-configuration agreement names it)."""
    return [
        ("strategy", lambda: _fsdp1().sharding("grad_op"), "strategy"),
        ("backend", lambda: _fsdp2(), "backend"),
        (
            "mixed precision",
            lambda: _fsdp1().mixed_precision(param_dtype="bf16"),
            "mixed_precision",
        ),
        ("materializer", lambda: _fsdp1().materialize(DeterministicInit(seed=1)), "materializer"),
        ("synchronizer", lambda: _fsdp1().synchronize(VerifyReplicas()), "synchronizer"),
        (
            "timeout",
            lambda: FSDPBuilder().device(CPUDevice()).wrap(Block).timeout(BOUND * 4),
            "timeout",
        ),
    ]


def group_ranks(paths: dict[str, str]) -> Results:
    """Every multi-rank case of the shared spawn, in turn; each returns what ``attempt`` saw."""

    def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
        for key, make, build, *_ in group_cases(paths):
            yield key, partial(attempt, make, build)
        for key, rank1, _ in divergent_config_cases():
            yield ("config", key), partial(attempt, meta_model, _diverge(rank1))

    return run_each(cases(), stall_seconds=20)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("faults")
    good = source_state()
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "weights.csv").write_text("name,value\nhead.bias,0.5\n")
    (root / "random.pt").write_bytes(os.urandom(4096))
    (root / "empty.pt").write_bytes(b"")
    save_file(good, str(root / "full.safetensors"))
    data = (root / "full.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    torch.save([good["head.bias"]], root / "list.pt")
    torch.save({"model": good, "step": 3}, root / "nested.pt")
    (root / "folder").mkdir()
    save_file(
        {k: v[..., :1].contiguous() if v.dim() else v for k, v in good.items()},
        str(root / "small.safetensors"),
    )
    nan = dict(good)
    nan["head.bias"] = good["head.bias"].clone()
    nan["head.bias"][0] = math.nan
    save_file(nan, str(root / "nan.safetensors"))
    names = {
        "text": "notes.txt",
        "csv": "weights.csv",
        "random": "random.pt",
        "empty": "empty.pt",
        "truncated": "truncated.safetensors",
        "list": "list.pt",
        "nested": "nested.pt",
        "folder": "folder",
        "small": "small.safetensors",
        "nan": "nan.safetensors",
        "absent": "absent.pt",
    }
    return {k: str(root / v) for k, v in names.items()}


SPAWNS = Spawns(group_ranks, timeout=GROUP_TIMEOUT)


def _case_ids() -> list[str]:
    return [
        c[0]
        for c in group_cases(
            {
                k: ""
                for k in (
                    "text",
                    "csv",
                    "random",
                    "empty",
                    "truncated",
                    "list",
                    "nested",
                    "folder",
                    "small",
                    "nan",
                    "absent",
                )
            }
        )
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", _case_ids())
def test_sources_and_divergent_ranks_fail_alike_on_every_rank(
    paths: dict[str, str], key: str
) -> None:
    case = next(c for c in group_cases(paths) if c[0] == key)
    _, _, _, kind, match, untouched = case
    results = values(SPAWNS(2, paths), key)
    if kind is type(None):  # a warning (or, asked for, nothing), not an error: the build goes on
        for rank, result in enumerate(results):
            assert result["type"] is None, (rank, result)
            assert result["seconds"] < GROUP_TIMEOUT
        warned = [w for w in results[0]["warnings"] if "NaN or inf" in w]
        if "let through" in key:
            assert not warned, warned
            return
        named = match or "'blocks.0.mlp.0.weight'"
        assert warned and named in warned[0] and "nonfinite='error'" in warned[0], warned
        return
    for result in results:
        check_result(result, kind, match, untouched=untouched, bound=GROUP_TIMEOUT)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", [c[0] for c in divergent_config_cases()])
def test_divergent_configuration_is_named_before_anything_changes(
    paths: dict[str, str], key: str
) -> None:
    """Needs the whole-configuration agreement: the differing setting is named."""
    setting = next(c[2] for c in divergent_config_cases() if c[0] == key)
    pattern = rf"rank 1 has {setting}=.*but rank 0 has {setting}=.*same builder calls"
    for result in values(SPAWNS(2, paths), ("config", key)):
        check_result(result, RankDisagreementError, pattern, untouched=True, bound=GROUP_TIMEOUT)


# -- dying and slow ranks: a spawn each --------------------------------------------------------


def dying_ranks(folder: str) -> None:
    """Rank 2 exits in the middle of the first unit; rank 0 failed that unit itself; rank 1 did
    nothing wrong. Survivors write what they saw (the launcher loses the spawn's results)."""
    rank = dist.get_rank()
    builder = (
        FSDPBuilder()
        .device(CPUDevice())
        .wrap(Block)
        .timeout(DEATH_BOUND)
        .materialize(Faulty(die=2, fail=0))
    )
    dist.barrier()  # start the build together: a late start is not what this tests
    result = attempt(meta_model, builder.build)
    torch.save(result, Path(folder) / f"rank{rank}.pt")


def slow_ranks() -> dict[str, Any]:
    """Rank 1 sleeps past the build's timeout in the first unit."""
    builder = (
        FSDPBuilder()
        .device(CPUDevice())
        .wrap(Block)
        .timeout(DEATH_BOUND)
        .materialize(Faulty(sleep=1, seconds=DEATH_BOUND + 5))
    )
    dist.barrier()  # start the build together: a late start is not what this tests
    return attempt(meta_model, builder.build)


@pytest.mark.timeout(900)
def test_a_rank_that_dies_mid_build_stops_the_survivors_with_the_cause(tmp_path: Path) -> None:
    """Needs bounded waits: survivors raise CommunicationError before the process group's
    timeout, naming the stage, the unit and the dead rank; rank 0 keeps its own failure as the
    cause."""
    # Its own spawn, started with run_ranks: the subject is a rank process that dies, which ends
    # the spawn as a whole (the harness in ``isolated`` keeps outcomes of scenarios that raise).
    with pytest.raises(RankFailure, match="rank 2"):
        # The survivors get the time they need to raise and write what they saw, however
        # loaded the machine: the launcher would otherwise kill them soon after rank 2 died.
        run_ranks(
            dying_ranks,
            3,
            str(tmp_path),
            timeout=GROUP_TIMEOUT,
            grace=GROUP_TIMEOUT,
            start_method=START_METHOD,
        )
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)}
    for result in results.values():
        check_result(
            result,
            CommunicationError,
            r"stage '.*'.*blocks.0.*builder.timeout\(seconds\)",
            untouched=False,
            bound=GROUP_TIMEOUT,
        )
    # Rank 1 reaches the agreement after rank 0 marked its arrival, so it misses only the dead
    # rank. Rank 0 failed its unit at once: its exchange can fail (rank 2 gone) before rank 1,
    # still building, marks its arrival, and then names both, as the error documents ("those
    # that did not arrive"); never itself.
    assert results[1]["missing"] == [2], results[1]
    assert 2 in results[0]["missing"] and set(results[0]["missing"]) <= {1, 2}, results[0]
    assert results[0]["cause_type"] == "MaterializationError"
    assert "planted failure of rank 0" in results[0]["cause"]


@pytest.mark.timeout(900)
def test_a_rank_slower_than_the_timeout_stops_the_others_within_the_bound() -> None:
    """Needs bounded waits: rank 0 raises CommunicationError, naming the stage and rank 1 as the
    one that did not arrive. Without the bound rank 0 would wait until rank 1 woke and the build
    would succeed, so the error itself shows the bound ended the wait, with no clock read."""
    # Its own spawn, started with run_ranks: rank 1 is late on purpose, and inside the shared
    # spawn the harness's stall handling (``isolated``) would tear the group down under it.
    results = run_ranks(slow_ranks, 2, timeout=GROUP_TIMEOUT, start_method=START_METHOD)
    check_result(
        results[0],
        CommunicationError,
        r"stage '.*'.*rank\(s\) 1 did not arrive.*builder.timeout\(seconds\)",
        untouched=False,
    )
    assert results[0]["missing"] == [1]
    # The slow rank finds its peer gone when it arrives, and stops too.
    assert results[1]["type"] == "CommunicationError", results[1]
