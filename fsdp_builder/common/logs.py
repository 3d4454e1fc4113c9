"""Where the library's events go (docs/logging.md), and how its warnings point at user code.

Modules log through :func:`get_logger`, never ``structlog.get_logger``: structlog's own default,
when nothing is configured, prints every debug event to standard output.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from typing import Any

import structlog

logging.getLogger("fsdp_builder").addHandler(logging.NullHandler())

_KEY_ORDER = ["event", "rank", "world_size", "unit"]


def build_logger(name: str, **values: Any) -> Any:
    """A logger bound to ``values`` for one build: structlog's configured one when the
    application configured structlog, else one that renders into ``logging.getLogger(name)``
    (levels below that logger's effective level cost one no-op call)."""
    if structlog.is_configured():
        return structlog.get_logger(name).bind(**values)
    target = logging.getLogger(name)
    return structlog.wrap_logger(
        target,
        processors=[structlog.processors.KeyValueRenderer(key_order=_KEY_ORDER, drop_missing=True)],
        wrapper_class=structlog.make_filtering_bound_logger(target.getEffectiveLevel()),
        context_class=dict,
    ).bind(**values)


class LibraryLogger:
    """A module's logger (``log = get_logger(__name__)``): it takes the route of
    :func:`build_logger` at every call, never structlog's unconfigured default, so that an
    application configuring structlog or logging after the import is still obeyed."""

    __slots__ = ("_name", "_values")

    def __init__(self, name: str, values: dict[str, Any] | None = None) -> None:
        self._name = name
        self._values = values or {}

    def bind(self, **values: Any) -> LibraryLogger:
        return LibraryLogger(self._name, {**self._values, **values})

    def _emit(self, method: str, level: int, event: str, **values: Any) -> None:
        # The common case, nothing configured, costs no logger construction.
        if not structlog.is_configured() and not logging.getLogger(self._name).isEnabledFor(level):
            return
        getattr(build_logger(self._name, **self._values), method)(event, **values)

    debug = functools.partialmethod(_emit, "debug", logging.DEBUG)
    info = functools.partialmethod(_emit, "info", logging.INFO)
    warning = functools.partialmethod(_emit, "warning", logging.WARNING)
    error = functools.partialmethod(_emit, "error", logging.ERROR)


get_logger = LibraryLogger


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside this package (the user's
    ``build()`` call or strategy), however deep inside the library the warning is raised."""
    level = 2  # stacklevel 2 is warn_user's caller
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("fsdp_builder"):
        level += 1
        frame = frame.f_back  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)
