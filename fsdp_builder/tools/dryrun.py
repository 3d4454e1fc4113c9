"""A dry run of the real build at the job's world size, one simulated rank at a time, in one
process and without the memory of the model: the builder's own ``build(model)`` on torch's fake
process group, with ``FakeTensor`` storage and safetensors reads recorded from the files'
headers. What it checks and what it cannot: docs/before_you_launch.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_builder.builder import ShardingBuilder
from fsdp_builder.config import _STRATEGY_ALIASES
from fsdp_builder.devices import ExplicitDevice
from fsdp_builder.errors import ConfigurationError, config_error
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.planning.plan import UnitPlan
from fsdp_builder.sources.base import CheckpointSource, Index, TensorMeta
from fsdp_builder.sources.hf_safetensors import SafetensorsSource
from fsdp_builder.sources.registry import wrapping_sources

# What a rank reports when its build needed a value that only other ranks would have sent.
NOT_SIMULATED = "not simulated"

# torch's process groups hold the world size and ranks as C ints.
MAX_WORLD_SIZE = 2**31 - 1

# ShardingStrategy -> its name on the command line (both hybrid strategies: "hybrid").
_STRATEGY_NAMES = {s: name.removesuffix("_zero2") for name, s in _STRATEGY_ALIASES.items()}

# In-place fills whose result a FakeTensor cannot hold anyway: answered without dispatch (the
# block-seeded initializers call them once per 64 Ki elements).
_FILLS = frozenset({"normal_", "uniform_", "fill_", "zero_", "bernoulli_", "exponential_"})

# Allocations a real build does not hold until written (their pages are never touched): FSDP1
# makes its unsharded flat buffers this way and frees them by resizing their storage.
_UNWRITTEN = frozenset(
    {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.new_empty}
    | {torch.ops.aten.new_empty_strided, torch.ops.aten.empty_like}
)


@frozen
class Shard:
    """One parameter (or FSDP1 flat parameter) as this rank holds it after the build."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize


@frozen
class Read:
    """One read of a checkpoint tensor: ``rows`` (first, stop) when it takes a run of whole
    rows (a whole tensor: all of them; a scalar: (0, 1)), None when it takes part of each row
    or every n-th row."""

    file: str
    key: str
    nbytes: int
    rows: tuple[int, int] | None


@frozen
class RankRun:
    """What the build did, or would have raised, on one simulated rank."""

    rank: int
    backend: str
    seconds: float
    error_type: str | None = None
    error: str | None = None
    plan: UnitPlan | None = None
    strategy: str | None = None
    shard_size: int | None = None
    shards: tuple[Shard, ...] = ()
    buffer_bytes: int = 0
    largest_unit_bytes: int = 0
    build_peak: int | None = None
    reads: tuple[Read, ...] = ()
    # The training step's peak by part (STEP_PARTS; "total": the peak itself), or why none.
    step_peak: dict[str, int] | None = None
    step_note: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @property
    def param_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def read_bytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


@frozen
class DryRun:
    """A dry run's simulated ranks, in the order asked."""

    world_size: int
    backend: str
    runs: tuple[RankRun, ...]
    seconds: float

    @property
    def read_balance(self) -> float | None:
        """Max over mean of the bytes each simulated rank reads (1.0: even); None: no reads."""
        sizes = [r.read_bytes for r in self.runs if r.ok]
        if not any(sizes):
            return None
        return max(sizes) / (sum(sizes) / len(sizes))


