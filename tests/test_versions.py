"""Version gates: each feature an older torch cannot do is refused in the configure stage, by a
ConfigurationError that names the feature and the minimum torch (the torch release is
monkeypatched, so these run on any torch)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import open_checkpoint
from torch import nn

import fsdp_builder.versions as versions
from fsdp_builder import ConfigurationError, CPUDevice, FSDPBuilder, FullyShardBuilder
from fsdp_builder.tools.demo import Block, DemoConfig, make_model

ROOT = Path(__file__).resolve().parents[1]
CFG = DemoConfig(vocab=64, dim=32, heads=2, layers=2, seq=8)


def _pretend(monkeypatch: pytest.MonkeyPatch, release: tuple[int, int]) -> None:
    monkeypatch.setattr(versions, "torch_release", lambda: release)


def _below(feature: str) -> tuple[int, int]:
    major, minor = versions.FEATURES[feature].minimum
    return (major, minor - 1)


def _refusal(feature: str) -> str:
    """What every refusal of ``feature`` says: the feature's name and its minimum torch."""
    needed = versions.FEATURES[feature]
    return re.escape(needed.name) + r".*needs torch >= " + re.escape(needed.minimum_text)


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("2.13.0", (2, 13)),
        ("2.8.0+cpu", (2, 8)),
        ("2.9.0a0+git1234abc", (2, 9)),
        ("2.7.0a0+79aa17489c.nv25.04", (2, 7)),
        ("10.1", (10, 1)),
    ],
)
def test_release_is_major_and_minor(text: str, release: tuple[int, int]) -> None:
    assert versions.parse_release(text) == release


def test_a_version_without_a_release_is_refused() -> None:
    with pytest.raises(ValueError, match="not a torch version"):
        versions.parse_release("nightly")


def test_this_torch_supports_every_feature_at_or_above_the_floor() -> None:
    """The declared floor (setup.cfg) supports every gated feature whose minimum it reaches,
    and this torch (at or above the floor) supports everything the floor does."""
    text = (ROOT / "setup.cfg").read_text()
    floor = versions.parse_release(re.search(r"torch>=([\d.]+)", text).group(1))  # type: ignore[union-attr]
    assert versions.torch_release() >= floor
    for key, feature in versions.FEATURES.items():
        assert versions.supports(key, floor) == (floor >= feature.minimum), key
        if floor >= feature.minimum:
            assert versions.supports(key), key


def test_an_unknown_feature_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown feature 'warp_drive'"):
        versions.supports("warp_drive")


@pytest.mark.parametrize("feature", sorted(versions.FEATURES))
def test_require_names_the_feature_and_the_minimum(
    monkeypatch: pytest.MonkeyPatch, feature: str
) -> None:
    _pretend(monkeypatch, _below(feature))
    with pytest.raises(ConfigurationError, match=_refusal(feature)) as info:
        versions.require(feature, "FullyShardBuilder.device", "device")
    message = str(info.value)
    assert message.startswith("`FullyShardBuilder.device` got an invalid `device`")
    assert f"Upgrade torch to {versions.FEATURES[feature].minimum_text} or later" in message
    assert str(torch.__version__) in message
    # At the minimum itself nothing is refused.
    _pretend(monkeypatch, versions.FEATURES[feature].minimum)
    versions.require(feature, "FullyShardBuilder.device", "device")


