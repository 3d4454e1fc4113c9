"""FSDP1 builds on 2 and 4 gloo ranks train exactly like a single-process reference.

One spawn per world size builds every scenario, each on its own (see ``isolated``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict, reference
from isolated import Results, Spawns, run_each, values
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_builder import AutoHybridGroups, CPUDevice, FSDPBuilder
from fsdp_builder.tools.demo import Block, DemoConfig, make_model, train

# Whichever test first reads a world size's results starts its spawn (deadline 240 s).
pytestmark = pytest.mark.timeout(300)

STEPS = 3
CFG = DemoConfig(layers=2)
Scenario = tuple[str, str | None]
SCENARIOS: dict[int, list[Scenario]] = {
    2: [("full", None), ("grad_op", None), ("none", None)],
    4: [("full", None), ("grad_op", None), ("none", None), ("hybrid", "mesh"), ("hybrid", "auto")],
}


def build_and_train(strategy: str, groups: str | None) -> dict[str, Any]:
    """One rank: build the demo model for one scenario, train, gather the full state dict."""
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).sharding(strategy)
    if groups == "mesh":
        builder.groups(init_device_mesh("cpu", (2, 2)))
    elif groups == "auto":
        builder.groups(AutoHybridGroups(devices_per_node=2))
    sharded = builder.build(make_model(CFG))
    env = builder.environment
    wrappers = [m for m in sharded.modules() if isinstance(m, FullyShardedDataParallel)]
    local = sum(p.numel() for p in sharded.parameters())
    losses = train(sharded, CFG, STEPS, dist.get_rank(), dist.get_world_size())
    return {
        "losses": losses,
        "state": full_state_dict(sharded),
        "strategy": env.strategy.name,
        "shard_size": env.groups.world_size,
        "replicate_size": env.groups.replicate_size,
        "wrappers": len(wrappers),
        "units": len(env.plan),
        "local_numel": local,
        "model_numel": env.plan.numel,
    }


def cases(scenarios: list[Scenario]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for strategy, groups in scenarios:
        yield (strategy, groups), partial(build_and_train, strategy, groups)


def rank_main(scenarios: list[Scenario]) -> Results:
    """Every scenario of one world size, each with its own result or error."""
    return run_each(cases(scenarios))


SPAWNS = Spawns(rank_main, timeout=240)
CASES = [(world, scenario) for world, scenarios in SCENARIOS.items() for scenario in scenarios]
IDS = [f"w{world}-{strategy}-{groups}" for world, (strategy, groups) in CASES]


def scenario(world: int, key: Scenario) -> list[dict[str, Any]]:
    """One scenario's per-rank results; the spawn of ``world`` ranks runs once per module."""
    return values(SPAWNS(world, SCENARIOS[world]), key)


@functools.cache
def _reference(world: int) -> dict[str, Any]:
    return reference(make_model(CFG), CFG, STEPS, world)


@pytest.mark.parametrize(("world", "case"), CASES, ids=IDS)
def test_losses_match_single_process_reference(world: int, case: Scenario) -> None:
    ranks, ref = scenario(world, case), _reference(world)
    for rank in range(world):
        got = torch.tensor(ranks[rank]["losses"])
        want = torch.tensor(ref["losses"][rank])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (case, rank, got, want)


@pytest.mark.parametrize(("world", "case"), CASES, ids=IDS)
def test_gathered_state_dict_matches_reference(world: int, case: Scenario) -> None:
    ranks, ref = scenario(world, case), _reference(world)
    for rank in range(world):
        state = ranks[rank]["state"]
        assert state.keys() == ref["state_dict"].keys(), case
        for name, want in ref["state_dict"].items():
            assert torch.allclose(state[name], want, atol=1e-5, rtol=0), (case, name)


@pytest.mark.parametrize(("world", "case"), CASES, ids=IDS)
def test_every_unit_is_wrapped_and_groups_have_the_asked_shape(world: int, case: Scenario) -> None:
    out = scenario(world, case)[0]
    assert out["wrappers"] == out["units"] == CFG.layers + 1
    if case[0] == "hybrid":
        assert (out["shard_size"], out["replicate_size"]) == (2, 2)
        assert out["strategy"] == "HYBRID_SHARD"
    else:
        assert (out["shard_size"], out["replicate_size"]) == (world, 1)


@pytest.mark.parametrize("world", list(SCENARIOS))
def test_full_shard_keeps_about_one_shard_per_rank(world: int) -> None:
    full, none = scenario(world, ("full", None)), scenario(world, ("none", None))
    for rank in range(world):
        sharded, whole = full[rank], none[rank]
        # FSDP pads each flat parameter to a multiple of the world size.
        assert sharded["local_numel"] <= sharded["model_numel"] / world + world * sharded["units"]
        assert whole["local_numel"] == whole["model_numel"]