class _NoStorage(TorchDispatchMode):
    """Floating-point tensors made from nothing (factories, copies off meta) become FakeTensors;
    everything else (the agreements' integers, tensors with data) runs as usual. The bytes of
    the storages alive at once are counted from their first write (``peak``): the pages the
    real build would hold."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.live = self.peak = 0
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        made = self._run(func, args, kwargs or {})
        if not (func.is_view or func.overloadpacket in _UNWRITTEN):
            for t in pytree.tree_leaves(made):
                # Real ones too: integers the build computes (an index of a shard's elements).
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._count(t.untyped_storage())
        return made

    def written(self, tensor: torch.Tensor) -> None:
        """``tensor`` written by something no op shows (a recorded read): its storage's bytes
        are held from now, whether or not it was allocated unwritten."""
        if tensor.device.type != "meta":
            self._count(tensor.untyped_storage())

    def _count(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if not nbytes or storage in self._storages:
            # An empty storage holds no pages (FSDP2 makes one per rank past a parameter's
            # last rows, thousands at large world sizes): counted once written, if ever.
            return
        self._storages[storage] = None
        self._sizes[id(storage)] = nbytes
        self.live += nbytes
        weakref.finalize(storage, self._free, id(storage))
        if self.live > self.peak:
            # Sizes as they are now: torch frees some storages by resizing them to 0 (FSDP1's
            # unsharded flat parameter once sharded), which no dispatched op shows. Only a
            # new high is checked, and only the storages that hold bytes.
            self._resized()
            self.peak = max(self.peak, self.live)

    def _resized(self) -> None:
        for s in self._storages:
            key = id(s)
            now, was = s.nbytes(), self._sizes[key]
            if now != was:
                self._sizes[key] = now
                self.live += now - was

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            first = args[0] if args else None
            if isinstance(first, FakeTensor):
                if func.overloadpacket.__name__ in _FILLS:
                    return first
                if func is torch.ops.aten._local_scalar_dense.default:
                    # Value checks (NaN counts, checksums) see zeros: nothing to report.
                    return 0.0 if first.dtype.is_floating_point else 0
            return func(*args, **kwargs)
        device = kwargs.get("device")
        to_meta = device is None or torch.device(device).type == "meta"
        if tensors and to_meta:
            # No other device asked: real stays real (the agreements), meta stays meta (FSDP2
            # cuts meta parameters rank by rank); faking either would only cost time.
            return func(*args, **kwargs)
        if all(t.is_meta for t in tensors):
            with self.fake:
                made = func(*args, **kwargs)
            outs = [t for t in pytree.tree_leaves(made) if isinstance(t, torch.Tensor)]
            if outs and all(
                isinstance(t, FakeTensor)
                and t.device.type != "meta"
                and (t.dtype.is_floating_point or t.dtype.is_complex)
                for t in outs
            ):
                return made
        return func(*args, **kwargs)


def _read_of(path: Path, key: str, index: Index | None, meta: TensorMeta) -> Read:
    """The read of ``key[index]``, whose shape and dtype the source reads as ``meta`` (a packed
    dtype as torch holds it, FP4 two to a byte)."""
    shape, dtype = meta.shape, meta.dtype
    spans = [range(n)[s] for s, n in zip(index or (), shape, strict=False)]
    kept = [len(r) for r in spans] + list(shape[len(spans) :])
    nbytes = math.prod(kept) * dtype.itemsize
    if not spans:
        return Read(path.name, key, nbytes, (0, shape[0] if shape else 1))
    first, rest = spans[0], zip(spans[1:], shape[1:], strict=False)
    if (first.step == 1 or len(first) < 2) and all(len(r) == n for r, n in rest):
        return Read(path.name, key, nbytes, (first.start, first.start + len(first)))
    return Read(path.name, key, nbytes, None)


@contextlib.contextmanager
def _recorded_reads(reads: list[Read], mode: _NoStorage) -> Iterator[None]:
    """Safetensors sources opened in this context are read through a source that records each
    read (file, tensor, the rows it takes) and makes none; sources of other formats read as
    usual. The read's destination counts as written, as the real read writes it: its pages are
    held from then."""
    class Recorded:
        """A safetensors source's listing, its reads recorded instead of made."""

        def __init__(self, source: SafetensorsSource) -> None:
            self.describe = source.describe
            self.tensors = source.tensors
            self.close = source.close
            self.file_of = source.file_of

        def read(self, key: str, index: Index | None = None) -> torch.Tensor:
            meta = self.tensors()[key]
            part = torch.empty(meta.shape, dtype=meta.dtype, device="meta")[index or ()]
            made = part.new_empty(part.shape, device="cpu")
            self.read_into(key, index, made)
            return made

        def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
            reads.append(_read_of(self.file_of(key), key, index, self.tensors()[key]))
            mode.written(out)

    def wrap(source: CheckpointSource) -> CheckpointSource:
        return Recorded(source) if isinstance(source, SafetensorsSource) else source

    with wrapping_sources(wrap):
        yield


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, local_world_size: int | None = None) -> Iterator[None]:
    """torch's fake process group as the default group, for one simulated ``rank``; with
    ``local_world_size``, torchrun's variables (``RANK``, ``LOCAL_RANK``...) set while it lasts."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in names}
    if local_world_size is not None:
        values = (rank, world_size, rank % local_world_size, local_world_size)
        os.environ.update({k: str(v) for k, v in zip(names, values, strict=True)})
    dist.init_process_group("fake", rank=rank, world_size=world_size)  # torch makes its store
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def local_shards(module: nn.Module) -> list[Shard]:
    """Each parameter as this rank holds it: FSDP1's flat parameters (with their padding),
    FSDP2's DTensor local shards, and plain parameters (ignored ones) whole."""
    out: list[Shard] = []
    seen: set[int] = set()
    for fqn, m in module.named_modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FullyShardedDataParallel) else None
        if handle is None:
            continue
        flat = handle.flat_param
        seen.add(id(flat))
        seen.update(id(p) for p in getattr(flat, "_params", None) or ())
        unit = clean_name(fqn) or "<root>"
        full = (int(flat._unpadded_unsharded_size.numel()),)
        out.append(Shard(f"{unit} (flat)", full, tuple(flat.shape), flat.dtype))
    for name, p in module.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        out.append(Shard(name, tuple(p.shape), tuple(local.shape), p.dtype))
    return out


