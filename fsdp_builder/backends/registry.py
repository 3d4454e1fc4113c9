"""The backends by name (``--backend`` of the CLI, estimates). A new backend is a ``Backend``
class added here, with a builder subclass in ``builder.py``."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fsdp_builder.backends import Backend
from fsdp_builder.backends.fsdp1 import FSDP1Backend
from fsdp_builder.backends.fsdp2 import FullyShardBackend
from fsdp_builder.errors import config_error

BACKENDS: Mapping[str, Backend] = MappingProxyType(
    {backend.name: backend for backend in (FSDP1Backend(), FullyShardBackend())}
)


def backend_named(name: str, where: str = "backend") -> Backend:
    """The backend called ``name`` (``"fsdp1"``, ``"fsdp2"``)."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise config_error(
            where, "backend", f"{name!r} is not a backend", f"Pass one of {sorted(BACKENDS)}."
        )
    return backend


__all__ = ["BACKENDS", "backend_named"]
