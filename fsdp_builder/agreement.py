"""Rank agreement: before and after every step that can fail locally, ranks compare notes.

A rank that failed, or that built a different model, makes every rank raise the same
RankDisagreementError instead of leaving the others blocked in the next collective. The happy path
costs one tiny all-gather; messages are exchanged only when something failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_builder.collectives import collective_device
from fsdp_builder.errors import RankDisagreementError

T = TypeVar("T")


def _first_difference(descriptions: list[Any]) -> str:
    reference = descriptions[0]
    for rank, desc in enumerate(descriptions[1:], start=1):
        if desc == reference:
            continue
        ref_units = [u for u, _ in reference]
        units = [u for u, _ in desc]
        if ref_units != units:
            return f"rank {rank} planned units {units}, rank 0 planned {ref_units}"
        for (unit, ref_states), (_, states) in zip(reference, desc, strict=True):
            for a, b in zip(ref_states, states, strict=False):
                if a != b:
                    return (
                        f"in unit '{unit or '<root>'}', rank 0 has {a[0]} {list(a[1])} {a[2]} "
                        f"but rank {rank} has {b[0]} {list(b[1])} {b[2]}"
                    )
            if len(ref_states) != len(states):
                return (
                    f"in unit '{unit or '<root>'}', rank 0 has {len(ref_states)} states but "
                    f"rank {rank} has {len(states)}"
                )
    return "ranks differ"


def agree(
    stage: str,
    error: BaseException | None = None,
    *,
    unit: str | None = None,
    group: dist.ProcessGroup | None = None,
    fingerprint: int = 0,
    description: Any = None,
) -> None:
    """Every rank of ``group`` calls this at the same point. Raises RankDisagreementError on all
    of them if any passed an ``error`` or if their ``fingerprint``s differ (``description`` is
    then exchanged to name the first difference)."""
    if group is None and not dist.is_initialized():
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.tensor(
        [1 if error is not None else 0, fingerprint], dtype=torch.int64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    flags = [int(t[0]) for t in gathered]
    prints = {int(t[1]) for t in gathered}
    if error is not None and all(flags):
        # Every rank failed: each raises its own error, which already says what to fix.
        raise error
    if any(flags):
        # Each failing rank sends its own stage and message, so that every rank raises the same
        # error, named after the first failing rank's stage (not after where it waited).
        notes: list[Any] = [None] * world
        local = None if error is None else (stage, f"{type(error).__name__}: {error}")
        dist.all_gather_object(notes, local, group=group)
        failures = {r: str(n[1]) for r, n in enumerate(notes) if n is not None}
        first = next(n for n in notes if n is not None)
        raise RankDisagreementError(first[0], failures, unit) from error
    if len(prints) > 1:
        descriptions: list[Any] = [None] * world
        dist.all_gather_object(descriptions, description, group=group)
        by_rank = [int(t[1]) for t in gathered]
        odd = [r for r, fp in enumerate(by_rank) if fp != by_rank[0]]
        detail = _first_difference(descriptions)
        raise RankDisagreementError(
            stage,
            {
                r: f"built a different model than rank 0 ({detail}). Build the same model "
                "with the same wrap policy and ignored states on every rank."
                for r in odd
            },
            unit,
        )


class Agreement:
    """How a build's steps agree: a step that runs collectives is preceded by an agreement on
    the local steps before it; a local step only records its failure (and the rank skips its
    next local steps until the agreement), so ranks agree once per unit unless a strategy
    communicates. A step that communicates must fail on every rank alike, or only after its
    last collective."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        # A local step's failure, held until the next agreement.
        self.pending: tuple[str, BaseException] | None = None

    def now(self, stage: str, fn: Callable[[], T], unit: str | None = None) -> T:
        """Run ``fn``, then agree on its outcome across ranks."""
        error: BaseException | None = None
        result: T | None = None
        try:
            result = fn()
        except Exception as exc:  # any rank's failure must reach every rank
            error = exc
        agree(stage, error, unit=unit, group=self.group)
        return result  # type: ignore[return-value]  # agree raised when fn did

    def step(self, stage: str, fn: Callable[[], T], unit: str, communicates: bool) -> T | None:
        """Run one per-unit step (see the class doc); None when it was skipped or failed."""
        if communicates:
            self.settle(unit)
            return self.now(stage, fn, unit)
        if self.pending is not None:
            return None
        try:
            return fn()
        except Exception as exc:
            self.pending = (stage, exc)
            return None

    def settle(self, unit: str) -> None:
        """Agree on the local steps run since the last agreement."""
        stage, error = self.pending or ("unit", None)
        self.pending = None
        agree(stage, error, unit=unit, group=self.group)