def on_cpu(builder: ShardingBuilder) -> ShardingBuilder:
    """An unbuilt copy of ``builder`` computing on the CPU: the one setting a dry run replaces
    (the job's CUDA devices do not exist here; nothing is computed on them during a build
    anyway). A copy, because a factory may return one builder made once at import, as a real job
    may (each of its processes builds once), while the dry run builds once per simulated rank;
    and the caller's builder is left as it was."""
    if not isinstance(builder, ShardingBuilder):
        raise config_error(
            "simulate", "builder_factory", f"it returned {type(builder).__name__}",
            "Return the job's configured builder, e.g. FullyShardBuilder().wrap(Block)",
        )  # fmt: skip
    fresh = copy.copy(builder)  # the configuration is frozen: sharing it is safe
    fresh._result = None
    fresh._config = attrs.evolve(builder._config, device=ExplicitDevice("cpu"))
    return fresh


def simulate_rank(
    builder_factory: Callable[[], ShardingBuilder],
    model_factory: Callable[[], nn.Module],
    world_size: int,
    rank: int,
    on_meta: bool = True,
    local_world_size: int | None = None,
    step: Callable[[nn.Module], torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
) -> RankRun:
    """One simulated rank of the real build (see the module docstring)."""
    reads: list[Read] = []
    started = time.perf_counter()
    with fake_world(world_size, rank, local_world_size):
        try:
            # The job's script raises what these raise before its build: so does the dry run.
            builder = on_cpu(builder_factory())
            with torch.device("meta") if on_meta else contextlib.nullcontext():
                model = model_factory()
        except Exception as exc:
            return RankRun(rank, "?", time.perf_counter() - started, type(exc).__name__, str(exc))
        error: BaseException | None = None
        with warnings.catch_warnings():
            # The NaN checks and page accounting touch the FakeTensors' (absent) data.
            warnings.filterwarnings("ignore", message=".*FakeTensor.*")
            with (mode := _NoStorage()), _recorded_reads(reads, mode):
                try:
                    built = builder.build(model)
                except Exception as exc:
                    error = exc
        seconds = time.perf_counter() - started
        backend = builder._backend().name
        if error is not None:
            try:
                plan: UnitPlan | None = builder.plan_for(model)
            except Exception:  # the plan is what failed: the error says why
                plan = None
            kind, text = type(error).__name__, str(error)
            if "do not form a grid" in text:
                kind = NOT_SIMULATED
                text = (
                    "the build checks that its hybrid groups form a grid by gathering every "
                    "rank's shard group, which a fake process group cannot answer; pass a "
                    "DeviceMesh to .groups(...) to simulate a hybrid build"
                )
            return RankRun(rank, backend, seconds, kind, text, plan, reads=tuple(reads))
        env = builder.environment
        step_peak, step_note = (
            _step_peak(built, step, mode, optimizer) if step else (None, None)
        )
        return RankRun(
            rank,
            backend,
            time.perf_counter() - started,  # the step included
            plan=env.plan,
            strategy=_STRATEGY_NAMES.get(env.strategy, "full"),
            shard_size=env.groups.world_size,
            shards=tuple(local_shards(built)),
            buffer_bytes=sum(u.buffer_bytes for u in env.plan),
            largest_unit_bytes=env.plan.largest_unit_bytes,
            build_peak=mode.peak,
            reads=tuple(reads),
            step_peak=step_peak,
            step_note=step_note,
        )


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

# The step's optimizers by the command line's names (lr is irrelevant to memory); "none": the
# step ends at backward.
OPTIMIZERS: dict[str, OptimizerFactory | None] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "none": None,
}

