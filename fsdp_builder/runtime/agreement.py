"""Rank agreement: around every step that can fail locally, ranks compare notes, so a rank's
failure raises on every rank instead of blocking the others in the next collective (see
docs/architecture.md). The happy path costs one tiny all-gather."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_builder.common.describe import listed
from fsdp_builder.errors import CommunicationError, RankDisagreementError
from fsdp_builder.runtime.collectives import collective_device

T = TypeVar("T")

# Builds started in this process; ranks that build the same sequence of models number them
# alike, which keeps their store marks apart.
_BUILDS = itertools.count()


class Arrival:
    """Marks in the process group's store that say which ranks reached an agreement."""

    def __init__(self, prefix: str, group: dist.ProcessGroup | None) -> None:
        self.prefix = prefix
        self.ranks = dist.get_process_group_ranks(group) if group is not None else None
        try:
            self.store: Any = dist.distributed_c10d._get_default_store()
        except Exception:  # no default store: the missing ranks stay unknown
            self.store = None

    def mark(self) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/{dist.get_rank()}", "1")

    def missing(self) -> list[int]:
        if self.store is None:
            return []
        ranks = self.ranks if self.ranks is not None else range(dist.get_world_size())
        try:
            return [r for r in ranks if not self.store.check([f"{self.prefix}/{r}"])]
        except Exception:  # the store went with the peer that hosted it
            return []


def _first_difference(descriptions: list[Any]) -> str:
    """The first setting, then the first planned state, where a rank differs from rank 0."""
    reference = descriptions[0]
    for rank, desc in enumerate(descriptions[1:], start=1):
        if desc == reference:
            continue
        for (name, mine), (_, theirs) in zip(reference["config"], desc["config"], strict=False):
            if mine != theirs:
                return f"rank {rank} has {name}={theirs} but rank 0 has {name}={mine}"
        return _plan_difference(rank, reference["plan"], desc["plan"])
    return "ranks differ"


def _plan_difference(rank: int, reference: Any, desc: Any) -> str:
    ref_units = [u for u, _ in reference]
    units = [u for u, _ in desc]
    if ref_units != units:
        return f"rank {rank} planned units {units}, rank 0 planned {ref_units}"
    for (unit, ref_states), (_, states) in zip(reference, desc, strict=True):
        where = f"in unit '{unit or '<root>'}'"
        ref_names = [s[0] for s in ref_states]
        names = [s[0] for s in states]
        # A state one rank shards and the other does not (another model, or other ignored
        # states) is named by what is missing, not by the first position the lists part.
        only_ref = [n for n in ref_names if n not in set(names)]
        only_rank = [n for n in names if n not in set(ref_names)]
        if only_ref or only_rank:
            parts = []
            if only_ref:
                parts.append(f"rank 0 has {listed(only_ref, 4)} that rank {rank} does not")
            if only_rank:
                parts.append(f"rank {rank} has {listed(only_rank, 4)} that rank 0 does not")
            return f"{where}, {' and '.join(parts)}"
        for a, b in zip(ref_states, states, strict=False):
            if a != b:
                return (
                    f"{where}, rank 0 has {a[0]} {list(a[1])} {a[2]} "
                    f"but rank {rank} has {b[0]} {list(b[1])} {b[2]}"
                )
        if len(ref_states) != len(states):
            return f"{where}, rank 0 has {len(ref_states)} states but rank {rank} has {len(states)}"
    return "ranks differ"


