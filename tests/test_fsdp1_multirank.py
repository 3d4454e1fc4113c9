"""FSDP1 builds on 2 and 4 gloo ranks train exactly like a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_builder import AutoHybridGroups, CPUDevice, FSDPBuilder
from fsdp_builder.demo import Block, DemoConfig, full_state_dict, make_model, reference, train
from fsdp_builder.launch import run_ranks

STEPS = 3
CFG = DemoConfig(layers=2)
SCENARIOS: dict[int, list[tuple[str, str | None]]] = {
    2: [("full", None), ("grad_op", None), ("none", None)],
    4: [("full", None), ("grad_op", None), ("none", None), ("hybrid", "mesh"), ("hybrid", "auto")],
}


def build_and_train(scenarios: list[tuple[str, str | None]]) -> list[dict[str, Any]]:
    """One rank: build the demo model for each scenario, train, gather the full state dict."""
    results = []
    for strategy, groups in scenarios:
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
        results.append(
            {
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
        )
    return results


@pytest.fixture(scope="module", params=[2, 4])
def run(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]], dict[str, Any]]:
    world = request.param
    ranks = run_ranks(build_and_train, world, SCENARIOS[world], timeout=240)
    ref = reference(make_model(CFG), CFG, STEPS, world)
    return world, ranks, ref


def test_losses_match_single_process_reference(run: Any) -> None:
    world, ranks, ref = run
    for i, scenario in enumerate(SCENARIOS[world]):
        for rank in range(world):
            got = torch.tensor(ranks[rank][i]["losses"])
            want = torch.tensor(ref["losses"][rank])
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (scenario, rank, got, want)


def test_gathered_state_dict_matches_reference(run: Any) -> None:
    world, ranks, ref = run
    for i, scenario in enumerate(SCENARIOS[world]):
        for rank in range(world):
            state = ranks[rank][i]["state"]
            assert state.keys() == ref["state_dict"].keys(), scenario
            for name, want in ref["state_dict"].items():
                assert torch.allclose(state[name], want, atol=1e-5, rtol=0), (scenario, name)


def test_every_unit_is_wrapped_and_groups_have_the_asked_shape(run: Any) -> None:
    world, ranks, _ = run
    for i, (strategy, _groups) in enumerate(SCENARIOS[world]):
        out = ranks[0][i]
        assert out["wrappers"] == out["units"] == CFG.layers + 1
        if strategy == "hybrid":
            assert (out["shard_size"], out["replicate_size"]) == (2, 2)
            assert out["strategy"] == "HYBRID_SHARD"
        else:
            assert (out["shard_size"], out["replicate_size"]) == (world, 1)


def test_full_shard_keeps_about_one_shard_per_rank(run: Any) -> None:
    world, ranks, _ = run
    full = SCENARIOS[world].index(("full", None))
    none = SCENARIOS[world].index(("none", None))
    for rank in range(world):
        sharded, whole = ranks[rank][full], ranks[rank][none]
        # FSDP pads each flat parameter to a multiple of the world size.
        assert sharded["local_numel"] <= sharded["model_numel"] / world + world * sharded["units"]
        assert whole["local_numel"] == whole["model_numel"]