# torch's trackers' categories -> the parts the dry run reports. FSDPMemTracker (FSDP2) tells
# gathered parameters and communication buffers apart; MemTracker (any model, so FSDP1) counts
# FSDP1's gathered flat parameters as parameters.
STEP_PARTS = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Unsharded Param": "gathered parameters",
    "All Gather": "communication buffers",
    "Reduce Scatter": "communication buffers",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer state",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers",
    "Inputs": "other",
    "Other": "other",
    "Total": "total",
}


def _step_peak(
    model: nn.Module,
    step: Callable[[nn.Module], torch.Tensor],
    mode: _NoStorage,
    optimizer: OptimizerFactory | None,
) -> tuple[dict[str, int] | None, str | None]:
    """torch's memory tracker over two training steps (``step(model).backward()``, then the
    optimizer's step) on the built model's FakeTensors; the peak of the second, which holds the
    optimizer states too. ``FSDPMemTracker`` for fully_shard models, ``MemTracker`` else."""
    from torch.distributed.fsdp import FSDPModule

    try:
        # torch's trackers are private modules: a torch without them reports why, beside a
        # good build.
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker

        with mode.fake, warnings.catch_warnings():
            # FSDP1 reads FakeTensors' (absent) data pointers; the module tracker warns when
            # activation checkpointing re-enters a module, which the totals do not depend on.
            warnings.filterwarnings("ignore", message=".*FakeTensor.*")
            warnings.filterwarnings("ignore", message=".*module hierarchy tracking.*")
            optim = optimizer(model.parameters()) if optimizer is not None else None
            tracker: MemTracker
            # FSDP2's lazy init (at the first forward) gives a padded shard new storage, which
            # the tracker would file under activations on the ranks whose shards are padded:
            # done before it starts, so symmetric ranks report the same parts.
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.unshard()
                    m.reshard()
            if isinstance(model, FSDPModule):
                tracker = FSDPMemTracker(model, optim)
            else:
                tracker = MemTracker()
                tracker.track_external(model, *([optim] if optim is not None else []))
            with tracker:
                for first in (True, False):
                    step(model).backward()
                    if optim is not None:
                        optim.step()
                        optim.zero_grad()
                    else:
                        model.zero_grad()
                    if first:
                        tracker.reset_mod_stats()
    except Exception as exc:  # the step, not the build: reported beside a good build
        return None, f"{type(exc).__name__}: {exc}"
    parts: dict[str, int] = {}
    # One device in a dry run (the CPU); summed should a tracker list more.
    for peak in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in peak.items():
            name = STEP_PARTS.get(getattr(kind, "value", str(kind)), "other")
            parts[name] = parts.get(name, 0) + int(nbytes)
    return parts, None


def simulate(
    builder_factory: Callable[[], ShardingBuilder],
    model_factory: Callable[[], nn.Module],
    world_size: int,
    ranks: Sequence[int] = (0,),
    *,
    on_meta: bool = True,
    local_world_size: int | None = None,
    step: Callable[[nn.Module], torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
) -> DryRun:
    """Run the real ``builder_factory().build(model_factory())`` as each of ``ranks`` of a world
    of ``world_size``, on torch's fake process group and without storage for model states.

    ``builder_factory`` is called once per rank with the fake group initialized (it may create
    groups or a DeviceMesh); ``model_factory`` under ``torch.device("meta")`` unless ``on_meta``
    is False. ``local_world_size``: ranks per node, set in the environment as torchrun sets it;
    None leaves the environment as it is. ``step``: a function of the built model returning a
    loss (called on FakeTensors, so it makes its inputs itself) for the training step's peak,
    with ``optimizer`` (a function of the parameters; None: no optimizer step). A rank whose
    build raises reports the error instead of results; nothing is raised for it.

    Raises:
        ConfigurationError: a factory not callable, ``world_size`` or ``ranks`` invalid, or a
            process group already initialized in this process.
    """
    for argument, factory, what in (
        ("builder_factory", builder_factory, "the job's configured builder"),
        ("model_factory", model_factory, "the job's model"),
    ):
        if not callable(factory):
            raise config_error(
                "simulate", argument,
                f"expected a function returning {what}, got {type(factory).__name__} "
                f"{factory!r:.80}",
                "Pass the function itself (e.g. lambda: FullyShardBuilder().wrap(Block)), "
                "which the dry run calls once per simulated rank",
            )  # fmt: skip
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise config_error(
            "simulate", "world_size", f"expected a whole number of 1 or more, got {world_size!r}",
            "Pass the job's world size, e.g. simulate(..., world_size=1024)",
        )  # fmt: skip
    if world_size > MAX_WORLD_SIZE:
        raise config_error(
            "simulate", "world_size",
            f"{world_size:,} is more ranks than torch's process groups support (at most "
            f"{MAX_WORLD_SIZE:,}: world sizes and ranks are 32-bit integers)",
            "Pass the job's world size",
        )  # fmt: skip
    chosen = list(ranks)
    bad = [
        r
        for r in chosen
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size
    ]
    if bad or not chosen:
        raise config_error(
            "simulate", "ranks",
            f"{bad or 'no ranks'}: not ranks of a world of {world_size}",
            f"Pass ranks from 0 to {world_size - 1}",
        )  # fmt: skip
    if dist.is_initialized():
        raise ConfigurationError(
            "`simulate` needs the default process group for its fake one, but one is already "
            "initialized. Run the dry run in a process of its own (`fsdp-builder plan ... "
            "--simulate N`), or call dist.destroy_process_group() first."
        )
    started = time.perf_counter()
    one = functools.partial(simulate_rank, builder_factory, model_factory, world_size)
    runs = tuple(one(r, on_meta, local_world_size, step, optimizer) for r in chosen)
    return DryRun(world_size, runs[0].backend, runs, time.perf_counter() - started)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f}"


