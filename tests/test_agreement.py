"""A failure on some ranks, or ranks with different models, stop every rank with one clear error;
nothing hangs (every spawn has a deadline) and failed builds leave the model untouched.

One spawn of 2 ranks runs every scenario, each on its own (see ``isolated``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from isolated import START_METHOD, Results, Spawns, run_each, values
from models import meta_demo
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from typing_extensions import override

from fsdp_builder import (
    BaseMaterializer,
    BaseSynchronizer,
    ConfigurationError,
    CPUDevice,
    FSDPBuilder,
    FullyShardBuilder,
    KeepAsIs,
    RankDisagreementError,
    ResetParameters,
    ShardingBuilder,
)
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, make_model
from fsdp_builder.tools.launch import RankFailure, run_ranks

CFG = DemoConfig(layers=2)


class FailOnRank1(BaseMaterializer):
    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        if env.rank == 1 and unit.fqn == "blocks.1":
            raise RuntimeError("disk full while loading blocks.1")
        return 0


class PrepareFailsOnRank1(FailOnRank1):
    @override
    def prepare(self, env: Environment) -> Any:
        if env.rank == 1:
            raise RuntimeError("index unreadable on rank 1")
        return super().prepare(env)


class BrokenResolverOnRank1(CPUDevice):
    @override
    def resolve(self, module: nn.Module, params: Any, rank: int) -> torch.device:
        if rank == 1:
            raise RuntimeError("no device left for rank 1")
        return super().resolve(module, params, rank)


def attempt(builder: ShardingBuilder, model: nn.Module) -> dict[str, Any]:
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    try:
        builder.build(model)
    except Exception as exc:
        after = {n: p for n, p in model.named_parameters() if not p.is_meta}
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "failures": sorted(getattr(exc, "failures", {})),
            "wrapped": any(isinstance(m, FullyShardedDataParallel) for m in model.modules()),
            "sharded": any(isinstance(p, DTensor) for p in model.parameters()),
            "untouched": before.keys() == after.keys()
            and all(torch.equal(before[n], after[n]) for n in before),
        }
    return {"type": None}


def different_model() -> dict[str, Any]:
    """Rank 1 built a wider MLP: detected before anything is sharded."""
    cfg = CFG if dist.get_rank() == 0 else DemoConfig(layers=2, mlp_ratio=2)
    return attempt(FSDPBuilder().device(CPUDevice()).wrap(Block), make_model(cfg))


def different_plan() -> dict[str, Any]:
    """Rank 1 wraps differently: a different unit plan."""
    policy: Any = Block if dist.get_rank() == 0 else nn.Linear
    return attempt(FSDPBuilder().device(CPUDevice()).wrap(policy), make_model(CFG))


def bad_input_everywhere() -> dict[str, Any]:
    """The same bad input on every rank: each raises the original, specific error."""
    return attempt(
        FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(KeepAsIs()), meta_demo(CFG)
    )


def partial_hybrid_groups() -> dict[str, Any]:
    """Hybrid groups that do not cover the world: refused on every rank before any
    collective."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mine = singles[dist.get_rank()]
    return attempt(
        FSDPBuilder().device(CPUDevice()).wrap(Block).sharding("hybrid").groups((mine, mine)),
        make_model(CFG),
    )


def ignore_nothing_on_one_rank() -> dict[str, Any]:
    """Ignoring nothing on one rank is not ignoring: the same program, built on every rank."""
    quiet = FSDPBuilder().device(CPUDevice()).wrap(Block)
    return attempt(quiet.ignore([]) if dist.get_rank() == 1 else quiet, make_model(CFG))


def local_step_fails_on_one_rank() -> dict[str, Any]:
    """A step that does not communicate (a synchronizer here) fails on rank 1 only."""

    class FailOnRank1(BaseSynchronizer):
        communicates = False

        def synchronize(self, unit: Any, env: Any) -> int:
            if dist.get_rank() == 1 and unit.is_root:
                raise RuntimeError("rank 1 fails")
            return 0

    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).synchronize(FailOnRank1())
    try:
        builder.build(DemoTransformer(CFG))
    except RankDisagreementError as exc:
        return {"stage": exc.stage, "failures": sorted(exc.failures)}
    return {"stage": None, "failures": []}


def prepare_fails(builder: type[ShardingBuilder]) -> dict[str, Any]:
    return attempt(
        builder().device(CPUDevice()).wrap(Block).materialize(PrepareFailsOnRank1()),
        make_model(CFG),
    )


VERDICT = "`FromStateDict` got an invalid `source`: planted on rank 0. Fix it."


