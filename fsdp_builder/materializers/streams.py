"""Shard-local initialization with world-size-invariant values: block-seeded random streams.

The elements of parameter ``name`` (in row-major order of the full tensor) are cut into blocks
of ``BLOCK``; block ``k`` is drawn by torch's own sampler from a generator seeded with a hash of
``(seed, name, k)`` alone. So any slice of a tensor can be generated without the rest: each rank
draws only the blocks its rows touch (the two cut at its edges in full, into scratch) and still
gets exactly the values the full tensor would have, at any world size and on either backend
(FSDP1 materializes whole units, which are simply all of their blocks). The cost is torch's
sampler on 1/W of the elements plus one generator seeding per block.

``StreamInit`` runs each module's initializer by its model's convention (as ``ResetParameters``
does) with the ``torch.nn.init`` functions PyTorch modules and transformers use answered from
these streams: ``uniform_``, ``normal_``, ``trunc_normal_``, ``constant_``, ``ones_``, ``zeros_``
and the Kaiming and Xavier variants, wherever they are bound (``torch.nn.init``, torch's module
files, transformers' table of the functions it captured at import: ``CAPTURED_TABLES``). Their
bounds and standard deviations come from the full shape (a DTensor's ``shape`` is global), as
eager init computes them. The values are the same distributions as eager init, not the same
numbers: the generators are seeded per block, not once per build.

While a module initializes on shards, ``_ShardWatch`` stops the first operation on a DTensor
that is not element-wise with plain numbers (``ELEMENTWISE_ON_SHARDS``): a tensor method's
random draw, a row view (``weight[padding_idx].zero_()``), ``orthogonal_``, a copy. The module
is then initialized again, with the modules of its unit below it, on whole tensors under the
same seeds and stream draws, and each rank keeps its slice; so no value depends on the world
size, whatever the initializer does.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs
import torch
from attrs import define, frozen
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)
from typing_extensions import override

from fsdp_builder.common.hashing import digest63
from fsdp_builder.common.logs import get_logger
from fsdp_builder.errors import MaterializationError
from fsdp_builder.materializers.conventions import Lineage, lineages
from fsdp_builder.materializers.initializers import (
    MaterializerRun,
    ResetParameters,
    buffers_to_compute,
    check_seed,
    derived_seed,
    run_initializer,
    seed_generators,
)
from fsdp_builder.materializers.sharded import ShardFirstRun, agree_on_seed, fork_devices
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import local_tensor, qualified

log = get_logger(__name__)


# Elements per generator: element ``i`` of a parameter is drawn by generator ``i // BLOCK`` of
# that parameter's stream, seeded from (stream key, block) alone. Changing it changes the values.
BLOCK = 1 << 16


def _block_seed(key: int, block: int) -> int:
    return digest63(f"{key}/{block}")


def _draw_flat(
    key: int,
    out: torch.Tensor,
    start: int,
    total: int,
    draw: Callable[..., object],
    generator: torch.Generator | None = None,
) -> None:
    """Fill ``out`` (1-D, contiguous) with elements ``start .. start + len(out)`` of a tensor of
    ``total`` elements: whole blocks are drawn in place, blocks cut by either end into a
    scratch tensor of the block's full size (so a block's values never depend on the cut).
    ``generator``: one of ``out``'s device to reuse (each block reseeds it), else a new one."""
    stop = start + out.numel()
    if generator is None:
        generator = torch.Generator(device=out.device)
    for block in range(start // BLOCK, (stop - 1) // BLOCK + 1):
        first, last = block * BLOCK, min((block + 1) * BLOCK, total)
        lo, hi = max(first, start), min(last, stop)
        generator.manual_seed(_block_seed(key, block))
        if (lo, hi) == (first, last):
            # A tensor that is one whole block (a small one) is drawn as it is, not sliced.
            draw(out if (lo, hi) == (start, stop) else out[lo - start : hi - start], generator)
        else:
            scratch = torch.empty(last - first, dtype=out.dtype, device=out.device)
            draw(scratch, generator)
            out[lo - start : hi - start].copy_(scratch[lo - first : hi - first])


def global_indices(tensor: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Row-major index in the full tensor of each element this rank holds, shaped like the local
    tensor (a DTensor's local shard; all of a plain tensor); ``rows``: only those rows (first
    dimension) of the local tensor."""
    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        local_shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        device = tensor.to_local().device
    else:
        local_shape, offsets = shape, (0,) * len(shape)
        device = tensor.device
    if rows is not None and shape:
        start, stop, _ = rows.indices(local_shape[0])
        local_shape = (stop - start, *local_shape[1:])
        offsets = (offsets[0] + start, *offsets[1:])
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = local_shape[dim]
        steps = torch.arange(offsets[dim], offsets[dim] + local_shape[dim], device=device)
        index = index + (steps * stride).view(view)
        stride *= shape[dim]
    return index.expand(tuple(local_shape)) if shape else index


class _Streams:
    """The streams of one build: a key per (parameter name, how many times it was drawn), so a
    parameter written twice (an initializer, then a subtree rule) gets fresh bits each time."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.names: dict[int, str] = {}
        self.draws: dict[str, int] = {}
        # One per device for the build: every block reseeds it, so no state carries over.
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        found = self.generators.get(device)
        if found is None:
            found = self.generators[device] = torch.Generator(device=device)
        return found

    def key(self, tensor: torch.Tensor) -> int | None:
        name = self.names.get(id(tensor))
        if name is None:
            return None
        draw = self.draws.get(name, 0)
        self.draws[name] = draw + 1
        return digest63(f"{self.seed}/{name}/{draw}")

    def fill(self, tensor: torch.Tensor, key: int, draw: Callable[..., object]) -> None:
        """Write this rank's part of ``tensor`` from stream ``key``: ``draw(out, generator)``
        fills a 1-D tensor in place with torch's own sampler. A shard that is a run of whole
        rows (FSDP's dim-0 shards, a whole tensor) is drawn in place; any other layout draws
        the run of elements that covers it and keeps its own."""
        local = local_tensor(tensor)
        if not local.numel():
            return
        total = tensor.numel()
        with _unwatched():
            span = _flat_span(tensor)
            generator = self.generator(local.device)
            if span is not None and local.is_contiguous():
                _draw_flat(key, local.view(-1), span, total, draw, generator)
                return
            index = global_indices(tensor)
            low, high = int(index.min()), int(index.max()) + 1
            covering = torch.empty(high - low, dtype=local.dtype, device=local.device)
            _draw_flat(key, covering, low, total, draw, generator)
            local.copy_(covering[index - low])


def _flat_span(tensor: torch.Tensor) -> int | None:
    """Where this rank's part of ``tensor`` starts in the full tensor's row-major order, when
    that part is a run of whole rows (all of a plain tensor, a dim-0 shard); else None."""
    if not isinstance(tensor, DTensor) or not tensor.dim():
        return 0
    mesh = tensor.device_mesh
    coordinate = tuple(mesh.get_coordinate() or ())
    layout = (tuple(tensor.shape), tuple(tensor.placements), tuple(mesh.shape), coordinate)
    if layout not in _SPANS:  # a function of these alone: computed once per layout
        shape = layout[0]
        local_shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, mesh, tensor.placements
        )
        whole_rows = tuple(local_shape[1:]) == shape[1:] and not any(offsets[1:])
        _SPANS[layout] = int(offsets[0]) * math.prod(shape[1:]) if whole_rows else None
    return _SPANS[layout]


_SPANS: dict[tuple[Any, ...], int | None] = {}


class _unwatched:
    """The streams' own work on local shards: without autograd (it writes parameters in
    place) and outside ``_ShardWatch`` (it has nothing to see there, and each operation it
    looks at costs a Python call). A plain context manager that leaves grad mode alone when
    it is already off (initializers run under ``no_grad``): it runs on every draw and constant
    of every module."""

    __slots__ = ("grad", "popped")

    def __enter__(self) -> None:
        self.grad = torch.is_grad_enabled()
        if self.grad:
            torch.set_grad_enabled(False)
        watching = isinstance(_get_current_dispatch_mode(), _ShardWatch)
        self.popped = _pop_mode() if watching else None

    def __exit__(self, *exc: object) -> None:
        if self.popped is not None:
            _push_mode(self.popped)
        if self.grad:
            torch.set_grad_enabled(True)


_Init = Callable[..., Any]


def fan_in_and_fan_out(tensor: torch.Tensor) -> tuple[int, int]:
    """``torch.nn.init._calculate_fan_in_and_fan_out`` from the shape alone: torch's reads
    ``tensor[0][0]``, which on a sharded DTensor is a collective and an op on the shard."""
    shape = tuple(tensor.shape)
    if len(shape) < 2:
        raise ValueError(
            "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"
        )
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _kaiming_std(tensor: torch.Tensor, a: float, mode: str, nonlinearity: str) -> float:
    """The standard deviation Kaiming init asks for, from the full shape (as torch computes it)."""
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = fan_in_and_fan_out(tensor)
    fan = fan_in if mode == "fan_in" else fan_out
    return nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)  # type: ignore[arg-type]


