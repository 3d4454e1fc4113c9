"""fully_shard's own options (MixedPrecisionPolicy, OffloadPolicy, reshard_after_forward,
shard_placement_fn) and per-unit overrides on both backends, each compared with the same model
sharded by plain ``fully_shard`` / ``FullyShardedDataParallel`` calls written out here: the
units' settings and three training steps.

Settings and single-rank training run in a one-rank gloo world in this process; real sharding
(2 and 4 ranks) runs every scenario in one spawn of 4 ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any, cast

import models
import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from models import STEPS, GainBlock, Net, train
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Shard

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    DeterministicInit,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingOptions,
)
from fsdp_builder.backends.fsdp2 import FullyShardBackend
from fsdp_builder.builder import ShardingBuilder
from fsdp_builder.materializers.sharded import ShardFirstReset
from fsdp_builder.tools.demo import Block as DemoBlock
from fsdp_builder.tools.demo import DemoConfig, DemoTransformer
from fsdp_builder.tools.demo import train as demo_train


def new_net() -> Net:
    """Three blocks whose float32 gain brings every unit's output back to float32."""
    return models.new_net(3, GainBlock)


UNIT_FQNS = ("blocks.0", "blocks.1", "blocks.2", "")


def by_hand_fsdp2(
    mesh: DeviceMesh, kwargs_for: Callable[[str], dict[str, Any]], checkpoint: bool = False
) -> Net:
    """``fully_shard`` per block (``checkpoint``: of its checkpoint wrapper), then the root,
    with ``kwargs_for(fqn)``."""
    model = new_net()
    for i, block in enumerate(model.blocks):
        if checkpoint:
            block = model.blocks[i] = checkpoint_wrapper(block)
        fully_shard(block, mesh=mesh, **kwargs_for(f"blocks.{i}"))
    fully_shard(model, mesh=mesh, **kwargs_for(""))
    return model


def build_fsdp2(configure: Callable[[FullyShardBuilder], Any], wrap: Any = GainBlock) -> nn.Module:
    builder = FullyShardBuilder().device(CPUDevice()).wrap(wrap)
    configure(builder)
    with warnings.catch_warnings():
        # One rank: the builder says it shards nothing (NO_SHARD).
        warnings.simplefilter("ignore", UserWarning)
        return builder.build(new_net())


def fsdp2_settings(model: nn.Module) -> dict[str, Any]:
    """Each unit's policies and post-forward mesh, and every parameter's placements."""
    units: dict[str, Any] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            assert group is not None
            after = group.post_forward_mesh_info
            units[fqn] = (
                group.mp_policy,
                group.offload_policy,
                None if after is None else tuple(after.mesh.shape),
            )
    placements = {name: tuple(cast(DTensor, p).placements) for name, p in model.named_parameters()}
    return {"units": units, "placements": placements}


def fsdp1_settings(model: nn.Module) -> dict[str, Any]:
    units: dict[str, Any] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            name = fqn.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
            units[name] = (module.mixed_precision, module.sharding_strategy, module.cpu_offload)
    return units


# -- scenarios: (builder configuration, by-hand fully_shard kwargs per unit fqn) ---------------

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CUSTOM_MP = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=True
)