def rank0_verdict() -> dict[str, Any]:
    """A check only rank 0 ran (it opened the source) reaches every rank as its own class."""
    error = ConfigurationError(VERDICT) if dist.get_rank() == 0 else None
    try:
        agree("materialize (open)", error, shared=ConfigurationError)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def good_after_failures() -> dict[str, Any]:
    """After all the failures above the group still works: a good build succeeds."""
    good = FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(ResetParameters())
    good.build(make_model(CFG))
    return {"units": len(good.plan)}


def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    yield "different_model", different_model
    yield "different_plan", different_plan
    # A local failure on rank 1 half-way through the units.
    yield (
        "materialize_fails_on_one_rank",
        lambda: attempt(
            FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(FailOnRank1()),
            make_model(CFG),
        ),
    )
    yield (
        "resolver_fails_on_one_rank",
        lambda: attempt(FSDPBuilder().device(BrokenResolverOnRank1()).wrap(Block), make_model(CFG)),
    )
    # A strategy's prepare fails on rank 1: every rank stops before a unit is touched, whether
    # the backend's units communicate (FSDP1) or not (FSDP2).
    for builder in (FSDPBuilder, FullyShardBuilder):
        yield f"prepare_fails_on_one_rank_{builder.__name__}", partial(prepare_fails, builder)
    yield "bad_input_everywhere", bad_input_everywhere
    yield "partial_hybrid_groups", partial_hybrid_groups
    yield "ignore_nothing_on_one_rank", ignore_nothing_on_one_rank
    yield "local_step_fails_on_one_rank", local_step_fails_on_one_rank
    yield "rank0_verdict", rank0_verdict
    # Last: it reads whether the failures before it left the group usable.
    yield "good_after_failures", good_after_failures


def scenarios() -> Results:
    return run_each(cases(), stall_seconds=30)


SPAWNS = Spawns(scenarios, timeout=180)


def outcome(key: str, rank: int) -> dict[str, Any]:
    return cast(dict[str, Any], values(SPAWNS(2), key)[rank])


@pytest.mark.parametrize("rank", [0, 1])
def test_different_models_are_named_before_sharding(rank: int) -> None:
    out = outcome("different_model", rank)
    assert out["type"] == "RankDisagreementError" and out["failures"] == [1]
    assert "blocks.0.mlp.0.weight [256, 64]" in out["message"]
    assert "blocks.0.mlp.0.weight [128, 64]" in out["message"]
    assert not out["wrapped"] and out["untouched"]


@pytest.mark.parametrize("rank", [0, 1])
def test_different_unit_plans_are_named(rank: int) -> None:
    out = outcome("different_plan", rank)
    assert out["type"] == "RankDisagreementError"
    # The wrap policies differ: the configuration agreement names that setting first.
    assert "rank 1 has wrap=Linear but rank 0 has wrap=Block" in out["message"]
    assert "same wrap policy" in out["message"]
    assert not out["wrapped"]


