"""Shard-local initialization with world-size-invariant values: block-seeded random streams.

Block ``k`` of a parameter's row-major elements is drawn from a generator seeded by
``(seed, name, k)`` alone, so a rank draws only the blocks its rows touch and gets exactly the
full tensor's values. ``torch.nn.init`` calls are answered by a ``TorchFunctionMode`` (this
thread only, nothing patched); a module doing more than element-wise work on a shard
(``_ShardWatch``) is initialized again on whole tensors, keeping each rank's slice.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, ClassVar

import attrs
import torch
from attrs import define, frozen
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from typing_extensions import override

from fsdp_builder.common.hashing import digest63
from fsdp_builder.common.logs import get_logger
from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.materializers.conventions import Lineage, lineages
from fsdp_builder.materializers.initializers import (
    MaterializerRun,
    PrivateDraws,
    ResetParameters,
    buffers_to_compute,
    check_seed,
    derived_seed,
    run_initializer,
    seed_generators,
)
from fsdp_builder.materializers.sharded import (
    ShardFirstRun,
    agree_on_seed,
    fork_devices,
    runs_torch_whole_only,
)
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.shards import local_box, local_slices
from fsdp_builder.runtime.tree import local_tensor

log = get_logger(__name__)


# Elements per generator. Changing it changes the values.
BLOCK = 1 << 16


def _draw_flat(
    key: int,
    out: torch.Tensor,
    start: int,
    total: int,
    draw: Callable[..., object],
    generator: torch.Generator | None = None,
) -> None:
    """Fill 1-D contiguous ``out`` with elements ``start ..`` of a ``total``-element tensor;
    blocks cut by either end are drawn whole into scratch, so values never depend on the cut."""
    stop = start + out.numel()
    if generator is None:
        generator = torch.Generator(device=out.device)
    for block in range(start // BLOCK, (stop - 1) // BLOCK + 1):
        first, last = block * BLOCK, min((block + 1) * BLOCK, total)
        lo, hi = max(first, start), min(last, stop)
        generator.manual_seed(digest63(f"{key}/{block}"))
        if (lo, hi) == (first, last):
            # A tensor that is one whole block (a small one) is drawn as it is, not sliced.
            draw(out if (lo, hi) == (start, stop) else out[lo - start : hi - start], generator)
        else:
            scratch = torch.empty(last - first, dtype=out.dtype, device=out.device)
            draw(scratch, generator)
            out[lo - start : hi - start].copy_(scratch[lo - first : hi - first])


def global_indices(tensor: torch.Tensor) -> torch.Tensor:
    """Row-major full-tensor index of each local element, shaped like the local tensor."""
    shape = tuple(tensor.shape)
    local_shape, offsets = (
        local_box(tensor) if isinstance(tensor, DTensor) else (shape, (0,) * len(shape))
    )
    device = local_tensor(tensor).device
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = local_shape[dim]
        steps = torch.arange(offsets[dim], offsets[dim] + local_shape[dim], device=device)
        index = index + (steps * stride).view(view)
        stride *= shape[dim]
    return index.expand(tuple(local_shape)) if shape else index


_Draw = Callable[[torch.Tensor, torch.Generator], object]


@define
class _Streams:
    """A build's streams, keyed per (name, draw count): a second write gets fresh bits."""

    seed: int
    names: dict[int, str] = attrs.field(factory=dict)
    draws: dict[str, int] = attrs.field(factory=dict)
    generators: dict[torch.device, torch.Generator] = attrs.field(factory=dict)

    def draw(self, tensor: torch.Tensor, draw: _Draw) -> torch.Tensor:
        """Write this rank's part of ``tensor`` from its next key; ``draw(out, g)`` fills 1-D
        ``out`` in place. Layouts other than whole rows draw the covering run and keep theirs."""
        name = self.names[id(tensor)]
        count = self.draws.get(name, 0)
        self.draws[name] = count + 1
        key = digest63(f"{self.seed}/{name}/{count}")
        local = local_tensor(tensor)
        if not local.numel():
            return tensor
        total = tensor.numel()
        with _unwatched():
            span = _flat_span(tensor)
            generator = self.generators.get(local.device)
            if generator is None:
                generator = self.generators[local.device] = torch.Generator(device=local.device)
            if span is not None and local.is_contiguous():
                _draw_flat(key, local.view(-1), span, total, draw, generator)
                return tensor
            index = global_indices(tensor)
            low, high = int(index.min()), int(index.max()) + 1
            covering = torch.empty(high - low, dtype=local.dtype, device=local.device)
            _draw_flat(key, covering, low, total, draw, generator)
            local.copy_(covering[index - low])
        return tensor