def _shard_cols(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.ndim == 2 else None


def _middle_unit(module: nn.Module, fqn: str) -> dict[str, Any] | None:
    if fqn == "blocks.1":
        return {"reshard_after_forward": False, "mp_policy": BF16}
    return None


def _scenario_kwargs(name: str, fqn: str) -> dict[str, Any]:
    default_reshard = {"reshard_after_forward": fqn != ""} if name != "reshard_false" else {}
    if name == "mp_keywords":
        return {"mp_policy": BF16, **default_reshard}
    if name == "mp_policy":
        return {"mp_policy": CUSTOM_MP, **default_reshard}
    if name == "offload":
        return {"offload_policy": CPUOffloadPolicy(pin_memory=False), **default_reshard}
    if name == "reshard_false":
        return {"reshard_after_forward": False}
    if name == "reshard_int":
        return {"reshard_after_forward": 2}
    if name == "placement":
        return {"shard_placement_fn": _shard_cols, **default_reshard}
    if name == "checkpoint":
        return default_reshard
    if name == "per_unit":
        if fqn == "blocks.1":
            return {"reshard_after_forward": False, "mp_policy": BF16}
        return default_reshard
    raise AssertionError(name)


def _configure(name: str, builder: FullyShardBuilder) -> None:
    if name == "mp_keywords":
        builder.mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif name == "mp_policy":
        builder.mixed_precision(CUSTOM_MP)
    elif name == "offload":
        builder.cpu_offload(CPUOffloadPolicy(pin_memory=False))
    elif name == "reshard_false":
        builder.reshard_after_forward(False)
    elif name == "reshard_int":
        builder.reshard_after_forward(2)
    elif name == "placement":
        builder.shard_placement_fn(_shard_cols)
    elif name == "per_unit":
        builder.per_unit(_middle_unit)
    elif name == "checkpoint":
        builder.activation_checkpointing(GainBlock)
    else:
        raise AssertionError(name)


SINGLE_RANK = ("mp_keywords", "mp_policy", "offload", "reshard_false", "placement", "per_unit")


def _compare_fsdp2(name: str, rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    built = build_fsdp2(lambda b: _configure(name, b))
    hand = by_hand_fsdp2(mesh, lambda fqn: _scenario_kwargs(name, fqn), name == "checkpoint")
    losses = (train(built, rank), train(hand, rank))
    return {"losses": losses, "settings": (fsdp2_settings(built), fsdp2_settings(hand))}


def _assert_same(result: dict[str, Any], exact: bool) -> None:
    built, hand = result["losses"]
    if exact:
        assert built == hand
    else:
        assert built == pytest.approx(hand, abs=1e-5, rel=0)
    assert result["settings"][0] == result["settings"][1]


# -- one rank, in this process ------------------------------------------------------------------


@pytest.fixture
def mesh1(world1: None) -> Iterator[DeviceMesh]:
    yield init_device_mesh("cpu", (1,))


@pytest.mark.parametrize("name", SINGLE_RANK)
def test_fully_shard_option_matches_plain_fully_shard(name: str, mesh1: DeviceMesh) -> None:
    result = _compare_fsdp2(name, 0, mesh1)
    _assert_same(result, exact=name in ("offload", "reshard_false", "placement"))


def test_keyword_dtypes_get_fully_shards_defaults(mesh1: DeviceMesh) -> None:
    built = build_fsdp2(
        lambda b: b.mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    settings = fsdp2_settings(built)["units"]
    assert {mp for mp, _, _ in settings.values()} == {BF16}
    # Every unit casts its inputs, so a block fed float32 by its neighbour trains.
    assert all(mp.cast_forward_inputs for mp, _, _ in settings.values())
    assert len(train(built)) == STEPS


def test_fsdp1_mixed_precision_object_keeps_its_mapping(mesh1: DeviceMesh) -> None:
    built = build_fsdp2(lambda b: b.mixed_precision(MixedPrecision(param_dtype=torch.bfloat16)))
    units = fsdp2_settings(built)["units"]
    # FSDP1's defaults: only the root casts its inputs.
    assert units[""][0].cast_forward_inputs
    assert not units["blocks.0"][0].cast_forward_inputs


def test_custom_policy_overrides_apply_to_fully_shard(mesh1: DeviceMesh) -> None:
    def policy(module: nn.Module) -> bool | dict[str, Any]:
        return {"mp_policy": BF16} if isinstance(module, GainBlock) else False

    built = build_fsdp2(lambda b: b.reshard_after_forward(True), wrap=CustomPolicy(policy))
    hand = by_hand_fsdp2(
        mesh1,
        lambda fqn: {"reshard_after_forward": True, **({"mp_policy": BF16} if fqn else {})},
    )
    assert train(built) == pytest.approx(train(hand), abs=1e-5, rel=0)
    assert fsdp2_settings(built) == fsdp2_settings(hand)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("how", ["custom_policy", "per_unit"])
def test_fsdp1_per_unit_overrides_are_honoured(how: str, world1: None) -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)

    def per_unit(module: nn.Module, fqn: str) -> dict[str, Any] | None:
        return {"mixed_precision": mp} if fqn == "blocks.1" else None

    def custom(module: nn.Module) -> bool | dict[str, Any]:
        if isinstance(module, GainBlock):
            return {"mixed_precision": mp} if module is middle else True
        return False

    model = new_net()
    middle = model.blocks[1]
    builder = FSDPBuilder().device(CPUDevice())
    if how == "custom_policy":
        builder.wrap(CustomPolicy(custom))
    else:
        builder.wrap(GainBlock).per_unit(per_unit)
    built = builder.build(model)

    hand_model = new_net()
    middle = hand_model.blocks[1]
    hand = FullyShardedDataParallel(
        hand_model,
        auto_wrap_policy=CustomPolicy(custom),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.NO_SHARD,
    )
    assert fsdp1_settings(built) == fsdp1_settings(hand)
    assert fsdp1_settings(built)["blocks.1"][0] == mp
    assert train(built) == pytest.approx(train(hand), abs=1e-5, rel=0)


# -- activation checkpointing ------------------------------------------------------------------


def _structure(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


def _counted_train(model: nn.Module) -> tuple[list[float], int]:
    GainBlock.calls = 0
    losses = train(model)
    return losses, GainBlock.calls


CLEAN_KEYS = list(new_net().state_dict())


@pytest.mark.parametrize("what", ["blocks", "linears"])
def test_fsdp2_activation_checkpointing_matches_plain_calls(what: str, mesh1: DeviceMesh) -> None:
    if what == "blocks":
        built = build_fsdp2(lambda b: b.activation_checkpointing(GainBlock))
    else:
        built = build_fsdp2(
            lambda b: b.activation_checkpointing(lambda m, fqn: fqn.endswith(".lin"))
        )
    hand = new_net()
    for i, block in enumerate(hand.blocks):
        if what == "blocks":
            hand.blocks[i] = checkpoint_wrapper(block)
        else:
            block.lin = checkpoint_wrapper(block.get_submodule("lin"))
        fully_shard(hand.blocks[i], mesh=mesh1, reshard_after_forward=True)
    fully_shard(hand, mesh=mesh1, reshard_after_forward=False)

    assert _structure(built) == _structure(hand)
    wrappers = [m for m in built.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrappers) == 3
    assert list(built.state_dict()) == list(hand.state_dict()) == CLEAN_KEYS
    (losses, calls), (hand_losses, hand_calls) = _counted_train(built), _counted_train(hand)
    assert losses == hand_losses and calls == hand_calls
    # Blocks checkpointed as a whole run their forward again in backward.
    assert calls == (6 if what == "blocks" else 3) * STEPS
    assert fsdp2_settings(built) == fsdp2_settings(hand)


@pytest.mark.filterwarnings("ignore")
def test_fsdp1_activation_checkpointing_matches_plain_calls(world1: None) -> None:
    built = FSDPBuilder().device(CPUDevice()).wrap(GainBlock).activation_checkpointing(GainBlock)
    built_model = built.build(new_net())
    hand = FullyShardedDataParallel(
        new_net(),
        auto_wrap_policy=ModuleWrapPolicy({GainBlock}),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.NO_SHARD,
    )
    apply_activation_checkpointing(hand, check_fn=lambda m: isinstance(m, GainBlock))
    assert _structure(built_model) == _structure(hand)
    assert list(built_model.state_dict()) == list(hand.state_dict()) == CLEAN_KEYS
    (losses, calls), (hand_losses, hand_calls) = _counted_train(built_model), _counted_train(hand)
    assert losses == hand_losses and calls == hand_calls == 6 * STEPS


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_activation_checkpointing_keeps_meta_initialization(backend: str, world1: None) -> None:
    """From meta, with the materializer each backend initializes with (FSDP2: shard-first),
    checkpointing changes neither the weights nor the losses."""
    cfg = DemoConfig(layers=2)
    runs = []
    for checkpoint in (False, True):
        with torch.device("meta"):
            model = DemoTransformer(cfg)
        builder: ShardingBuilder = (
            FSDPBuilder().materialize(DeterministicInit(seed=0))
            if backend == "fsdp1"
            else FullyShardBuilder().materialize(ShardFirstReset())
        )
        builder.device(CPUDevice()).wrap(DemoBlock)
        if checkpoint:
            builder.activation_checkpointing(DemoBlock)
        built = builder.build(model)
        state = {
            k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in built.state_dict().items()
        }
        runs.append((state, demo_train(built, cfg, STEPS, 0, 1)))
    (plain_state, plain_losses), (state, losses) = runs
    assert list(state) == list(plain_state)
    assert all(torch.equal(state[k], plain_state[k]) for k in state)
    assert losses == plain_losses


@pytest.mark.parametrize(
    ("policy", "pattern"),
    [
        (ModuleWrapPolicy({GainBlock}), r"`policy`.*a torch wrap policy"),
        (3.5, r"`policy`.*float is not a wrap policy"),
    ],
)
def test_activation_checkpointing_policy_is_checked(policy: Any, pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        FullyShardBuilder().activation_checkpointing(policy)


# -- refused, with a clear error -------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda: FSDPBuilder().mixed_precision(MixedPrecisionPolicy()),
            r"MixedPrecisionPolicy is fully_shard's.*Pass torch.distributed.fsdp.MixedPrecision",
        ),
        (lambda: FSDPBuilder().cpu_offload(CPUOffloadPolicy()), r"CPUOffloadPolicy is fully_sh"),
        (
            lambda: FSDPBuilder().mixed_precision(output_dtype=torch.float32),
            r"`output_dtype`.*no output dtype",
        ),
        (
            lambda: FullyShardBuilder().mixed_precision(buffer_dtype=torch.float16),
            r"`buffer_dtype`.*FSDP2 keeps buffers",
        ),
        (lambda: FullyShardBuilder().reshard_after_forward(0), r"bool or a positive int, got 0"),
        (lambda: FullyShardBuilder().per_unit(3), r"`fn`.*expected a callable"),  # type: ignore[arg-type]
        (
            lambda: FullyShardBuilder().reshard_after_forward(True).reshard_after_forward(2),
            r"already set",
        ),
    ],
)
def test_refused_calls(call: Callable[[], Any], pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        call()


def test_reshard_contradicting_the_strategy_is_refused() -> None:
    options = ShardingOptions().set(strategy="grad_op", reshard_after_forward=True)
    with pytest.raises(ConfigurationError, match=r"True contradicts sharding\(SHARD_GRAD_OP\)"):
        FullyShardBackend().check(options)
    FullyShardBackend().check(
        ShardingOptions().set(strategy="grad_op", reshard_after_forward=False)
    )


@pytest.mark.parametrize(
    ("configure", "pattern"),
    [
        (lambda b: b.per_unit(lambda m, fqn: {"mesh": None}), r"'mesh' is the same for every"),
        (
            lambda b: b.per_unit(lambda m, fqn: {"mixed_precision": None}),
            r"not an argument fully_shard takes.*Use mp_policy=MixedPrecisionPolicy",
        ),
        (lambda b: b.per_unit(lambda m, fqn: [1]), r"returned list for unit"),
        (
            lambda b: b.per_unit(lambda m, fqn: {"mp_policy": MixedPrecision()}),
            r"expected MixedPrecisionPolicy",
        ),
    ],
)
def test_fsdp2_overrides_that_cannot_be_honoured(
    configure: Callable[[FullyShardBuilder], Any], pattern: str, world1: None
) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        build_fsdp2(configure)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinned memory works here")
def test_pinned_offload_without_an_accelerator_is_refused(world1: None) -> None:
    with pytest.raises(ConfigurationError, match=r"`pin_memory`.*pin_memory=False"):
        build_fsdp2(lambda b: b.cpu_offload(CPUOffloadPolicy()))


def test_overrides_set_twice_or_for_the_root_are_refused(world1: None) -> None:
    twice = CustomPolicy(lambda m: {"mp_policy": BF16} if isinstance(m, GainBlock) else False)
    with pytest.raises(ConfigurationError, match=r"both the wrap policy and per_unit set"):
        build_fsdp2(lambda b: b.per_unit(lambda m, fqn: {"mp_policy": BF16}), wrap=twice)
    root = CustomPolicy(lambda m: {"mp_policy": BF16} if isinstance(m, Net) else False)
    with pytest.raises(ConfigurationError, match=r"overrides \['mp_policy'\] for the root"):
        build_fsdp2(lambda b: None, wrap=root)


def test_fsdp1_build_wide_overrides_are_refused(world1: None) -> None:
    builder = FSDPBuilder().device(CPUDevice()).wrap(GainBlock)
    builder.per_unit(lambda m, fqn: {"process_group": None} if fqn else None)
    with pytest.raises(ConfigurationError, match=r"'process_group' is the same.*groups\(\.\.\.\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            builder.build(new_net())


# -- several ranks: one spawn for every scenario ------------------------------------------------

MULTI_RANK = ("mp_keywords", "reshard_int", "placement", "per_unit", "checkpoint")


def fsdp1_custom_policy() -> dict[str, Any]:
    """FSDP1 with a CustomPolicy that gives one block its own mixed precision."""
    rank = dist.get_rank()
    mp = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)

    def custom(module: nn.Module) -> bool | dict[str, Any]:
        if isinstance(module, GainBlock):
            return {"mixed_precision": mp} if module is middle else True
        return False

    model = new_net()
    middle = model.blocks[1]
    built = FSDPBuilder().device(CPUDevice()).wrap(CustomPolicy(custom)).build(model)
    hand_model = new_net()
    middle = hand_model.blocks[1]
    hand = FullyShardedDataParallel(
        hand_model, auto_wrap_policy=CustomPolicy(custom), device_id=torch.device("cpu")
    )
    return {
        "losses": (train(built, rank), train(hand, rank)),
        "settings": (fsdp1_settings(built), fsdp1_settings(hand)),
    }


def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in MULTI_RANK:
        yield name, partial(_compare_fsdp2, name, dist.get_rank(), mesh)
    yield "fsdp1_custom_policy", fsdp1_custom_policy


def rank_main() -> Results:
    return run_each(cases())


SPAWNS = Spawns(rank_main, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [*MULTI_RANK, "fsdp1_custom_policy"])
def test_four_ranks_match_plain_calls(name: str) -> None:
    four_ranks = values(SPAWNS(4), name)
    for rank_result in four_ranks:
        _assert_same(rank_result, exact=name in ("reshard_int", "placement", "checkpoint"))
    if name == "reshard_int":
        units = four_ranks[0]["settings"][0]["units"]
        # Resharded to groups of 2 after forward (the root too, as set by hand).
        assert {after for _, _, after in units.values()} == {(2, 2)}
