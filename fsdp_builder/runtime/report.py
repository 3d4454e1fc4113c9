"""The build report: per stage and unit, time, bytes and peak memory; also emitted as events."""

from __future__ import annotations

import logging
import resource
import time
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import attrs
import torch
from attrs import define, frozen


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocator peak on GPUs, the process's peak RSS elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux. RUSAGE_THREAD gives the same process-wide peak without
    # RUSAGE_SELF's summing of every thread's times, costly in a rank full of comm threads.
    return int(resource.getrusage(_RUSAGE).ru_maxrss) * 1024


_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


@frozen
class StageRecord:
    stage: str
    unit: str
    seconds: float
    bytes: int = 0
    comm_bytes: int = 0
    peak_bytes: int = 0


@define
class StageMeter:
    """Filled in by the step being measured."""

    bytes: int = 0
    comm_bytes: int = 0


@define
class BuildReport:
    """What a build did, on this rank."""

    rank: int = 0
    world_size: int = 1
    backend: str = ""
    strategy: str = ""
    device: str = ""
    records: list[StageRecord] = attrs.field(factory=list)

    def measure(
        self, stage: str, unit: str, device: torch.device, logger: Any
    ) -> AbstractContextManager[StageMeter]:
        """Time and record the block unless it raises; ``logger`` gets a ``build_stage`` event
        (None: no event)."""
        return _Measurement(self, stage, unit, device, logger)

    def stages(self) -> list[dict[str, Any]]:
        """Per stage totals, in first-seen order."""
        totals: dict[str, dict[str, Any]] = {}
        for r in self.records:
            t = totals.setdefault(
                r.stage,
                {"name": r.stage, "seconds": 0.0, "bytes": 0, "comm_bytes": 0, "peak_bytes": 0},
            )
            t["seconds"] += r.seconds
            t["bytes"] += r.bytes
            t["comm_bytes"] += r.comm_bytes
            t["peak_bytes"] = max(t["peak_bytes"], r.peak_bytes)
        return list(totals.values())

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def to_dict(self) -> dict[str, Any]:
        fields = attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "records")
        return {**fields, "stages": self.stages(), "units": [attrs.asdict(r) for r in self.records]}

    def format(self) -> str:
        mib = 1024 * 1024
        lines = [
            f"build report: backend={self.backend} strategy={self.strategy} "
            f"rank={self.rank}/{self.world_size} device={self.device}",
            f"  {'stage':<12} {'unit':<28} {'ms':>9} {'MiB':>9} {'comm MiB':>9} {'peak MiB':>9}",
        ]
        for r in self.records:
            lines.append(
                f"  {r.stage:<12} {r.unit:<28} {r.seconds * 1e3:>9.2f} {r.bytes / mib:>9.2f} "
                f"{r.comm_bytes / mib:>9.2f} {r.peak_bytes / mib:>9.1f}"
            )
        lines.append("  totals:")
        for s in self.stages():
            lines.append(
                f"  {s['name']:<12} {'':<28} {s['seconds'] * 1e3:>9.2f} {s['bytes'] / mib:>9.2f} "
                f"{s['comm_bytes'] / mib:>9.2f} {s['peak_bytes'] / mib:>9.1f}"
            )
        return "\n".join(lines)


def debug_enabled(logger: Any) -> bool:
    """Whether ``logger`` passes debug events on (True when it cannot say)."""
    check = getattr(logger, "is_enabled_for", None)
    return True if check is None else bool(check(logging.DEBUG))


class _Measurement:
    """One ``BuildReport.measure`` block: a plain context manager (runs several times per unit,
    where a generator-based one costs a generator and its frame each time)."""

    __slots__ = ("device", "logger", "meter", "report", "stage", "start", "unit")

    def __init__(
        self, report: BuildReport, stage: str, unit: str, device: torch.device, logger: Any
    ) -> None:
        self.report, self.stage, self.unit = report, stage, unit
        self.device, self.logger = device, logger
        self.meter = StageMeter()
        self.start = 0.0

    def __enter__(self) -> StageMeter:
        self.start = time.perf_counter()
        return self.meter

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            return
        meter = self.meter
        record = StageRecord(
            stage=self.stage,
            unit=self.unit,
            seconds=time.perf_counter() - self.start,
            bytes=meter.bytes,
            comm_bytes=meter.comm_bytes,
            peak_bytes=peak_memory_bytes(self.device),
        )
        self.report.records.append(record)
        if self.logger is not None:
            fields = attrs.asdict(record)
            self.logger.debug("build_stage", **{**fields, "seconds": round(record.seconds, 6)})