def format_dry_run(run: DryRun, shards: int = 0) -> str:
    """A report for people; ``shards``: how many of each rank's shards and reads to list."""
    lines = [
        f"dry run of the {run.backend} build at world size {run.world_size} ({run.seconds:.2f} s)"
    ]
    plan = next((r.plan for r in run.runs if r.plan is not None), None)
    if plan is not None:
        lines += ["", plan.format(), ""]
    for r in run.runs:
        head = f"rank {r.rank} ({r.seconds:.2f} s): "
        if not r.ok:
            lines.append(head + f"the build raises {r.error_type}: {r.error}")
            continue
        lines.append(
            head + f"strategy {r.strategy}, shard group of {r.shard_size}; parameters "
            f"{_mib(r.param_bytes)} MiB in {len(r.shards)} shard(s), buffers "
            f"{_mib(r.buffer_bytes)} MiB, largest unit in full {_mib(r.largest_unit_bytes)} MiB, "
            f"build peak {_mib(r.build_peak)} MiB"
        )
        if r.step_peak is not None:
            parts = ", ".join(
                f"{k} {_mib(v)}" for k, v in r.step_peak.items() if v and k != "total"
            )
            lines.append(
                f"    training step peak {_mib(r.step_peak.get('total'))} MiB: {parts}"
            )
        elif r.step_note:
            lines.append(f"    training step not simulated: {r.step_note}")
        for s in r.shards[:shards]:
            lines.append(
                f"    {s.name:<48} {list(s.global_shape)} -> {list(s.local_shape)} {s.dtype}"
            )
        if r.reads:
            files = sorted({x.file for x in r.reads})
            lines.append(
                f"    reads {_mib(r.read_bytes)} MiB in {len(r.reads)} read(s) "
                f"from {len(files)} file(s)"
            )
            for x in r.reads[:shards]:
                where = "strided" if x.rows is None else f"rows {x.rows[0]}:{x.rows[1]}"
                lines.append(f"    {x.file}: {x.key} {where} ({x.nbytes} B)")
    balance = run.read_balance
    if balance is not None:
        lines.append(f"read balance over the simulated ranks (max/mean): {balance:.3f}")
    return "\n".join(lines)


def as_dict(run: DryRun) -> dict[str, Any]:
    """The dry run as JSON-ready data (dtypes as their names; the unit plan left out)."""
    ranks = [
        attrs.asdict(
            r,
            filter=lambda a, _: a.name != "plan",
            value_serializer=lambda _, __, v: str(v) if isinstance(v, torch.dtype) else v,
        )
        | {"param_bytes": r.param_bytes, "read_bytes": r.read_bytes}
        for r in run.runs
    ]
    head = {"world_size": run.world_size, "backend": run.backend, "seconds": run.seconds}
    return head | {"read_balance": run.read_balance, "ranks": ranks}


__all__ = [
    "as_dict",
    "NOT_SIMULATED",
    "OPTIMIZERS",
    "STEP_PARTS",
    "DryRun",
    "RankRun",
    "Read",
    "Shard",
    "fake_world",
    "format_dry_run",
    "local_shards",
    "on_cpu",
    "simulate",
    "simulate_rank",
]