def agree(
    stage: str,
    error: BaseException | None = None,
    *,
    unit: str | None = None,
    group: dist.ProcessGroup | None = None,
    fingerprint: int = 0,
    description: Any = None,
    arrival: Arrival | None = None,
    timeout: float | None = None,
    flag: bool = False,
    shared: type[Exception] | None = None,
) -> bool:
    """Every rank of ``group`` calls this at the same point. Raises RankDisagreementError on all
    if any passed an ``error`` or ``fingerprint``s differ (``description`` then names the first
    difference); CommunicationError if the exchange itself fails. Returns whether any rank
    passed ``flag`` (a question the same exchange answers, saving a collective of its own).
    ``shared``: the failure is a verdict one rank reached for all (rank 0 opened the source), so
    every rank raises the first failure's message as ``shared`` instead."""
    if group is None and not dist.is_initialized():
        if error is not None:
            raise error
        return flag
    if dist.get_backend(group) == "fake":
        # torch's fake process group (the dry run) hands every rank's slot this rank's own
        # notes, so the exchange's answer is known without gathering `world` copies of them.
        if error is not None:
            raise error
        return flag
    world = dist.get_world_size(group)

    def lost(exc: Exception) -> CommunicationError:
        text = str(exc).strip()
        detail = text.splitlines()[0] if text else type(exc).__name__
        missing = arrival.missing() if arrival is not None else []
        return CommunicationError(stage, unit, missing, f"{type(exc).__name__}: {detail}", timeout)

    def gather_objects(value: Any) -> list[Any]:
        found: list[Any] = [None] * world
        try:
            dist.all_gather_object(found, value, group=group)
        except Exception as exc:
            raise lost(exc) from (error or exc)
        return found

    device = collective_device(group)
    mine = torch.tensor(
        [int(error is not None), fingerprint, int(flag)], dtype=torch.int64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    try:
        if arrival is not None:
            arrival.mark()
        dist.all_gather(gathered, mine, group=group)
    except Exception as exc:
        raise lost(exc) from (error or exc)
    flags = [int(t[0]) for t in gathered]
    by_rank = [int(t[1]) for t in gathered]
    if error is not None and all(flags):
        # Every rank failed: each raises its own error, which already says what to fix.
        raise error
    if any(flags):
        # Each failing rank sends its stage and unit, so every rank names the first failure,
        # not where it waited.
        local = (
            None if error is None else (stage, unit, f"{type(error).__name__}: {error}", str(error))
        )
        notes = gather_objects(local)
        failures = {r: str(n[2]) for r, n in enumerate(notes) if n is not None}
        first = next(n for n in notes if n is not None)
        if shared is not None:
            raise shared(first[3]) from error
        raise RankDisagreementError(first[0], failures, first[1]) from error
    if len(set(by_rank)) > 1:
        odd = [r for r, fp in enumerate(by_rank) if fp != by_rank[0]]
        detail = _first_difference(gather_objects(description))
        raise RankDisagreementError(
            stage,
            {
                r: f"configured or built differently than rank 0 ({detail}). Build the same "
                "model with the same builder calls on every rank: the same wrap policy, "
                "ignored states, strategies and options."
                for r in odd
            },
            unit,
        )
    return any(int(t[2]) for t in gathered)


class Agreement:
    """How a build's steps agree: a local step only records its failure (the rank then skips
    local steps); every collective step is preceded by an agreement on them. Precondition: a
    step that communicates fails on every rank alike, or only after its last collective."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float | None = None) -> None:
        self.group = group
        self.timeout = timeout
        self.build = next(_BUILDS)
        self.count = itertools.count()
        # A local step's failure (stage, unit, error), held until the next agreement.
        self.pending: tuple[str, str, BaseException] | None = None

    def agree(
        self, stage: str, error: BaseException | None, unit: str | None = None, **kw: Any
    ) -> bool:
        """``agree`` over this build's group. Only with a timeout does each rank leave an
        arrival mark in the store (one round trip), to name the ranks that never came."""
        arrival = None
        if self.timeout is not None and dist.is_initialized():
            arrival = Arrival(f"fsdp_builder/{self.build}/{next(self.count)}", self.group)
        return agree(
            stage, error, unit=unit, group=self.group, arrival=arrival, timeout=self.timeout, **kw
        )

    def now(self, stage: str, fn: Callable[[], T], unit: str | None = None) -> T:
        """Run ``fn``, then agree on its outcome across ranks."""
        return self.now_asking(stage, fn, unit)[0]

    def now_asking(
        self, stage: str, fn: Callable[[], T], unit: str | None = None, flag: bool = False
    ) -> tuple[T, bool]:
        """``now``, and whether any rank passed ``flag`` (answered by the same exchange)."""
        error: BaseException | None = None
        result: T | None = None
        try:
            result = fn()
        except Exception as exc:  # any rank's failure must reach every rank
            error = exc
        any_flag = self.agree(stage, error, unit, flag=flag)
        return result, any_flag  # type: ignore[return-value]  # agree raised when fn did

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
            self.pending = (stage, unit, exc)
            return None

    def settle(self, unit: str | None) -> None:
        """Agree on the local steps run since the last agreement."""
        stage, where, error = self.pending or ("unit", unit, None)
        self.pending = None
        self.agree(stage, error, where)

    def finish(self, fn: Callable[[], None]) -> None:
        """The last agreement: on pending local steps, and on ``fn`` (run if none failed)."""
        if self.pending is not None:
            self.settle(None)
            return
        self.now("finish", fn)
