"""Rank agreement: before and after every step that can fail locally, ranks compare notes.

A rank that failed, or that built a different model, makes every rank raise the same
RankDisagreementError instead of leaving the others blocked in the next collective. The happy path
costs one tiny all-gather; messages are exchanged only when something failed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_builder.errors import RankDisagreementError


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor must live to travel on ``group``'s backend."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


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
        messages: list[Any] = [None] * world
        local = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, local, group=group)
        failures = {r: str(m) for r, m in enumerate(messages) if m is not None}
        raise RankDisagreementError(stage, failures, unit) from error
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