def _streamed(streams: _Streams) -> dict[str, _Init]:
    """Replacements for ``torch.nn.init``'s element-wise initializers: a tensor the build named
    draws from its stream; any other tensor goes to torch's own function."""
    init = nn.init
    original: dict[str, _Init] = {}

    def uniform_(
        tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, generator: Any = None
    ) -> torch.Tensor:
        key = streams.key(tensor)
        if key is None:
            return original["uniform_"](tensor, a, b, generator=generator)
        streams.fill(tensor, key, lambda out, g: out.uniform_(a, b, generator=g))
        return tensor

    def normal_(
        tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None
    ) -> torch.Tensor:
        key = streams.key(tensor)
        if key is None:
            return original["normal_"](tensor, mean, std, generator=generator)
        streams.fill(tensor, key, lambda out, g: out.normal_(mean, std, generator=g))
        return tensor

    def trunc_normal_(
        tensor: torch.Tensor,
        mean: float = 0.0,
        std: float = 1.0,
        a: float = -2.0,
        b: float = 2.0,
        generator: Any = None,
    ) -> torch.Tensor:
        key = streams.key(tensor)
        if key is None:
            return original["trunc_normal_"](tensor, mean, std, a, b, generator=generator)

        def cdf(x: float) -> float:
            return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

        # As torch does it: the inverse CDF of a uniform between the bounds' CDF values.
        low, high = 2 * cdf((a - mean) / std) - 1, 2 * cdf((b - mean) / std) - 1

        def draw(out: torch.Tensor, g: torch.Generator) -> None:
            out.uniform_(low, high, generator=g).erfinv_()
            out.mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b)

        streams.fill(tensor, key, draw)
        return tensor

    def constant_(tensor: torch.Tensor, val: float) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None:
            return original["constant_"](tensor, val)
        with _unwatched():
            local_tensor(tensor).fill_(val)
        return tensor

    def ones_(tensor: torch.Tensor) -> torch.Tensor:
        return constant_(tensor, 1.0)

    def zeros_(tensor: torch.Tensor) -> torch.Tensor:
        return constant_(tensor, 0.0)

    def kaiming_uniform_(
        tensor: torch.Tensor,
        a: float = 0,
        mode: str = "fan_in",
        nonlinearity: str = "leaky_relu",
        generator: Any = None,
    ) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None or 0 in tensor.shape:
            return original["kaiming_uniform_"](tensor, a, mode, nonlinearity, generator)
        bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
        return uniform_(tensor, -bound, bound)

    def kaiming_normal_(
        tensor: torch.Tensor,
        a: float = 0,
        mode: str = "fan_in",
        nonlinearity: str = "leaky_relu",
        generator: Any = None,
    ) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None or 0 in tensor.shape:
            return original["kaiming_normal_"](tensor, a, mode, nonlinearity, generator)
        return normal_(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity))

    def xavier_uniform_(
        tensor: torch.Tensor, gain: float = 1.0, generator: Any = None
    ) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None:
            return original["xavier_uniform_"](tensor, gain, generator)
        fan_in, fan_out = fan_in_and_fan_out(tensor)
        bound = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
        return uniform_(tensor, -bound, bound)

    def xavier_normal_(
        tensor: torch.Tensor, gain: float = 1.0, generator: Any = None
    ) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None:
            return original["xavier_normal_"](tensor, gain, generator)
        fan_in, fan_out = fan_in_and_fan_out(tensor)
        return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)))

    replacements: dict[str, _Init] = {
        "uniform_": uniform_,
        "normal_": normal_,
        "trunc_normal_": trunc_normal_,
        "constant_": constant_,
        "ones_": ones_,
        "zeros_": zeros_,
        "kaiming_uniform_": kaiming_uniform_,
        "kaiming_normal_": kaiming_normal_,
        "xavier_uniform_": xavier_uniform_,
        "xavier_normal_": xavier_normal_,
        "_calculate_fan_in_and_fan_out": fan_in_and_fan_out,
    }
    original.update({name: getattr(init, name) for name in replacements})
    return replacements


