"""Shard-local initialization with world-size-invariant values: counter-based random streams.

Element ``i`` (row-major index in the full tensor) of parameter ``name`` gets its random bits
from a hash of ``(seed, name, i)`` alone, so any slice of a tensor can be generated without the
rest: each rank fills only the rows it holds and still gets exactly the values the full tensor
would have, at any world size and on either backend (FSDP1 materializes whole units, whose
indices are then simply all of them).

``StreamInit`` runs each module's own ``reset_parameters`` (as ``ResetParameters`` does) with the
``torch.nn.init`` functions PyTorch modules and transformers use answered from these streams:
``uniform_``, ``normal_``, ``trunc_normal_``, ``constant_``, ``ones_``, ``zeros_`` and the
Kaiming and Xavier variants. Their bounds and standard deviations come from the full shape (a
DTensor's ``shape`` is global), as eager init computes them. The values are the same
distributions as eager ``reset_parameters``, not the same numbers: the stream is not torch's RNG.

The bits are splitmix64 (Steele et al., "Fast splittable pseudorandom number generators",
OOPSLA 2014) of ``key + golden * (counter + 1)``, computed with wrapping int64 tensor arithmetic
on the parameter's device; uniforms keep 53 bits, normals come from Box-Muller over two counters.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs
import structlog
import torch
from attrs import define, frozen
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from typing_extensions import override

from fsdp_builder.common.hashing import digest63
from fsdp_builder.materializers.conventions import Lineage, lineages
from fsdp_builder.materializers.initializers import (
    MaterializerRun,
    ResetParameters,
    buffers_to_compute,
    check_seed,
)
from fsdp_builder.materializers.sharded import ShardFirstRun, run_seeded, shard_index, shard_seed
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import module_names, qualified

log = structlog.get_logger(__name__)


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
_TWO_POW_53 = float(1 << 53)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def random_bits(key: int, counters: torch.Tensor) -> torch.Tensor:
    """64 random bits (as int64) per counter: splitmix64 of ``key + golden * (counter + 1)``."""
    z = (counters + 1) * _GOLDEN + _signed(key & ((1 << 64) - 1))
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def uniform01(key: int, counters: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in [0, 1), 53 bits each."""
    return _shr(random_bits(key, counters), 11).to(torch.float64) / _TWO_POW_53


def standard_normal(key: int, index: torch.Tensor) -> torch.Tensor:
    """Float64 standard normals (Box-Muller; element ``i`` uses counters ``2i`` and ``2i+1``)."""
    u1 = 1.0 - uniform01(key, 2 * index)  # (0, 1]: the log stays finite
    u2 = uniform01(key, 2 * index + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def global_indices(tensor: torch.Tensor) -> torch.Tensor:
    """Row-major index in the full tensor of each element this rank holds, shaped like the local
    tensor (a DTensor's local shard; all of a plain tensor)."""
    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        local_shape, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        device = tensor.to_local().device
    else:
        local_shape, offsets = shape, (0,) * len(shape)
        device = tensor.device
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = local_shape[dim]
        steps = torch.arange(offsets[dim], offsets[dim] + local_shape[dim], device=device)
        index = index + (steps * stride).view(view)
        stride *= shape[dim]
    return index.expand(tuple(local_shape)) if shape else index


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Streams:
    """The streams of one build: a key per (parameter name, how many times it was drawn), so a
    parameter written twice (an initializer, then a subtree rule) gets fresh bits each time."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.names: dict[int, str] = {}
        self.draws: dict[str, int] = {}

    def key(self, tensor: torch.Tensor) -> int | None:
        name = self.names.get(id(tensor))
        if name is None:
            return None
        draw = self.draws.get(name, 0)
        self.draws[name] = draw + 1
        return digest63(f"{self.seed}/{name}/{draw}")

    def fill(self, tensor: torch.Tensor, values: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Write ``values(global indices)`` (float64) into this rank's part of ``tensor``."""
        local = _local(tensor)
        if local.numel():
            with torch.no_grad():
                local.copy_(values(global_indices(tensor)).to(local.dtype))


_Init = Callable[..., torch.Tensor]


def _kaiming_std(tensor: torch.Tensor, a: float, mode: str, nonlinearity: str) -> float:
    """The standard deviation Kaiming init asks for, from the full shape (as torch computes it)."""
    fan = nn.init._calculate_correct_fan(tensor, mode)  # type: ignore[arg-type]
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
        streams.fill(tensor, lambda i: a + (b - a) * uniform01(key, i))
        return tensor

    def normal_(
        tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None
    ) -> torch.Tensor:
        key = streams.key(tensor)
        if key is None:
            return original["normal_"](tensor, mean, std, generator=generator)
        streams.fill(tensor, lambda i: mean + std * standard_normal(key, i))
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

        def values(i: torch.Tensor) -> torch.Tensor:
            u = low + (high - low) * uniform01(key, i)
            return (torch.erfinv(u) * (std * math.sqrt(2.0)) + mean).clamp(a, b)

        streams.fill(tensor, values)
        return tensor

    def constant_(tensor: torch.Tensor, val: float) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None:
            return original["constant_"](tensor, val)
        with torch.no_grad():
            _local(tensor).fill_(val)
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
        fan_in, fan_out = init._calculate_fan_in_and_fan_out(tensor)
        bound = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
        return uniform_(tensor, -bound, bound)

    def xavier_normal_(
        tensor: torch.Tensor, gain: float = 1.0, generator: Any = None
    ) -> torch.Tensor:
        if streams.names.get(id(tensor)) is None:
            return original["xavier_normal_"](tensor, gain, generator)
        fan_in, fan_out = init._calculate_fan_in_and_fan_out(tensor)
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
    }
    original.update({name: getattr(init, name) for name in replacements})
    return replacements


