"""Ignored-state rules of FSDP: exclusive arguments, uniform types, subtrees, wrapped modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_builder import ConfigurationError, resolve_ignored
from fsdp_builder.planning.ignored import managed_params


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.b = nn.Linear(2, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_modules_and_states_are_exclusive() -> None:
    net = Net()
    with pytest.raises(ConfigurationError, match=r"both `modules` and `states`.*only `states=`"):
        resolve_ignored(net, modules=[net.a], states=[net.b])


def test_states_must_be_uniform() -> None:
    net = Net()
    with pytest.raises(ConfigurationError, match=r"all nn.Parameter or all nn.Module.*Linear"):
        resolve_ignored(net, states=[net.b, net.a[0].weight])


def test_modules_must_be_modules() -> None:
    net = Net()
    with pytest.raises(ConfigurationError, match=r"`modules`.*nn.Module elements.*Parameter"):
        resolve_ignored(net, modules=[net.b.weight])  # type: ignore[list-item]


def test_subtrees_are_expanded_with_params_and_buffer_names() -> None:
    net = Net()
    ignored = resolve_ignored(net, modules=[net.a])
    assert set(ignored.modules) == {net.a, net.a[0], net.a[1]}
    assert set(ignored.params) == set(net.a.parameters())
    assert ignored.buffer_names == {
        "a.1.running_mean",
        "a.1.running_var",
        "a.1.num_batches_tracked",
    }
    assert set(managed_params(net, ignored)) == set(net.b.parameters())


def test_states_may_be_modules() -> None:
    net = Net()
    assert resolve_ignored(net, states=[net.a]) == resolve_ignored(net, modules=[net.a])


def test_ignored_parameters() -> None:
    net = Net()
    ignored = resolve_ignored(net, states=[net.b.weight])
    assert set(ignored.params) == {net.b.weight} and not ignored.modules


def test_already_wrapped_modules_pass_on_their_ignored_sets(world1: None) -> None:
    net = Net()
    inner_ignored = net.a[1]
    net.a = FullyShardedDataParallel(  # type: ignore[assignment]
        net.a, ignored_modules=[inner_ignored], device_id=torch.device("cpu")
    )
    ignored = resolve_ignored(net)
    assert inner_ignored in ignored.modules
    assert set(inner_ignored.parameters()) <= set(ignored.params)
    assert "a.1.running_mean" in ignored.buffer_names
    with pytest.raises(ConfigurationError, match=r"already a sharded wrapper"):
        resolve_ignored(net, modules=[net.a])


def test_modules_under_replicate_are_ignored_with_their_subtree(world1: None) -> None:
    from torch.distributed._composable import replicate

    net = Net()
    replicate(net.a)
    ignored = resolve_ignored(net)
    assert {net.a, net.a[0], net.a[1]} <= set(ignored.modules)
    assert set(net.a.parameters()) <= set(ignored.params)
    assert net.b not in ignored.modules
