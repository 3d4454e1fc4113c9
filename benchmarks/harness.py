"""The benchmark harness behind ``fsdp-builder bench``.

Every measurement runs in freshly started ranks (gloo on CPU, NCCL when CUDA is available) and
records, per rank: seconds from the start of the build to the sharded model being ready (after a
barrier), peak memory above the rank's pre-build baseline (resident memory on CPU, the CUDA
allocator's peak on GPU), bytes communicated where known, and for deterministic recipes a
checksum of the gathered weights. Recipes are interleaved round-robin inside each repeat, so
machine drift hits them all alike. Outputs: JSON records, a markdown table, a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import logging
import multiprocessing as mp
import os
import platform
import re
import sys
import tempfile
import threading
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm

from benchmarks import scaling
from benchmarks.baselines import BASELINES
from benchmarks.common import Job, Outcome, Recipe
from benchmarks.models import BenchConfig, largest_unit_bytes, model_bytes
from benchmarks.progress import Progress
from benchmarks.recipes import builder_recipes

log = structlog.get_logger("benchmarks")

MIB = 1024 * 1024
DEFAULT_SIZES = "50M,200M"
FULL_SIZES = "50M,200M,500M"
SMOKE_SIZES = "1M,2M"

# -- recipes ---------------------------------------------------------------------------------


def all_recipes() -> tuple[dict[str, Recipe], list[str]]:
    """Every recipe by name (baselines first), and notes on the builder recipes skipped."""
    found, notes = builder_recipes()
    return {r.name: r for r in (*BASELINES, *found)}, notes


# -- memory ----------------------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _reset_hwm() -> bool:
    """Reset the kernel's resident high-water mark; True when the reset took effect.

    ru_maxrss cannot be reset, and its high-water mark already includes the imports.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _hwm_bytes() <= _rss_bytes() + 4 * MIB
    except OSError:
        return False


def _rss_split() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes. statm's ``shared`` counts file-backed and
    shared-memory pages (RssFile + RssShmem); the rest of ``resident`` is anonymous (RssAnon).
    One read of statm is much cheaper than parsing /proc/self/status."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
    return resident - shared, shared


class RssSplit:
    """High-water marks of anonymous (heap) and file-backed (mapped files) resident memory,
    sampled every ``interval`` seconds by a thread; the kernel keeps no high-water mark of
    either, so spikes shorter than the interval are missed. A loader that maps a checkpoint
    shows up in ``file``, what it copies out of it in ``anon``."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.baseline = (0, 0)
        self.peak = (0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.baseline = self.peak = _rss_split()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _take(self) -> None:
        anon, file = _rss_split()
        self.peak = (max(self.peak[0], anon), max(self.peak[1], file))

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def stop(self) -> tuple[int, int]:
        """(anonymous, file-backed) peak above the levels at :meth:`start`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._take()
        return self.peak[0] - self.baseline[0], self.peak[1] - self.baseline[1]


class PeakMemory:
    """Peak memory above the level at :meth:`start`, for this process; on the CPU also the
    anonymous and file-backed peaks apart (:attr:`split`, set by :meth:`stop`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = ""
        self.baseline = 0
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._split = RssSplit() if device.type != "cuda" else None
        self.split: tuple[int, int] | None = None

    def start(self) -> None:
        if self._split is not None:
            self._split.start()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "cuda_max_memory_allocated"
            self.baseline = int(torch.cuda.memory_allocated(self.device))
            return
        self.baseline = _rss_bytes()
        if _reset_hwm():
            self.method = "VmHWM"
            return
        # Without clear_refs, sample the resident set; misses spikes shorter than the interval.
        self.method = "statm_sampling"
        self._peak = self.baseline
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _rss_bytes())

    def stop(self) -> int:
        if self._split is not None:
            self.split = self._split.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device)) - self.baseline
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return max(self._peak, _rss_bytes()) - self.baseline
        return _hwm_bytes() - self.baseline


def _max_known(values: Iterator[int | None]) -> int | None:
    return max((v for v in values if v is not None), default=None)


# -- one measurement, on one rank ------------------------------------------------------------


def checksum(module: torch.nn.Module) -> str | None:
    """CRC32 over the gathered full state dict (names sorted); rank 0 only, None elsewhere."""
    sd = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    if dist.get_rank() != 0:
        return None
    crc = 0
    for name in sorted(sd):
        t = sd[name]
        if not isinstance(t, torch.Tensor):
            continue
        crc = zlib.crc32(name.encode(), crc)
        flat = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
        crc = zlib.crc32(flat.numpy().data, crc)
    return f"{crc:08x}"


def _quiet_logging() -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _fixed_malloc_threshold() -> None:
    """Pin glibc's mmap threshold so that every large tensor is its own mapping.

    By default glibc raises the threshold (up to 32 MiB) each time an mmapped block is freed;
    tensors allocated after that come from the heap and linger there after being freed, so
    peak RSS would vary with allocation history instead of with what a recipe holds.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, fixed
    except (OSError, AttributeError):
        pass