def _flat_span(tensor: torch.Tensor) -> int | None:
    """Row-major start of this rank's part when it is a run of whole rows; else None."""
    if not isinstance(tensor, DTensor) or not tensor.dim():
        return 0
    shape = tuple(tensor.shape)
    local_shape, offsets = local_box(tensor)
    whole_rows = tuple(local_shape[1:]) == shape[1:] and not any(offsets[1:])
    return int(offsets[0]) * math.prod(shape[1:]) if whole_rows else None


class _unwatched:
    """The streams' own work: no autograd, outside ``_ShardWatch`` (a Python call per op). A
    plain class, not contextmanager: it runs on every draw of every module."""

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


_Answer = Callable[[_Streams, Any, torch.Tensor, Any, Any], Any]


def _truncated(mean: float, std: float, a: float, b: float) -> _Draw:
    """A normal truncated to ``[a, b]`` by inverse CDF: one draw per element, none rejected."""

    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    low, high = 2 * cdf((a - mean) / std) - 1, 2 * cdf((b - mean) / std) - 1

    def draw(out: torch.Tensor, g: torch.Generator) -> None:
        # In 16 bits the uniforms near +-1 are too coarse for erfinv: bf16 gave nothing beyond
        # 2.9 std. Drawn in float32 and rounded once, like torch's own normal_ in 16 bits; the
        # rounded values stay within torch's bounds (a and b rounded to the dtype).
        wide = out.dtype in _WIDE
        work = out if wide else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        work.uniform_(low, high, generator=g).erfinv_()
        work.mul_(std * math.sqrt(2.0)).add_(mean).clamp_(a, b)
        if work is not out:
            out.copy_(work)

    return draw


_WIDE = (torch.float32, torch.float64)


_TRUNC_NORMAL = nn.init.trunc_normal_.__code__


def _trunc_normal_args(tensor: torch.Tensor) -> tuple[float, float, float, float] | None:
    """``(mean, std, a, b)`` when ``trunc_normal_`` runs on ``tensor`` a few frames up: it has
    no torch function hook of its own."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        if frame.f_code is _TRUNC_NORMAL and frame.f_locals.get("tensor") is tensor:
            found = frame.f_locals
            return found["mean"], found["std"], found["a"], found["b"]
        frame = frame.f_back
    return None


def _args(rest: tuple[Any, ...], kwargs: dict[str, Any], *spec: tuple[str, Any]) -> list[Any]:
    """Arguments after the tensor, by position or keyword, with their defaults."""
    return [rest[i] if i < len(rest) else kwargs.get(k, d) for i, (k, d) in enumerate(spec)]


def _sampler(method: str, *spec: tuple[str, Any]) -> _Answer:
    """Answer ``uniform_``/``normal_`` from the stream (truncated inside ``trunc_normal_``)."""

    def answer(streams: _Streams, func: Any, tensor: torch.Tensor, rest: Any, kw: Any) -> Any:
        truncated = _trunc_normal_args(tensor)
        if truncated is not None:
            # Answered only where the substitution is exact: torch draws ``normal_`` and redraws
            # the values outside [a, b]; ours are all inside, so none is redrawn and the result
            # is the truncated normal. Where it draws ``uniform_`` (bounds keeping <= 30 % of
            # the mass: candidates kept with probability pdf(x) / pdf(mode)), its acceptance
            # test would thin our values again, a wrong distribution (mean 1.40 instead of
            # 1.51 for a=1, b=3). There torch's own sampler runs on the whole tensor (a shard
            # is stopped at its first op on a DTensor and initialized again whole), from the
            # generator seeded by the module's name: the same values at any world size.
            if method != "normal_":
                return None
            return streams.draw(tensor, _truncated(*truncated))
        x, y = _args(rest, kw, *spec)
        return streams.draw(tensor, lambda out, g: getattr(out, method)(x, y, generator=g))

    return answer


def _kaiming_uniform(streams: _Streams, func: Any, tensor: torch.Tensor, rest: Any, kw: Any) -> Any:
    a, mode, nonlinearity = _args(
        rest, kw, ("a", 0), ("mode", "fan_in"), ("nonlinearity", "leaky_relu")
    )
    if 0 in tensor.shape:
        return None  # torch's own warns and returns
    # torch's computation from the full shape (a DTensor's), with public parts only.
    if mode.lower() not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    shape = tuple(tensor.shape)
    if len(shape) < 2:
        raise ValueError(
            "Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"
        )
    fan = shape[1 if mode.lower() == "fan_in" else 0] * math.prod(shape[2:])
    std = nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)
    bound = math.sqrt(3.0) * std  # in torch's order: the bound is bit-equal to its own
    return streams.draw(tensor, lambda out, g: out.uniform_(-bound, bound, generator=g))


def _constant(name: str, default: float | None) -> _Answer:
    """A fill with a number, written to the local shard (no draw)."""

    def answer(streams: _Streams, func: Any, tensor: torch.Tensor, rest: Any, kw: Any) -> Any:
        (value,) = _args(rest, kw, (name, default))
        if not isinstance(value, int | float | bool):
            return None
        with _unwatched():
            local_tensor(tensor).fill_(value)
        return tensor

    return answer


def _bounds_check(streams: _Streams, func: Any, tensor: torch.Tensor, rest: Any, kw: Any) -> Any:
    """``trunc_normal_``'s bounds check on the local shard rather than a reduction over the mesh."""
    if not isinstance(tensor, DTensor) or _trunc_normal_args(tensor) is None:
        return None
    return func(local_tensor(tensor), *rest, **kw)