def test_fsdp2_on_the_cpu_is_refused_in_configure(
    monkeypatch: pytest.MonkeyPatch, world1: None
) -> None:
    _pretend(monkeypatch, _below(versions.FSDP2_CPU))
    model = make_model(CFG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    with pytest.raises(ConfigurationError, match=_refusal(versions.FSDP2_CPU)):
        builder.build(model)
    # Refused before anything was sharded: the model is untouched.
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fsdp1_on_the_cpu_is_not_gated(monkeypatch: pytest.MonkeyPatch, world1: None) -> None:
    _pretend(monkeypatch, _below(versions.FSDP2_CPU))
    with pytest.warns(UserWarning, match="NO_SHARD"):
        built = FSDPBuilder().device(CPUDevice()).wrap(Block).build(make_model(CFG))
    assert isinstance(built, nn.Module)


@pytest.mark.parametrize("strategy", ["none", "hybrid"])
def test_fsdp2_replicating_on_gloo_is_refused_in_configure(
    monkeypatch: pytest.MonkeyPatch, world1: None, strategy: str
) -> None:
    feature = versions.FSDP2_REPLICATE_GLOO
    _pretend(monkeypatch, _below(feature))
    # The gate looks at the world the strategy replicates over; one rank replicates nothing.
    monkeypatch.setattr(versions, "_world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # hybrid: devices per node, without CUDA
    builder = FullyShardBuilder().device(CPUDevice()).sharding(strategy)
    with pytest.raises(ConfigurationError, match=_refusal(feature)) as info:
        builder.build(make_model(CFG))
    assert "FullyShardBuilder.sharding" in str(info.value)


def test_each_gloo_gate_refuses_only_its_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import ShardingStrategy

    cpu = torch.device("cpu")
    sharded = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
    monkeypatch.setattr(versions, "_world_size", lambda: 2)
    # Below the sharding gate only: NO_SHARD (no reduce-scatter) builds, sharding is refused.
    _pretend(monkeypatch, _below(versions.FSDP2_SHARDED_GLOO))
    versions.check_fully_shard(ShardingStrategy.NO_SHARD, cpu)
    for strategy in sharded:
        with pytest.raises(ConfigurationError, match=_refusal(versions.FSDP2_SHARDED_GLOO)):
            versions.check_fully_shard(strategy, cpu)
    # Below the replication gate: NO_SHARD is refused for its all-reduce.
    _pretend(monkeypatch, _below(versions.FSDP2_REPLICATE_GLOO))
    with pytest.raises(ConfigurationError, match=_refusal(versions.FSDP2_REPLICATE_GLOO)):
        versions.check_fully_shard(ShardingStrategy.NO_SHARD, cpu)
    # Neither gate applies to CUDA devices or to one rank (FSDP1 never calls them).
    versions.check_fully_shard(ShardingStrategy.FULL_SHARD, torch.device("cuda", 0))
    monkeypatch.setattr(versions, "_world_size", lambda: 1)
    versions.check_fully_shard(ShardingStrategy.FULL_SHARD, cpu)


def test_fsdp2_sharding_on_gloo_is_refused_in_configure(
    monkeypatch: pytest.MonkeyPatch, world1: None
) -> None:
    feature = versions.FSDP2_SHARDED_GLOO
    _pretend(monkeypatch, _below(feature))
    monkeypatch.setattr(versions, "_world_size", lambda: 2)
    builder = FullyShardBuilder().device(CPUDevice()).sharding("grad_op").wrap(Block)
    with pytest.raises(ConfigurationError, match=_refusal(feature)) as info:
        builder.build(make_model(CFG))
    assert "FullyShardBuilder.sharding" in str(info.value)


def test_fsdp2_ignored_params_are_refused_in_configure(
    monkeypatch: pytest.MonkeyPatch, world1: None
) -> None:
    feature = versions.FSDP2_IGNORED_PARAMS
    _pretend(monkeypatch, _below(feature))
    model = make_model(CFG)
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).ignore(modules=[model.head])
    with pytest.raises(ConfigurationError, match=_refusal(feature)) as info:
        builder.build(model)
    assert "FullyShardBuilder.ignore" in str(info.value)


def test_dcp_folders_need_no_dist_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """FromCheckpoint refuses a DCP folder when it opens it (every rank alike, before any
    weight is read); safetensors files need nothing newer than the floor."""
    feature = versions.DCP_NO_DIST
    _pretend(monkeypatch, _below(feature))
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigurationError, match=_refusal(feature)) as info:
        open_checkpoint(tmp_path)
    assert str(info.value).startswith("`FromCheckpoint` got an invalid `path`")
    assert "safetensors" in str(info.value)