STREAMED_INITIALIZERS: tuple[str, ...] = tuple(_streamed(_Streams(0)))


# Where a library keeps torch's initializers it captured at import, by module name: the table
# transformers' own ``init.normal_`` & co. call (``transformers.initialization``).
CAPTURED_TABLES: dict[str, str] = {"transformers.initialization": "TORCH_INIT_FUNCTIONS"}

_Binding = tuple[Any, str, Any]  # (a module or a dict, the name in it, torch's function)


def _bindings() -> list[_Binding]:
    """Where the initializers are bound: ``torch.nn.init`` itself, torch's module files that
    import them by name (``nn.MultiheadAttention`` calls its own ``xavier_uniform_``), and the
    tables of ``CAPTURED_TABLES`` that libraries loaded so far hold."""
    found: list[_Binding] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (
            module_name == "torch.nn.init" or module_name.startswith("torch.nn.modules.")
        ):
            continue
        for name in STREAMED_INITIALIZERS:
            fn = getattr(module, name, None)
            if fn is not None and fn is getattr(nn.init, name):
                found.append((module, name, fn))
    for module_name, table_name in CAPTURED_TABLES.items():
        table = getattr(sys.modules.get(module_name), table_name, None)
        if isinstance(table, dict):
            for name in STREAMED_INITIALIZERS:
                fn = table.get(name)
                if fn is not None and fn is getattr(nn.init, name):
                    found.append((table, name, fn))
    return found