STREAMED_INITIALIZERS: tuple[str, ...] = tuple(_streamed(_Streams(0)))


def _bindings() -> list[tuple[Any, str, Any]]:
    """Where the initializers are bound: ``torch.nn.init`` itself, and torch's module files that
    import them by name (``nn.MultiheadAttention`` calls its own ``xavier_uniform_``)."""
    found: list[tuple[Any, str, Any]] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (
            module_name == "torch.nn.init" or module_name.startswith("torch.nn.modules.")
        ):
            continue
        for name in STREAMED_INITIALIZERS:
            fn = getattr(module, name, None)
            if fn is not None and fn is getattr(nn.init, name):
                found.append((module, name, fn))
    return found


@contextlib.contextmanager
def streamed_init(
    streams: _Streams, bindings: list[tuple[Any, str, Any]] | None = None
) -> Iterator[None]:
    """``torch.nn.init``'s initializers answered from ``streams`` inside the block, wherever
    torch binds them; the originals are back when the block ends, however it ends. Not
    thread-safe: another thread initializing meanwhile would draw from the streams too.
    ``bindings``: a build's ``_bindings()``, found once instead of on every unit."""
    replacements = _streamed(streams)
    bindings = _bindings() if bindings is None else bindings
    for module, name, _ in bindings:
        setattr(module, name, replacements[name])
    try:
        yield
    finally:
        for module, name, fn in bindings:
            setattr(module, name, fn)


@define
class _StreamedInit:
    """``StreamInit``'s part of the shard-first run: a unit's parameters named for their
    streams and ``torch.nn.init`` answered from them while the unit initializes."""

    seed: int
    index: int
    env: Environment
    bindings: list[tuple[Any, str, Any]] = attrs.field(factory=_bindings)

    @contextlib.contextmanager
    def scope(self, unit: Unit, modules: list[nn.Module]) -> Iterator[None]:
        streams = _Streams(self.seed)
        names = module_names(unit.module)
        ignored = self.env.ignored.params
        for module in modules:
            base = qualified(unit.fqn, names.get(id(module), ""))
            for local_name, param in module._parameters.items():
                if param is not None and param not in ignored:
                    streams.names.setdefault(id(param), clean_name(qualified(base, local_name)))
        with streamed_init(streams, self.bindings):
            yield

    def init_module(self, module: nn.Module, fqn: str, lineage: Lineage) -> None:
        # Draws outside torch.nn.init (a module's own tensor.normal_()) fall back to a
        # generator seeded per shard and module, as ShardFirstReset draws: reproducible for
        # one world size, and shards differ.
        seed = shard_seed(self.seed, self.index, fqn)
        run_seeded(module, fqn, lineage, seed, self.env.device)


@frozen
class StreamInit(ResetParameters):
    """Each module's ``reset_parameters()``, with ``torch.nn.init``'s element-wise initializers
    drawn from counter-based streams keyed by ``(seed, parameter name, element index)``: with
    ``FullyShardBuilder`` every rank allocates and fills only its shards (shard-first), and the
    full weights are bit-identical at any world size, and between both backends.

    The distributions are those of eager ``reset_parameters`` (same bounds and standard
    deviations, from the full shapes); the numbers are not torch's RNG's. Initializers that need
    the whole tensor (``orthogonal_``, ``eye_``) do not work on a shard, and a module that draws
    with tensor methods instead of ``torch.nn.init`` gets values that depend on the world size:
    use ``DeterministicInit`` for those.

    Raises:
        ConfigurationError: ``seed`` is not an int in ``[0, 2**63)``.
        MaterializationError: in the configure stage, naming modules on meta without an
            initializer; during the build, an initializer that fails on a shard.

    Example:
        ```python
        FullyShardBuilder().wrap(Block).materialize(StreamInit(seed=0)).build(model)
        ```
    """

    seed: int = attrs.field(default=0, validator=check_seed)
    communicates: ClassVar[bool] = False
    shard_first: ClassVar[bool] = True

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        model = env.plan.root.module
        computed = buffers_to_compute(model, env.ignored)
        return ShardFirstRun(
            env,
            computed,
            lineages(model),
            _StreamedInit(self.seed, shard_index(env), env),
            "StreamInit",
            "Its initializer may need the whole tensor (orthogonal_, eye_); use "
            "DeterministicInit(seed) for this model.",
        )


__all__ = ["STREAMED_INITIALIZERS", "StreamInit", "global_indices", "streamed_init"]
