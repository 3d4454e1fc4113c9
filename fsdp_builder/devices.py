"""DeviceResolver role: which device this rank computes on, by FSDP's device rules."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import attrs
import torch
from attrs import frozen
from torch import nn
from typing_extensions import override

from fsdp_builder.common.hooks import DeclaredHooks
from fsdp_builder.common.logs import warn_user
from fsdp_builder.errors import ConfigurationError, config_error

CPU = torch.device("cpu")


@runtime_checkable
class DeviceResolver(Protocol):
    """Resolves the compute device of this rank. ``explicit`` devices allow CPU+GPU modules."""

    @property
    def explicit(self) -> bool:
        """True when the device was named by the user (a CPU part may then be moved there)."""

    def resolve(self, module: nn.Module, params: Iterable[nn.Parameter], rank: int) -> torch.device:
        """Return the compute device. Must not communicate (it runs before ranks agree)."""


class BaseDeviceResolver(DeclaredHooks):
    """Optional base for custom resolvers."""

    __slots__ = ()

    explicit: bool = False

    def resolve(self, module: nn.Module, params: Iterable[nn.Parameter], rank: int) -> torch.device:
        raise NotImplementedError


def _convert_device(value: int | str | torch.device) -> torch.device:
    try:
        if isinstance(value, bool):
            raise TypeError(value)
        return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except (TypeError, RuntimeError) as exc:
        raise config_error(
            "ExplicitDevice",
            "device",
            f"{value!r} is not a device ({exc})",
            "Pass an int GPU index, a string such as 'cuda:0' or 'cpu', or a torch.device.",
        ) from None


@frozen
class ExplicitDevice(BaseDeviceResolver):
    """A fixed device: an int index (CUDA), a string or a ``torch.device``.

    Raises:
        ConfigurationError: not a device; a CUDA device without CUDA or without that index.

    Example:
        ```python
        FSDPBuilder().device(ExplicitDevice(f"cuda:{local_rank}"))  # or .device("cuda:0")
        ```
    """

    device: torch.device = attrs.field(converter=_convert_device)
    explicit: bool = attrs.field(default=True, init=False)

    @override
    def resolve(self, module: nn.Module, params: Iterable[nn.Parameter], rank: int) -> torch.device:
        """``cuda:<index>`` needs CUDA and a GPU of that index; ``cuda`` is the current one."""
        device = self.device
        if device.type != "cuda":
            return device
        if not torch.cuda.is_available():
            raise config_error(
                "ExplicitDevice",
                "device",
                f"'{device}' was asked for but CUDA is not available on this machine",
                "Use ExplicitDevice('cpu') (or CPUDevice(), LocalRankDevice()) with the gloo "
                "backend, or run on a GPU machine.",
            )
        if device.index is None:
            current = torch.cuda.current_device()
            warn_user(
                f"Device 'cuda' on rank {rank} has no explicit index; using the current device "
                f"cuda:{current}. Call torch.cuda.set_device() first or pass 'cuda:<index>'."
            )
            return torch.device("cuda", current)
        count = torch.cuda.device_count()
        if device.index >= count:
            raise config_error(
                "ExplicitDevice",
                "device",
                f"'{device}' was asked for but this machine has {count} GPU(s) "
                f"(cuda:0 to cuda:{count - 1})",
                "Pass an index below the GPU count, or use LocalRankDevice() under torchrun.",
            )
        return device


@frozen
class LocalRankDevice(BaseDeviceResolver):
    """``cuda:$LOCAL_RANK`` when CUDA is available, else the CPU.

    Raises:
        ConfigurationError: CUDA is available but ``LOCAL_RANK`` is not set.

    Example:
        ```python
        FSDPBuilder().device(LocalRankDevice())  # under torchrun
        ```
    """

    explicit: bool = attrs.field(default=True, init=False)

    @override
    def resolve(self, module: nn.Module, params: Iterable[nn.Parameter], rank: int) -> torch.device:
        if not torch.cuda.is_available():
            return CPU
        raw = os.environ.get("LOCAL_RANK")
        if raw is None or not raw.isdigit():
            raise ConfigurationError(
                f"`LocalRankDevice` needs the LOCAL_RANK environment variable, got {raw!r}. "
                "Launch with torchrun, or use ExplicitDevice(f'cuda:{local_rank}')."
            )
        return torch.device("cuda", int(raw))


@frozen
class CPUDevice(BaseDeviceResolver):
    """Always the CPU (for gloo).

    Example:
        ```python
        FSDPBuilder().device(CPUDevice())  # with the gloo backend
        ```
    """

    explicit: bool = attrs.field(default=True, init=False)

    @override
    def resolve(self, module: nn.Module, params: Iterable[nn.Parameter], rank: int) -> torch.device:
        return CPU


@frozen
class InferredDevice(BaseDeviceResolver):
    """The non-CPU device the parameters are on; else the current CUDA device, else the CPU.

    Raises:
        ConfigurationError: parameters on two device types.

    Example:
        ```python
        FSDPBuilder().device(InferredDevice())  # the default when .device() is not called
        ```
    """

    explicit: bool = attrs.field(default=False, init=False)

    @override
    def resolve(self, module: nn.Module, params: Iterable[nn.Parameter], rank: int) -> torch.device:
        found: torch.device | None = None
        for p in params:
            if p.device.type in ("cpu", "meta"):
                continue
            if found is None:
                found = p.device
            elif p.device.type != found.type:
                raise ConfigurationError(
                    "`InferredDevice` found parameters on two device types, "
                    f"{found.type} and {p.device.type}. Move the module to one device type, or "
                    "pass an explicit device with `.device(ExplicitDevice(...))`."
                )
        if found is not None:
            return found
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return CPU


def checked_device(resolver: DeviceResolver, returned: object) -> torch.device:
    """What a resolver's ``resolve`` returned, refused unless it is a device this rank can
    compute on: the CPU, or this machine's accelerator (an index it has). Local."""
    where = f"`{type(resolver).__name__}.resolve`"
    if not isinstance(returned, torch.device):
        text = repr(returned)
        shown = text[:80] + ("..." if len(text) > 80 else "")
        raise ConfigurationError(
            f"{where} returned {type(returned).__name__} {shown}, not a torch.device. Return "
            "torch.device(...), e.g. torch.device('cpu') or torch.device('cuda', local_rank)."
        )
    if returned.type == "cpu":
        return returned
    if returned.type == "meta":
        raise ConfigurationError(
            f"{where} returned {returned!r}: meta is where a model waits for its values, not a "
            "device to compute on. Return the device this rank computes on (the model may "
            "still be on meta; its states are made real there)."
        )
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != returned.type:
        has = "no accelerator" if accelerator is None else f"only {accelerator.type} devices"
        raise ConfigurationError(
            f"{where} returned {returned!r}, but this machine has no {returned.type} devices "
            f"({has}). Return torch.device('cpu') here (with the gloo backend), or a device "
            "this machine has."
        )
    count = torch.accelerator.device_count()
    if returned.index is not None and returned.index >= count:
        raise ConfigurationError(
            f"{where} returned {returned!r}, but this machine has {count} {returned.type} "
            f"device(s) ({returned.type}:0 to {returned.type}:{count - 1}). Return an index "
            "below the device count, e.g. the LOCAL_RANK torchrun sets."
        )
    return returned


def check_single_device(params: Iterable[nn.Parameter], explicit: bool) -> None:
    """One device, or CPU + one other when the device is explicit (the CPU part is moved)."""
    devices = {p.device for p in params if p.device.type != "meta"}
    if len(devices) == 2 and CPU in devices:
        if not explicit:
            raise ConfigurationError(
                f"The module has parameters on both CPU and {(devices - {CPU}).pop()}. "
                "Pass an explicit device (`.device(ExplicitDevice(...))` or LocalRankDevice()) "
                "so the CPU part is moved there."
            )
    elif len(devices) > 1:
        names = sorted(str(d) for d in devices)
        raise ConfigurationError(
            f"The module has parameters on several devices {names}; a shard unit must sit on "
            "one device. Move the module to one device before building."
        )


def check_compute_device(
    params: Iterable[torch.Tensor], device: torch.device, unit: str, rank: int
) -> None:
    """After the move step every managed parameter must be on the compute device."""
    for p in params:
        if p.device.type != "meta" and p.device != device:
            raise ConfigurationError(
                f"Inconsistent compute device on rank {rank} in unit '{unit}': a parameter is on "
                f"{p.device} but the resolved device is {device}. Move the module to {device} "
                "or resolve to the device it is on."
            )