_T = torch.Tensor
# ``torch.nn.init`` functions with a torch function hook, else the tensor methods others call.
_ANSWERS: dict[Any, _Answer] = {
    nn.init.uniform_: _sampler("uniform_", ("a", 0.0), ("b", 1.0)),
    nn.init.normal_: _sampler("normal_", ("mean", 0.0), ("std", 1.0)),
    nn.init.constant_: _constant("val", None),
    nn.init.kaiming_uniform_: _kaiming_uniform,
    _T.uniform_: _sampler("uniform_", ("from", 0.0), ("to", 1.0)),
    _T.normal_: _sampler("normal_", ("mean", 0.0), ("std", 1.0)),
    _T.fill_: _constant("value", None),
    _T.zero_: _constant("", 0.0),
    _T.lt: _bounds_check,
    _T.gt: _bounds_check,
}


# ``param.data = tensor`` on a DTensor replaces the wrapper's data, not its local shard: the
# shard keeps what it held (here: nothing written) and no dispatch mode sees it.
_SET_DATA: Any = torch.Tensor.data.__set__  # type: ignore[attr-defined]


def _stop_on_shard(operation: str) -> None:
    """Stop an initializer at ``operation`` on a shard, as ``_ShardWatch`` stops the ops it sees,
    so the module is initialized again on whole tensors; nothing to stop outside a watch."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _ShardWatch):
            mode.stopped = mode.stopped or operation
            raise _ShardOp(operation)


class _StreamMode(TorchFunctionMode):
    """On this thread, answers the initializers of tensors ``streams`` names from their stream."""

    def __init__(self, streams: _Streams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func == _SET_DATA and isinstance(args[0], DTensor):
            _stop_on_shard("Tensor.data = ...")
        answer = _ANSWERS.get(func)
        if answer is not None:
            tensor = args[0] if args else kwargs.get("tensor")
            if id(tensor) in self.streams.names:
                rest = {k: v for k, v in kwargs.items() if k != "tensor"}
                done = answer(self.streams, func, tensor, args[1:], rest)
                if done is not None:
                    return done
        return func(*args, **kwargs)


streamed_init = _StreamMode


# The same on a shard as on the full tensor. Any other op on a DTensor (a draw, a row view, a
# copy, a reduction) could depend on the world size or run a collective.
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
    """Stops the first operation on a DTensor outside ``ELEMENTWISE_ON_SHARDS``."""

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
    """``StreamInit``'s part of the run: parameters named for their streams; other draws from
    torch's generator seeded by ``(seed, module name)``."""

    seed: int
    env: Environment
    rules: dict[int, Lineage]
    streams: _Streams = attrs.field(init=False)
    done: list[_Done] = attrs.field(init=False, factory=list)
    # Torch's generators, saved once per build: per unit it costs more than a small unit's draws.
    held: contextlib.AbstractContextManager[object] | None = attrs.field(init=False, default=None)
    # The unit's dispatch modes, entered by ``scope``.
    watch: _ShardWatch = attrs.field(init=False, factory=lambda: _ShardWatch())
    draws: PrivateDraws = attrs.field(init=False, factory=lambda: PrivateDraws())

    def __attrs_post_init__(self) -> None:
        self.streams = _Streams(self.seed)

    @contextlib.contextmanager
    def scope(self, unit: Unit, modules: list[nn.Module]) -> Iterator[None]:
        streams = self.streams
        streams.draws.clear()  # names and done are emptied when each scope ends
        for state in unit.states:
            if state.is_param and not state.ignored:
                streams.names.setdefault(id(state.tensor), state.name)
        if self.held is None:
            self.held = torch.random.fork_rng(devices=fork_devices(self.env.device))
            self.held.__enter__()
        # One watch and one set of private generators per unit, reseeded per module: entering
        # them per module cost more than a small module's draws.
        self.watch, self.draws = _ShardWatch(), PrivateDraws()
        # Torch's own whole-tensor initializers on named parameters alone: every draw is
        # answered from a stream and no op needs stopping, so the two dispatch modes (a Python
        # call per op) would change nothing.
        watched = any(s.ignored for s in unit.states) or not runs_torch_whole_only(
            modules, self.rules
        )
        try:
            with (
                _StreamMode(streams),
                self.draws if watched else contextlib.nullcontext(),
                self.watch if watched else contextlib.nullcontext(),
            ):
                yield
        finally:
            streams.names.clear()
            self.done = []

    def close(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.__exit__(None, None, None)

    def _seeded(self, done: list[_Done]) -> str | None:
        """Run ``done``'s initializers seeded by name; the first op ``_ShardWatch`` stopped.
        Draws not answered from a stream (a buffer's, a new tensor's) come from generators of
        this thread's own (``PrivateDraws``): replicas must not depend on what another thread
        drew meanwhile. Torch's are seeded alike for ops that take no generator."""
        watch, draws = self.watch, self.draws
        watch.stopped = None
        with contextlib.suppress(_ShardOp):
            for d in done:
                seed = derived_seed(self.seed, d.fqn)
                seed_generators(seed, self.env.device)
                draws.reseed(seed)
                run_initializer(d.module, d.fqn, d.lineage)
        return watch.stopped

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        entry = _Done(module, fqn, lineage, dict(self.streams.draws))
        self.done.append(entry)
        stopped = self._seeded([entry])
        if stopped is not None:
            self._on_whole_tensors(entry, stopped)

    def _on_whole_tensors(self, entry: _Done, why: str) -> None:
        """Initialize ``entry.module`` and its unit's modules below it again on whole tensors,
        same seeds and draws, keeping this rank's slices."""
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
            stopped = self._seeded(again)
            if stopped is not None:
                raise MaterializationError(
                    f"`StreamInit` initialized '{entry.fqn or '<root>'}' on whole tensors "
                    f"(its initializer runs {why} on a shard), but it still runs "
                    f"{stopped} on a sharded parameter it does not own. Use "
                    "DeterministicInit(seed) for this model."
                )
        finally:
            for module, name, param, full in swapped:
                module._parameters[name] = param
                # Named by id: once the whole tensor is freed, a new tensor may get its id.
                streams.names.pop(id(full), None)
        for _, _, param, full in swapped:
            local_tensor(param).copy_(full[local_slices(param)])


# Below this many parameter bytes a unit costs less to fill whole on every rank and then shard
# than shard by shard (2 CPU ranks: about 10 % less up to 259 KiB, 20 % more at 1 MiB; the A/B is
# benchmarks/results/whole_units.md).
WHOLE_BELOW = 256 * 1024


def _check_bytes(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise config_error(
            type(instance).__name__,
            attribute.name,
            f"expected a number of bytes >= 0, got {value!r}",
            "Pass e.g. whole_below=0 to fill every unit shard by shard, or leave it out.",
        )


@frozen
class StreamInit(ResetParameters):
    """Each module's initializer by its model's convention, its ``torch.nn.init`` draws taken
    from block-seeded streams: every rank fills only its shards (a unit with fewer than
    ``whole_below`` parameter bytes whole, before it is sharded: less work, the same values),
    and the full weights are bit-identical at any world size and on both backends (eager
    init's distributions, not its numbers). A module whose initializer is not element-wise on a
    shard (``orthogonal_``, ``sparse_``, ``trunc_normal_`` with bounds that keep under 30 % of
    the mass, ``param.data = ...``) is initialized on whole tensors, each rank keeping its
    slice. ``FullyShardBuilder``'s default.

    ``seed=None`` takes the first rank's ``torch.initial_seed()``, so ``torch.manual_seed(s)``
    before the build changes the weights. Torch's generators are restored after the build.

    Raises:
        ConfigurationError: ``seed`` is not an int in ``[0, 2**63)``, or ``whole_below``
            is not a byte count.
        MaterializationError: in the configure stage, naming modules on meta without an
            initializer; during the build, an initializer that fails on whole tensors too.

    Example:
        ```python
        FullyShardBuilder().wrap(Block).materialize(StreamInit(seed=0)).build(model)
        ```
    """

    seed: int | None = attrs.field(default=None, validator=attrs.validators.optional(check_seed))
    whole_below: int = attrs.field(default=WHOLE_BELOW, validator=_check_bytes)
    communicates: ClassVar[bool] = False  # only prepare() communicates
    shard_first: ClassVar[bool] = True

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Share the base seed over the build's groups (collective)."""
        model = env.plan.root.module
        rules = lineages(model)
        return ShardFirstRun(
            env,
            buffers_to_compute(model, env.ignored),
            rules,
            _StreamedInit(agree_on_seed(env, self.seed), env, rules),
            "StreamInit",
            "Fix its initializer, or use DeterministicInit(seed) for this model.",
        )


__all__ = [
    "ELEMENTWISE_ON_SHARDS",
    "StreamInit",
    "WHOLE_BELOW",
    "global_indices",
    "streamed_init",
]