@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_failing_stops_every_rank_with_its_message(rank: int) -> None:
    out = outcome("materialize_fails_on_one_rank", rank)
    assert out["type"] == "RankDisagreementError" and out["failures"] == [1]
    assert "stage 'materialize' of unit 'blocks.1'" in out["message"]
    assert "rank 1: RuntimeError: disk full while loading blocks.1" in out["message"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_verdict_of_rank_0_reaches_every_rank_as_its_class(rank: int) -> None:
    """How the rank-0 loaders share what rank 0 found when it opened the source."""
    assert outcome("rank0_verdict", rank) == {"type": "ConfigurationError", "message": VERDICT}


@pytest.mark.parametrize("backend", ["FSDPBuilder", "FullyShardBuilder"])
@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_failing_to_prepare_stops_every_rank_with_its_message(
    rank: int, backend: str
) -> None:
    out = outcome(f"prepare_fails_on_one_rank_{backend}", rank)
    assert out["type"] == "RankDisagreementError" and out["failures"] == [1]
    assert "stage 'prepare'" in out["message"]
    assert "rank 1: RuntimeError: index unreadable on rank 1" in out["message"]
    assert not out["wrapped"] and out["untouched"] and out["sharded"] is False


@pytest.mark.parametrize("rank", [0, 1])
def test_failure_before_any_collective_leaves_model_untouched(rank: int) -> None:
    out = outcome("resolver_fails_on_one_rank", rank)
    assert out["type"] == "RankDisagreementError" and out["failures"] == [1]
    assert "no device left for rank 1" in out["message"] and "stage 'configure'" in out["message"]
    assert not out["wrapped"] and out["untouched"]


@pytest.mark.parametrize("rank", [0, 1])
def test_same_bad_input_everywhere_raises_the_specific_error(rank: int) -> None:
    out = outcome("bad_input_everywhere", rank)
    assert out["type"] == "MaterializationError"
    assert "`KeepAsIs` got states on the meta device" in out["message"]


@pytest.mark.parametrize("rank", [0, 1])
def test_hybrid_groups_must_cover_the_world(rank: int) -> None:
    out = outcome("partial_hybrid_groups", rank)
    assert out["type"] == "ConfigurationError"
    assert "span 1 x 1 = 1 ranks but the world has 2" in out["message"]
    assert not out["wrapped"] and out["untouched"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_setting_that_changes_nothing_is_no_difference(rank: int) -> None:
    out = outcome("ignore_nothing_on_one_rank", rank)
    assert out["type"] is None, out


@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_failure_in_a_local_step_names_the_same_stage_everywhere(rank: int) -> None:
    out = outcome("local_step_fails_on_one_rank", rank)
    assert out == {"stage": "synchronize", "failures": [1]}


def test_group_still_usable_after_failures() -> None:
    assert [r["units"] for r in values(SPAWNS(2), "good_after_failures")] == [CFG.layers + 1] * 2


def hang_on_rank1() -> None:
    if dist.get_rank() == 1:
        dist.barrier()  # rank 0 never joins: a real hang
    dist.new_group()  # unreachable on rank 1


def test_launcher_turns_a_hang_into_an_error() -> None:
    # The launcher itself is the subject here, so this test starts its ranks with run_ranks
    # directly: the harness in ``isolated`` relies on the very deadline this test checks. It
    # keeps the launcher's default start method (spawn); the other launcher tests fork.
    with pytest.raises(RankFailure, match=r"did not finish within 15s|raised"):
        run_ranks(hang_on_rank1, 2, timeout=15)


def exit_on_rank1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)  # no report, no traceback: as a crash or a kill would leave it
    dist.barrier()  # rank 0 waits for a peer that is gone


def exit_on_rank1_while_rank0_blocks() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    threading.Event().wait()  # blocked outside any collective: only the launcher can end it


def test_launcher_kills_the_ranks_a_dead_rank_left_waiting() -> None:
    with pytest.raises(RankFailure) as raised:
        run_ranks(
            exit_on_rank1_while_rank0_blocks, 2, timeout=120, grace=1, start_method=START_METHOD
        )
    message = str(raised.value)
    assert "rank 1 exited with code 3 before reporting a result" in message
    assert "rank 0 was still running after rank(s) 1 died, and was killed" in message


def test_launcher_says_which_rank_died_and_how() -> None:
    # A rank that exits without reporting ends the run before the deadline, and the error says
    # which rank ended how, not that every rank ran out of time.
    with pytest.raises(RankFailure) as raised:
        run_ranks(exit_on_rank1, 2, timeout=120, grace=1, start_method=START_METHOD)
    message = str(raised.value)
    assert "rank 1 exited with code 3 before reporting a result" in message
    # Rank 0 either saw its peer's connection close and raised, or was killed while waiting.
    assert (
        "rank 0 raised:" in message
        or "rank 0 was still running after rank(s) 1 died, and was killed" in message
    )
    assert "did not finish within" not in message


# -- what ranks compare (no process group) ------------------------------------------------------


def test_descriptions_do_not_depend_on_order_or_identity() -> None:
    from pathlib import Path

    from fsdp_builder.common.describe import describe, describe_settings

    assert describe({"b": 1, "a": 2}) == describe({"a": 2, "b": 1})
    assert describe({nn.Linear, nn.ReLU}) == describe({nn.ReLU, nn.Linear})
    # Equal settings built from other objects read alike; different paths do not.
    assert describe(ResetParameters()) == describe(ResetParameters())
    assert describe(Path("a/b.safetensors")) == describe(Path("a/b.safetensors"))
    assert describe(Path("a/b.safetensors")) != describe(Path("a/c.safetensors"))
    # The ignored objects are left to the plan, which compares what they select.
    shard_view = [torch.empty(10), torch.empty(0)]
    other_rank = [torch.empty(6), torch.empty(4)]
    mine = describe_settings({"ignored_states": shard_view, "ignored_modules": None, "x": 1})
    theirs = describe_settings({"ignored_states": other_rank, "ignored_modules": None, "x": 1})
    assert mine == theirs == [("x", "1")]
