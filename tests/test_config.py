"""Configuration checks of the builder and its strategies: no process group needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_builder import (
    AutoHybridGroups,
    ConfigurationError,
    ExplicitDevice,
    FSDPBuilder,
    HybridGroups,
    NoSync,
    ResetParameters,
    ShardingOptions,
)
from fsdp_builder.config import to_sharding_strategy


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("full", ShardingStrategy.FULL_SHARD),
        ("FULL_SHARD", ShardingStrategy.FULL_SHARD),
        ("grad_op", ShardingStrategy.SHARD_GRAD_OP),
        ("shard_grad_op", ShardingStrategy.SHARD_GRAD_OP),
        ("hybrid", ShardingStrategy.HYBRID_SHARD),
        ("none", ShardingStrategy.NO_SHARD),
        (ShardingStrategy.NO_SHARD, ShardingStrategy.NO_SHARD),
    ],
)
def test_strategy_names(name: str | ShardingStrategy, expected: ShardingStrategy) -> None:
    assert to_sharding_strategy(name) is expected


def test_unknown_strategy_names_the_argument_and_choices() -> None:
    with pytest.raises(ConfigurationError, match=r"`strategy`.*'fully'.*FULL_SHARD"):
        FSDPBuilder().sharding("fully")


def test_fluent_calls_return_the_builder_and_record_options() -> None:
    b = FSDPBuilder()
    same = (
        b.sharding("grad_op")
        .mixed_precision(param_dtype=torch.bfloat16)
        .cpu_offload()
        .prefetch(backward="backward_post", forward=True)
        .limit_all_gathers(False)
        .use_orig_params()
        .materialize(ResetParameters())
        .synchronize(NoSync())
        .wrap(nn.Linear)
        .device("cpu")
    )
    assert same is b
    opts = b.config.options
    assert opts.strategy is ShardingStrategy.SHARD_GRAD_OP
    assert opts.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16)
    assert opts.cpu_offload == CPUOffload(offload_params=True)
    assert opts.backward_prefetch is BackwardPrefetch.BACKWARD_POST
    assert opts.forward_prefetch and opts.use_orig_params and not opts.limit_all_gathers
    assert {"strategy", "mixed_precision", "cpu_offload", "use_orig_params"} <= opts.explicit
    assert b.config.device == ExplicitDevice("cpu")


def test_setting_a_role_twice_is_an_error() -> None:
    b = FSDPBuilder().materialize(ResetParameters())
    with pytest.raises(ConfigurationError, match=r"materializer.*already set.*clone\(\)"):
        b.materialize(ResetParameters())
    with pytest.raises(ConfigurationError, match=r"already set"):
        FSDPBuilder().device("cpu").device("cpu")


def test_setting_an_option_twice_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match=r"\['strategy'\] were already set"):
        FSDPBuilder().sharding("full").sharding("grad_op")


def test_clone_copies_configuration_and_allows_changes_elsewhere() -> None:
    base = FSDPBuilder().sharding("full").wrap(nn.Linear)
    twin = base.clone().device("cpu")
    assert twin.config.options == base.config.options
    assert base.config.device is None and twin.config.device is not None


def test_results_before_build_are_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"has not built a model yet"):
        _ = FSDPBuilder().report


def test_build_needs_a_module() -> None:
    with pytest.raises(ConfigurationError, match=r"`model`.*expected an nn.Module, got dict"):
        FSDPBuilder().build({})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda b: b.mixed_precision(MixedPrecision(), param_dtype=torch.float16), "both a policy"),
        (lambda b: b.mixed_precision("bf16"), r"`policy`.*MixedPrecision"),
        (lambda b: b.cpu_offload("yes"), r"`offload`.*bool or"),
        (lambda b: b.prefetch(backward="sideways"), r"`backward`.*'sideways'"),
        (lambda b: b.limit_all_gathers("no"), r"`limit_all_gathers`.*expected a bool"),
        (lambda b: b.groups((1, 2, 3)), r"tuple of 3 items"),
        (lambda b: b.groups(42), r"`groups`.*int does not implement GroupFactory"),
        (lambda b: b.synchronize(), r"`synchronizers`.*none were given"),
        (lambda b: b.synchronize(object()), r"does not implement StateSynchronizer"),
        (lambda b: b.materialize(lambda m: m), r"does not implement Materializer"),
        (lambda b: b.wrap([nn.Linear, "Block"]), r"`policy`.*nn.Module subclasses.*'Block'"),
        (lambda b: b.wrap(3.5), r"float is not a wrap policy"),
        (lambda b: b.device(object()), r"does not implement DeviceResolver"),
        (lambda b: b.device("warp-drive"), r"`device`.*'warp-drive' is not a device"),
        (lambda b: b.ignore(modules=nn.Linear(1, 1)), r"`modules`.*iterable.*\[item\]"),
    ],
)
def test_bad_configuration_names_argument_and_fix(call: object, pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        call(FSDPBuilder())  # type: ignore[operator]


def test_torch_wrap_policy_is_accepted() -> None:
    b = FSDPBuilder().wrap(ModuleWrapPolicy({nn.Linear}))
    assert b.config.wrap is not None and b.config.wrap.torch_policy is not None


def test_group_factories_check_their_arguments() -> None:
    with pytest.raises(ConfigurationError, match=r"`shard_group`.*ProcessGroup, got str"):
        HybridGroups("a", "b")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"`devices_per_node`.*positive int, got 0"):
        AutoHybridGroups(devices_per_node=0)


def test_options_validate_on_construction() -> None:
    with pytest.raises(ConfigurationError, match="forward_prefetch"):
        ShardingOptions(forward_prefetch=1)  # type: ignore[arg-type]
