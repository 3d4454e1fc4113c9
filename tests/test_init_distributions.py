"""Every ``torch.nn.init`` function, and draws outside it, under ``StreamInit`` (whole units and
shard by shard) and ``DeterministicInit`` on 1 and 2 ranks, held to the distribution of eager
construction's draws; deterministic ones bit-equal. The cases and the judge (a two-sample KS test
and a tail count, against critical values) are ``benchmarks/init_table.py``'s, which writes the
table; here the judge is also shown to reject planted wrong distributions, the one ``StreamInit``
drew for ``trunc_normal_``'s narrow bounds among them."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from benchmarks.init_table import (
    CASES,
    EAGER_SEED,
    ISSUE_CASE,
    MATERIALIZERS,
    TAIL_Z,
    Case,
    digest,
    eager_weight,
    judge,
    run_case,
)

STREAMS = [m for m in MATERIALIZERS if m.startswith("StreamInit")]


# -- another thread drawing from torch's generator during the build (a data loader) -----------

THREADS = ("none", "between the draws", "in a loop")
_interfere = "none"


def _draw_elsewhere() -> None:
    torch.rand(1000)
    torch.randn(10)


class Replicated(nn.Module):
    """A weight and a buffer drawn with tensor methods, not from a stream: each rank draws its
    replica of the buffer. On rank 0 another thread draws between its two halves."""

    noise: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(64, 64))
        self.register_buffer("noise", torch.empty(1024))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.noise[:512].normal_()
            if _interfere == "between the draws" and dist.get_rank() == 0:
                other = threading.Thread(target=_draw_elsewhere)
                other.start()
                other.join()
            self.noise[512:].normal_()
            self.weight.copy_(torch.randn(64, 64))


class ReplicatedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Replicated()


def _loop(stop: threading.Event) -> None:
    for _ in range(100_000):  # bounded; joined after the build
        if stop.is_set():
            return
        torch.rand(16)


def _replicas(materializer: str, interfere: str) -> dict[str, str]:
    """Build while another thread draws (on rank 0); the digests of the full weight and of
    this rank's buffer."""
    import fsdp_builder as fb

    global _interfere
    _interfere = interfere
    with torch.device("meta"):
        model = ReplicatedModel()
    builder = fb.FullyShardBuilder().device(fb.CPUDevice()).wrap(Replicated)
    builder = builder.materialize(MATERIALIZERS[materializer]())
    stop = threading.Event()
    loop = threading.Thread(target=_loop, args=(stop,))
    if interfere == "in a loop" and dist.get_rank() == 0:
        loop.start()
    try:
        built = cast(ReplicatedModel, builder.build(model))
    finally:
        stop.set()
        if loop.is_alive():
            loop.join()
        _interfere = "none"
    weight = built.layer.weight
    full = weight.full_tensor() if isinstance(weight, DTensor) else weight
    return {"weight": digest(full.detach()), "noise": digest(built.layer.noise)}


def _all_cases() -> Results:
    """One spawn per world size: every case with every materializer, the issue's build
    (``FullyShardBuilder``'s default materializer), then builds beside another thread."""
    scenarios: list[tuple[str, str | None]] = [(k, m) for k in CASES for m in MATERIALIZERS]
    cases = [
        ((key, m), functools.partial(run_case, CASES[key], m))
        for key, m in [*scenarios, (ISSUE_CASE, None)]
    ]
    threads = [
        (("thread", m, t), functools.partial(_replicas, m, t))
        for m in MATERIALIZERS
        for t in THREADS
    ]
    return run_each([*cases, *threads])


SPAWN = Spawns(_all_cases, timeout=280)


def _rank0(world: int, key: str, materializer: str | None) -> dict[str, Any]:
    result: dict[str, Any] = values(SPAWN(world), (key, materializer))[0]
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("key", list(CASES))
def test_materialized_draws_have_eager_distribution(world: int, key: str) -> None:
    wrong = []
    for materializer in MATERIALIZERS:
        v = _rank0(world, key, materializer)["verdict"]
        if not v.passed:
            wrong.append(
                f"{materializer}: {v.test} {v.statistic:.4f} (critical {v.critical:.4f}), "
                f"tail z {v.tail:.1f} (critical {v.tail_critical}) {v.structure}"
            )
    assert not wrong, f"{key} at {world} rank(s), unlike eager construction:\n" + "\n".join(wrong)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", list(CASES))
def test_full_weights_are_the_same_at_one_and_two_ranks(key: str) -> None:
    # Both promise the same full weights at any world size; StreamInit whole or shard by shard.
    streams = {_rank0(w, key, m)["digest"] for w in (1, 2) for m in STREAMS}
    deterministic = {_rank0(w, key, "DeterministicInit")["digest"] for w in (1, 2)}
    assert len(streams) == 1, f"StreamInit: {streams}"
    assert len(deterministic) == 1, f"DeterministicInit: {deterministic}"