def _bind(target: Any, name: str, fn: Any) -> None:
    if isinstance(target, dict):
        target[name] = fn
    else:
        setattr(target, name, fn)


@contextlib.contextmanager
def streamed_init(streams: _Streams, bindings: list[_Binding] | None = None) -> Iterator[None]:
    """``torch.nn.init``'s initializers answered from ``streams`` inside the block, wherever
    torch binds them; the originals are back when the block ends, however it ends. Not
    thread-safe: another thread initializing meanwhile would draw from the streams too.
    ``bindings``: a build's ``_bindings()``, found once instead of on every unit."""
    replacements = _streamed(streams)
    bindings = _bindings() if bindings is None else bindings
    for target, name, _ in bindings:
        _bind(target, name, replacements[name])
    try:
        yield
    finally:
        for target, name, fn in bindings:
            _bind(target, name, fn)


# Operations on a sharded parameter that touch each element alone, with plain numbers: the
# same on a shard as on the full tensor. Any other operation on a DTensor (a random draw, a row
# or column view, a copy from another tensor, a reduction) could give values that depend on the
# world size, or run a collective: the module is then initialized on whole tensors instead.
_aten = torch.ops.aten
ELEMENTWISE_ON_SHARDS = frozenset(
    {
        _aten.fill_.Scalar,
        _aten.zero_.default,
        _aten.mul_.Scalar,
        _aten.div_.Scalar,
        _aten.add_.Scalar,
        _aten.sub_.Scalar,
        _aten.clamp_.default,
        _aten.clamp_min_.default,
        _aten.clamp_max_.default,
        _aten.neg_.default,
        _aten.detach.default,
        _aten.alias.default,
    }
)


class _ShardOp(Exception):
    """An initializer asked for an operation on a sharded parameter that is not element-wise."""