DEFAULT_MALLOC_ENV = "FSDP_BENCH_DEFAULT_MALLOC"
WARMUP = BenchConfig(vocab=256, dim=64, heads=1, layers=2)
# The warm-up model's checkpoints, next to the measured sizes' ones.
WARMUP_CHECKPOINT = "warmup.safetensors"
WARMUP_DCP = "warmup.dcp"


# torch's C++ log prefix ("[W1130 03:42:27.123456 1234 file.cpp:56] "): dropped, so that
# the same message from two ranks or two measurements counts once.
_CPP_PREFIX = re.compile(r"^\[[WIEF]\d{4} [\d:.]+ \d+ [^\]]*\] ")


def _first_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return _CPP_PREFIX.sub("", line)[:300]


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    """Python warnings, log events and anything else written to stderr (torch's C++ messages
    included) inside the block, as one line each, instead of on the terminal where they would
    tear the progress bar. Yields the list, filled when the block ends."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with (
        tempfile.TemporaryFile() as tmp,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("default")
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            lines.extend(_first_line(f"{w.category.__name__}: {w.message}") for w in caught)
            lines.extend(_first_line(ln) for ln in text.splitlines() if ln.strip())


def make_source(cfg: BenchConfig, seed: int) -> dict[str, torch.Tensor]:
    """The full state dict that load recipes start from (rank 0's copy of the weights)."""
    from benchmarks.models import make_model

    return {k: v.detach() for k, v in make_model(cfg, "cpu", seed).state_dict().items()}


def measure(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """One rank of one measurement (runs inside a fresh rank); what the rank would have
    written to stderr comes back as ``warnings``, for the summary after the progress bar."""
    with captured_warnings() as lines:
        result = _measure(*args, **kwargs)
    result["warnings"] = sorted(set(lines))
    return result


def _measure(
    recipe_name: str,
    cfg: BenchConfig,
    seed: int,
    want_checksum: bool,
    warmup: bool = True,
    source_path: str | None = None,
    checkpoint_path: str | None = None,
    dcp_path: str | None = None,
) -> dict[str, Any]:
    setup_start = time.perf_counter()
    if os.environ.get(DEFAULT_MALLOC_ENV) != "1":
        _fixed_malloc_threshold()
    _quiet_logging()
    # Objects inherited from the fork server never become garbage; keep collections off them.
    gc.freeze()
    recipes, _ = all_recipes()
    recipe = recipes[recipe_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if warmup:
        # One tiny build first: one-time costs (lazy imports, first-call caches, communicator
        # set-up) are paid once per process whatever the model size, so they are not timed.
        tiny = make_source(WARMUP, seed) if recipe.needs_source and rank == 0 else None
        tiny_file = (
            os.path.join(os.path.dirname(checkpoint_path), WARMUP_CHECKPOINT)
            if checkpoint_path is not None
            else None
        )
        tiny_dcp = (
            os.path.join(os.path.dirname(dcp_path), WARMUP_DCP) if dcp_path is not None else None
        )
        recipe.run(
            Job(
                cfg=WARMUP,
                rank=rank,
                world_size=world,
                device=device,
                source=tiny,
                checkpoint=tiny_file,
                dcp=tiny_dcp,
            )
        )
        del tiny
    source: dict[str, torch.Tensor] | None = None
    if recipe.needs_source and rank == 0:
        # The state dict to load is already in rank 0's memory (say, read from a checkpoint);
        # reading it is not part of the job being timed.
        if source_path is not None:
            source = torch.load(source_path, map_location=device, weights_only=True)
        else:
            source = {k: v.to(device) for k, v in make_source(cfg, seed).items()}
    job = Job(
        cfg=cfg,
        rank=rank,
        world_size=world,
        device=device,
        seed=seed,
        source=source,
        checkpoint=checkpoint_path,
        dcp=dcp_path,
    )
    gc.collect()
    memory = PeakMemory(device)
    dist.barrier()
    setup_seconds = time.perf_counter() - setup_start
    memory.start()
    start = time.perf_counter()
    outcome: Outcome = recipe.run(job)
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = memory.stop()
    digest = None
    check_start = time.perf_counter()
    if want_checksum and recipe.deterministic and outcome.module is not None:
        digest = checksum(outcome.module)
    return {
        "rank": rank,
        "seconds": seconds,
        "peak_bytes": peak,
        "baseline_bytes": memory.baseline,
        "peak_anon_bytes": memory.split[0] if memory.split else None,
        "peak_file_bytes": memory.split[1] if memory.split else None,
        "memory_method": memory.method,
        "comm_bytes": outcome.comm_bytes,
        "weight_comm_bytes": outcome.weight_comm_bytes,
        "bucket_bytes": outcome.bucket_bytes,
        "phases": outcome.phases,
        "phase_comm_bytes": outcome.phase_comm_bytes,
        "checksum": digest,
        "setup_seconds": setup_seconds,
        "checksum_seconds": time.perf_counter() - check_start,
    }


# -- launching fresh ranks -------------------------------------------------------------------

# Modules torch imports lazily on first use (torch._dynamo alone takes over a second on the first
# meta-device normal_); importing them once in the fork server keeps that out of every rank.
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "benchmarks.harness",
]


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float,
    backend: str,
    method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh ranks; per-rank results, or RankFailure.

    ``forkserver`` (the default) forks each rank from a server that has only imported torch and
    the recipes: every measurement still gets brand-new processes, without paying about 3 s of
    imports per rank on a 2-core machine; ``spawn`` starts each from scratch.
    """
    from fsdp_builder.tools.launch import run_ranks

    return run_ranks(fn, world_size, *args, timeout=timeout, backend=backend, start_method=method)


# -- the run ---------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMBG" else text
    return int(float(number) * scale)


def machine_info(backend: str) -> dict[str, Any]:
    mem_total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem_total,
        "backend": backend,
        "cuda_device": torch.cuda.get_device_name(0) if backend == "nccl" else None,
        # Other work on the machine skews timings; this says how busy it was.
        "loadavg_start": _loadavg(),
    }


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _plan(
    recipes: Sequence[Recipe], sizes: Sequence[int], worlds: Sequence[int], repeats: int
) -> list[tuple[int, int, int, Recipe]]:
    """Measurement order: repeats outermost, recipes round-robin (rotated each repeat so no
    recipe always runs right after the same neighbour)."""
    order = []
    for repeat in range(repeats):
        for size in sizes:
            for world in worlds:
                shift = repeat % len(recipes)
                for recipe in [*recipes[shift:], *recipes[:shift]]:
                    order.append((repeat, size, world, recipe))
    return order


def warning_counts(
    records: Sequence[dict[str, Any]], caught: Sequence[warnings.WarningMessage]
) -> dict[str, dict[str, Any]]:
    """Each distinct warning: in how many measurements it came up, and the first of them."""
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}
    for r in records:
        for line in r.get("warnings", []):
            counts[line] += 1
            first.setdefault(line, f"{r['recipe']} {r['size']} w{r['world_size']}")
    for w in caught:
        line = _first_line(f"{w.category.__name__}: {w.message}")
        counts[line] += 1
        first.setdefault(line, "the harness")
    return {line: {"count": n, "first": first[line]} for line, n in counts.most_common()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdp-builder bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="where to write the JSON records")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    p.add_argument("--repeats", type=int, help="measurements per recipe and size (default 3)")
    p.add_argument("--sizes", help=f"model sizes in parameters (default {DEFAULT_SIZES})")
    p.add_argument("--world-size", type=int, action="append", help="ranks (repeatable)")
    p.add_argument("--full", action="store_true", help=f"sizes {FULL_SIZES}, world sizes 2, 4")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat")
    p.add_argument("--recipes", help="comma-separated recipe names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    p.add_argument("--launcher", choices=("forkserver", "spawn"), default="forkserver")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's adaptive mmap threshold (peak RSS then depends on allocation history)",
    )
    p.add_argument("--no-warmup", action="store_true", help="time the first build of each rank")
    p.add_argument(
        "--units",
        help="unit counts of the many-small-units case, comma-separated (default 400; "
        f"--full: {','.join(map(str, scaling.FULL_UNITS))} at world sizes "
        f"{','.join(map(str, scaling.FULL_WORLDS))})",
    )
    p.add_argument("--no-units", action="store_true", help="skip the many-small-units case")
    p.add_argument("--units-only", action="store_true", help="only the many-small-units case")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="log every measurement")
    return p


def _configure_logging(verbose: bool) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbose else logging.WARNING
        ),
        logger_factory=structlog.WriteLoggerFactory(_AboveTheBar()),
    )


class _AboveTheBar(io.StringIO):
    """A file for log lines that prints them above tqdm's progress bar, not through it."""

    def write(self, text: str) -> int:
        if text.strip():
            tqdm.write(text.rstrip("\n"), file=sys.stderr)
        return len(text)


def _units_plan(args: argparse.Namespace, repeats: int) -> list[tuple[int, int, int, str]]:
    if args.units:
        units = [int(u) for u in args.units.split(",") if u.strip()]
    elif args.smoke:
        units = [8]
    else:
        units = list(scaling.FULL_UNITS if args.full else scaling.DEFAULT_UNITS)
    worlds = args.world_size or (list(scaling.FULL_WORLDS) if args.full else [2])
    return scaling.plan(units, worlds, repeats, list(scaling.RECIPES))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    # Warnings of this process (the ranks capture their own) wait for the summary.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        return _run(args, caught)


def _run(args: argparse.Namespace, caught: list[warnings.WarningMessage]) -> int:
    _configure_logging(args.verbose)
    sizes_text = args.sizes or (
        SMOKE_SIZES if args.smoke else FULL_SIZES if args.full else DEFAULT_SIZES
    )
    sizes = [parse_size(s) for s in sizes_text.split(",") if s.strip()]
    worlds = args.world_size or ([2, 4] if args.full else [2])
    repeats = args.repeats or (1 if args.smoke else 3)
    if repeats < 1 or any(w < 1 for w in worlds) or not sizes:
        print("--repeats and --world-size must be at least 1, --sizes non-empty", file=sys.stderr)
        return 2
    available, notes = all_recipes()
    if args.recipes:
        wanted = [n.strip() for n in args.recipes.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in available]
        notes += [f"{n}: skipped, not available in this version" for n in unknown]
        recipes = [available[n] for n in wanted if n in available]
    else:
        recipes = list(available.values())
    if args.units_only:
        recipes = []
    if not recipes and not args.units_only:
        print("no recipe to run", file=sys.stderr)
        return 2

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda and max(worlds) > torch.cuda.device_count():
        print(f"NCCL needs one GPU per rank; have {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.default_malloc:
        os.environ[DEFAULT_MALLOC_ENV] = "1"  # read by every rank; set before any starts
    if args.launcher == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)

    machine = machine_info(backend)
    configs = {size: BenchConfig.for_params(size) for size in sizes}
    scratch = tempfile.TemporaryDirectory(prefix="fsdp-bench-")
    sources: dict[int, str] = {}
    if any(r.needs_source for r in recipes):
        for size, cfg in configs.items():
            # Written once, read by rank 0 of each load measurement: initializing a large model
            # again in every measurement would cost more than the measurements themselves.
            sources[size] = os.path.join(scratch.name, f"source-{size}.pt")
            torch.save(make_source(cfg, args.seed), sources[size])
    checkpoints: dict[int, str] = {}
    dcps: dict[int, str] = {}
    want_file = any(r.needs_checkpoint for r in recipes)
    want_dcp = any(r.needs_dcp for r in recipes)
    if want_file or want_dcp:
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        # Every rank of a checkpoint job reads these itself (a shared filesystem): a
        # .safetensors file and a DCP folder of the same weights, written by this process.
        written: list[tuple[str, BenchConfig, int | None]] = [
            (WARMUP_CHECKPOINT, WARMUP, None),
            *((f"checkpoint-{n}.safetensors", c, n) for n, c in configs.items()),
        ]
        for name, cfg, measured in written:
            weights = make_source(cfg, args.seed)
            path = os.path.join(scratch.name, name)
            folder = path.removesuffix(".safetensors") + ".dcp"  # warmup.dcp: WARMUP_DCP
            if want_file:
                save_file(weights, path)
            if want_dcp:
                dcp.save(weights, checkpoint_id=folder, no_dist=True)
            if measured is not None:
                checkpoints[measured], dcps[measured] = path, folder
            del weights
    if sources or want_file or want_dcp:
        # Written back now, not by the kernel during the first measurements: the first slot of
        # a run (always the first recipe's) paid for that writeback
        # (benchmarks/results/measurement_order/).
        os.sync()
    labels = {size: label for size, label in zip(sizes, sizes_text.split(","), strict=True)}
    order = _plan(recipes, sizes, worlds, repeats) if recipes else []
    units_order = [] if args.no_units else _units_plan(args, repeats)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    progress = Progress(len(order) + len(units_order), quiet=args.quiet)
    for index, (repeat, size, world, recipe) in enumerate(order):
        cfg = configs[size]
        label = f"{recipe.name} {labels[size].strip()} w{world}"
        progress.start(label)
        record: dict[str, Any] = {
            "recipe": recipe.name,
            "family": recipe.family,
            "job": recipe.job,
            "description": recipe.description,
            "per_unit": recipe.per_unit,
            "bucket_bytes": recipe.bucket_bytes,
            "deterministic": recipe.deterministic,
            "size": labels[size].strip(),
            "params": cfg.params,
            "model_bytes": model_bytes(cfg),
            "largest_unit_bytes": largest_unit_bytes(cfg),
            "config": asdict(cfg),
            "world_size": world,
            "repeat": repeat,
            "order": index,
            "backend": backend,
        }
        launched = time.perf_counter()
        try:
            ranks = launch(
                measure,
                world,
                recipe.name,
                cfg,
                args.seed,
                repeat == 0,
                not args.no_warmup,
                sources.get(size) if recipe.needs_source else None,
                checkpoints.get(size) if recipe.needs_checkpoint else None,
                dcps.get(size) if recipe.needs_dcp else None,
                timeout=args.timeout,
                backend=backend,
                method=args.launcher,
            )
            record.update(
                seconds=max(r["seconds"] for r in ranks),
                peak_bytes=max(r["peak_bytes"] for r in ranks),
                peak_bytes_nonzero_ranks=max((r["peak_bytes"] for r in ranks[1:]), default=None),
                peak_anon_bytes=_max_known(r.get("peak_anon_bytes") for r in ranks),
                peak_file_bytes=_max_known(r.get("peak_file_bytes") for r in ranks),
                comm_bytes=ranks[0]["comm_bytes"],
                weight_comm_bytes=max(
                    (r["weight_comm_bytes"] for r in ranks if r["weight_comm_bytes"] is not None),
                    default=None,
                ),
                bucket_bytes=ranks[0]["bucket_bytes"] or recipe.bucket_bytes,
                checksum=ranks[0]["checksum"],
                ranks=ranks,
                error=None,
            )
            record["wall_seconds"] = time.perf_counter() - launched
            record["warnings"] = sorted({w for r in ranks for w in r.get("warnings", [])})
            log.info("measured", **{k: record[k] for k in ("recipe", "size", "seconds")})
        except Exception as exc:  # a failed recipe is a result too; the others still run
            record.update(
                seconds=None, peak_bytes=None, ranks=[], error=str(exc)[-4000:], warnings=[]
            )
            log.warning("measurement_failed", recipe=recipe.name, size=record["size"], error=exc)
        records.append(record)
        progress.done(label, record["seconds"], record["error"])
    units_records = scaling.run_units(
        units_order,
        lambda fn, world, *a: launch(
            fn, world, *a, timeout=args.timeout, backend=backend, method=args.launcher
        ),
        progress.done,
    )
    progress.close()
    scratch.cleanup()

    machine["loadavg_end"] = _loadavg()
    result = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "torch_version": torch.__version__,
        "settings": {
            "sizes": [labels[s].strip() for s in sizes],
            "world_sizes": worlds,
            "repeats": repeats,
            "seed": args.seed,
            "launcher": args.launcher,
            "warmup": not args.no_warmup,
            "malloc": "glibc default" if args.default_malloc else "mmap threshold fixed at 1 MiB",
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
        "recipes": {
            r.name: {"family": r.family, "job": r.job, "description": r.description}
            for r in recipes
        },
        "notes": notes,
        "records": records,
        "warnings": warning_counts(records, caught),
        "units": {
            "records": units_records,
            "ratios": scaling.ratios(units_records),
            "dim": 32,
            "block": "Linear(d, d) + LayerNorm(d), one wrap unit per block",
        },
    }
    from benchmarks.report import console_summary, render_markdown, render_plot

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.json or args.out / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "bench.md").write_text(render_markdown(result))
    if not args.no_plot:
        if records:
            render_plot(result, args.out / "bench.png")
        if units_records:
            scaling.render_plots(units_records, args.out / "units.png")
    failed = [r for r in records if r["error"]]
    print(console_summary(result))
    print(f"wrote {json_path}, {args.out / 'bench.md'}" + ("" if args.no_plot else ", bench.png"))
    for r in failed:
        print(f"FAILED {r['recipe']} {r['size']} w{r['world_size']}: {r['error'][-300:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