@pytest.mark.timeout(300)
def test_the_issue_build_of_a_narrow_truncated_normal_has_eager_moments() -> None:
    # FullyShardBuilder().wrap(...).build(model), 2 ranks, trunc_normal_(w, 0, 1, a=1, b=3): the
    # library drew mean 1.399, std 0.356; eager gives 1.510, 0.417.
    got = _rank0(2, ISSUE_CASE, None)
    eager = eager_weight(CASES[ISSUE_CASE]).double()
    n = eager.numel()
    # Five standard errors of the mean and of the std (a truncated normal's kurtosis is small).
    assert abs(got["mean"] - float(eager.mean())) < 5 * 2**0.5 * float(eager.std()) / n**0.5
    assert abs(got["std"] - float(eager.std())) < 5 * float(eager.std()) / n**0.5
    assert got["verdict"].passed


# -- the judge can fail ---------------------------------------------------------------------------


def _planted(case: Case, sample: torch.Tensor) -> dict[str, torch.Tensor]:
    """Wrong versions of a correct ``sample``: rescaled by 10 %, shifted by a tenth of a std,
    and for deterministic cases one element off."""
    if case.check == "exact":
        off = sample.clone()
        off.view(-1)[off.numel() // 2] += 1
        return {"one element off": off}
    std = float(sample.double().std())
    return {
        "scaled by 1.1": (sample.double() * 1.1).to(sample.dtype),
        "shifted by std/10": (sample.double() + std / 10).to(sample.dtype),
    }


@pytest.mark.parametrize("key", list(CASES))
def test_the_judge_accepts_another_seed_and_rejects_planted_wrong_draws(key: str) -> None:
    case = CASES[key]
    eager = eager_weight(case)
    other = eager_weight(case, EAGER_SEED + 1)
    if case.check != "exact":
        assert not torch.equal(other, eager)
    assert judge(case, other, eager).passed, "torch's own draws with another seed"
    for name, wrong in _planted(case, other).items():
        assert not judge(case, wrong, eager).passed, name


class _FirstCandidates(TorchFunctionMode):
    """Answers the first ``uniform_`` on ``target`` with ``values``, as StreamInit answered the
    first draw inside ``trunc_normal_`` before it checked which draw it was."""

    def __init__(self, target: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.target, self.values, self.done = target, values, False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.Tensor.uniform_ and args[0] is self.target and not self.done:
            self.done = True
            return self.target.copy_(self.values)
        return func(*args, **(kwargs or {}))


def test_the_judge_rejects_the_narrow_truncated_normal_streaminit_drew_by_a_wide_margin() -> None:
    case = CASES[ISSUE_CASE]
    eager = eager_weight(case)
    substituted = eager_weight(case, EAGER_SEED + 1)  # exact truncated normals, fed as candidates
    planted = torch.empty(case.shape)
    torch.manual_seed(EAGER_SEED + 2)
    with _FirstCandidates(planted, substituted):
        nn.init.trunc_normal_(planted, 0.0, 1.0, a=1.0, b=3.0)
    assert abs(float(planted.mean()) - 1.40) < 0.02  # the issue's numbers: mean 1.399, std 0.356
    verdict = judge(case, planted, eager)
    assert not verdict.passed
    assert verdict.statistic > 3 * verdict.critical


def test_the_judge_rejects_16_bit_truncated_normals_drawn_in_16_bits() -> None:
    # StreamInit's inverse CDF computed in bf16 never gave values beyond 2.9 std; KS alone
    # barely sees it, the tail count does.
    case = CASES["trunc_normal_(bf16, one-sided: a=0, b=inf)"]
    eager = eager_weight(case)
    generator = torch.Generator().manual_seed(EAGER_SEED + 1)
    planted = torch.empty(case.shape, dtype=torch.bfloat16).uniform_(0.0, 1.0, generator=generator)
    planted.erfinv_().mul_(math.sqrt(2.0))
    verdict = judge(case, planted, eager)
    assert not verdict.passed
    assert verdict.tail > TAIL_Z


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("materializer", list(MATERIALIZERS))
def test_another_thread_drawing_during_the_build_changes_no_replica(
    world: int, materializer: str
) -> None:
    # Another thread draws from torch's generator on rank 0 only, between the module's draws
    # or all along the build: every rank's replica of the buffer and the full weight must be
    # those of the build without it.
    alone = values(SPAWN(world), ("thread", materializer, "none"))
    assert all(r == alone[0] for r in alone), "replicas differ without another thread"
    for interfere in THREADS[1:]:
        for rank, got in enumerate(values(SPAWN(world), ("thread", materializer, interfere))):
            assert got == alone[0], f"rank {rank}, another thread drawing {interfere}"