class _ShardWatch(TorchDispatchMode):
    """Stops, before it runs, the first operation on a DTensor outside ``ELEMENTWISE_ON_SHARDS``
    (the streams write local shards, never DTensors, so their own work is never stopped)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: str | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in ELEMENTWISE_ON_SHARDS and any(
            isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs))
        ):
            self.stopped = self.stopped or str(func)
            raise _ShardOp(str(func))
        return func(*args, **kwargs)


@define
class _Done:
    """A module initialized in the current unit, and the streams' draw counts before it."""

    module: nn.Module
    fqn: str
    lineage: Lineage
    draws: dict[str, int]


@define
class _StreamedInit:
    """``StreamInit``'s part of the shard-first run: a unit's parameters named for their
    streams and ``torch.nn.init`` answered from them while the unit initializes; each module's
    other draws from torch's generator seeded from ``(seed, module name)``. A module whose
    initializer needs more than element-wise work on a shard is initialized again, with the
    modules below it, on whole tensors, of which each rank keeps its slice."""

    seed: int
    env: Environment
    bindings: list[_Binding] = attrs.field(factory=_bindings)
    streams: _Streams = attrs.field(init=False)
    done: list[_Done] = attrs.field(init=False, factory=list)
    # What the build holds from its first unit to close(): torch's generators saved and
    # torch.nn.init answered from the streams. Per unit, both cost more than a small unit's
    # draws; none of the builder's other steps draws random numbers or initializes.
    held: contextlib.ExitStack | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.streams = _Streams(self.seed)

    @contextlib.contextmanager
    def scope(self, unit: Unit, modules: list[nn.Module], names: dict[int, str]) -> Iterator[None]:
        streams = self.streams
        streams.names.clear()
        streams.draws.clear()
        self.done = []
        ignored = self.env.ignored
        for module in modules:
            base = qualified(unit.fqn, names.get(id(module), ""))
            for local_name, param in module._parameters.items():
                if param is not None and not ignored.ignores(param):
                    streams.names.setdefault(id(param), clean_name(qualified(base, local_name)))
        if self.held is None:
            with contextlib.ExitStack() as entering:  # a half-entered pair is undone at once
                entering.enter_context(torch.random.fork_rng(devices=fork_devices(self.env.device)))
                entering.enter_context(streamed_init(streams, self.bindings))
                self.held = entering.pop_all()
        try:
            yield
        finally:
            # Between units nothing is named: torch.nn.init answers as torch does.
            streams.names.clear()
            self.done = []

    def close(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.close()

    def _seeded(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        seed_generators(derived_seed(self.seed, fqn), self.env.device)
        run_initializer(module, fqn, lineage)

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        entry = _Done(module, fqn, lineage, dict(self.streams.draws))
        self.done.append(entry)
        watch = _ShardWatch()
        try:
            with watch:
                self._seeded(module, fqn, lineage)
        except _ShardOp:
            pass
        if watch.stopped is not None:
            self._on_whole_tensors(entry, watch.stopped)

    def _on_whole_tensors(self, entry: _Done, why: str) -> None:
        """Initialize ``entry.module`` and the modules of this unit below it again, children
        first and under the same seeds and stream draws, on whole tensors; keep the slices
        this rank holds. World-size invariant, for one module's whole tensors in memory."""
        below = {id(m) for m in entry.module.modules()}
        again = [d for d in self.done if id(d.module) in below]
        streams = self.streams
        whole: dict[int, torch.Tensor] = {}
        swapped: list[tuple[nn.Module, str, Any, torch.Tensor]] = []
        for d in again:
            for name, param in list(d.module._parameters.items()):
                if not isinstance(param, DTensor):
                    continue
                full = whole.get(id(param))
                if full is None:
                    local = param.to_local()
                    full = nn.Parameter(
                        torch.empty(param.shape, dtype=local.dtype, device=local.device),
                        requires_grad=param.requires_grad,
                    )
                    whole[id(param)] = full
                    key = streams.names.get(id(param))
                    if key is not None:
                        streams.names[id(full)] = key
                        streams.draws[key] = again[0].draws.get(key, 0)
                d.module._parameters[name] = full
                swapped.append((d.module, name, param, full))
        log.debug("stream_init_whole_tensors", module=entry.fqn, operation=why)
        try:
            watch = _ShardWatch()
            try:
                with watch:
                    for d in again:
                        self._seeded(d.module, d.fqn, d.lineage)
            except _ShardOp:
                pass
            if watch.stopped is not None:
                raise MaterializationError(
                    f"`StreamInit` initialized '{entry.fqn or '<root>'}' on whole tensors "
                    f"(its initializer runs {why} on a shard), but it still runs "
                    f"{watch.stopped} on a sharded parameter it does not own. Use "
                    "DeterministicInit(seed) for this model."
                )
        finally:
            for module, name, param, full in swapped:
                module._parameters[name] = param
                # Named by id: once the whole tensor is freed, a new tensor may get its id.
                streams.names.pop(id(full), None)
        for _, _, param, full in swapped:
            local_tensor(param).copy_(full[_local_slices(param)])


def _local_slices(tensor: DTensor) -> tuple[slice, ...]:
    """The slices of the full tensor that this rank's shard of ``tensor`` holds."""
    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


@frozen
class StreamInit(ResetParameters):
    """Each module's initializer by its model's convention (``reset_parameters()``, a
    transformers model's ``_init_weights``, a registered one), with ``torch.nn.init``'s
    element-wise initializers drawn by torch's samplers from one generator per block of
    ``BLOCK`` elements, seeded from ``(seed, parameter name, block)``: with
    ``FullyShardBuilder`` every rank allocates and fills only its shards (shard-first), and the
    full weights are bit-identical at any world size, and between both backends.

    The distributions are those of eager init (same bounds and standard deviations, from the
    full shapes); the numbers are not those of one generator seeded once. What an initializer
    draws from torch's generator itself comes from a generator seeded from ``(seed, module
    name)``. A module whose
    initializer does more to a sharded parameter than element-wise work with plain numbers (a
    tensor method's random draw, ``weight[padding_idx].zero_()``, ``orthogonal_``, ``eye_``,
    a copy from another tensor) is initialized again, with the modules of its unit below it, on
    whole tensors under the same seeds, and each rank keeps its slice: still world-size
    invariant, for that module's whole tensors in memory while it initializes.

    ``seed=None`` (the default) takes ``torch.initial_seed()`` of the first rank (shared in
    ``prepare``): ``torch.manual_seed(s)`` before the build changes the weights, as it does
    for an eager model. Torch's generators are saved at the first unit and restored when the
    build ends (the caller's random stream continues as if the build drew nothing); in
    between, a synchronizer of one's own that draws random numbers draws from the state the
    last initialized module left, the same on every rank.

    ``FullyShardBuilder``'s default materializer.

    Cost: torch's sampler on 1/W of the elements (the two blocks cut by a shard's edges drawn in
    full), one generator seeding per block, and a little per module (its generator seeded, its
    operations watched).

    Raises:
        ConfigurationError: ``seed`` is not an int in ``[0, 2**63)``.
        MaterializationError: in the configure stage, naming modules on meta without an
            initializer; during the build, an initializer that fails on whole tensors too.

    Example:
        ```python
        FullyShardBuilder().wrap(Block).materialize(StreamInit(seed=0)).build(model)
        ```
    """

    seed: int | None = attrs.field(default=None, validator=attrs.validators.optional(check_seed))
    communicates: ClassVar[bool] = False  # only prepare() communicates
    shard_first: ClassVar[bool] = True

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Share the base seed over the build's groups (collective)."""
        model = env.plan.root.module
        computed = buffers_to_compute(model, env.ignored)
        return ShardFirstRun(
            env,
            computed,
            lineages(model),
            _StreamedInit(agree_on_seed(env, self.seed), env),
            "StreamInit",
            "Fix its initializer, or use DeterministicInit(seed) for this model.",
        )


__all__ = [
    "CAPTURED_TABLES",
    "ELEMENTWISE_ON_SHARDS",
    "STREAMED_INITIALIZERS",
    "StreamInit",
    "fan_in_and_fan_out",
    "global_indices",
    "streamed_init",
]
