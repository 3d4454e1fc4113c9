"""The base of every ``Base*`` strategy class: a misspelled hook would be silently ignored (and
could change how ranks agree), so it is refused when the class is created. And the one way a
role's check hook is called, its former hooks included."""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fsdp_builder.errors import ConfigurationError

if TYPE_CHECKING:
    from fsdp_builder.planning.context import ConfigureContext


class DeclaredHooks:
    """Refuses, at class creation, a public name that is not a member of any base class but is
    within a typo of one (e.g. ``communicate`` for ``communicates``)."""

    # Empty: slotted ready-made strategies stay free of instance dicts.
    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        known = {n for base in cls.__mro__[1:] for n in vars(base) if not n.startswith("_")}
        for name in vars(cls):
            if name.startswith("_") or name in known:
                continue
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if close:
                raise ConfigurationError(
                    f"`{cls.__name__}.{name}` is not a hook of its base classes; did you mean "
                    f"`{close[0]}`? A misspelled hook is never called. Rename it, or give it a "
                    "name further from the hooks' names if it is a helper of your own."
                )


# A role's check hook before ``check_context``, and the arguments ``check_context``'s context
# gives it: still called, after ``check_context``, with a DeprecationWarning.
_FORMER_CHECKS: dict[str, tuple[str, Callable[[ConfigureContext], tuple[Any, ...]]]] = {
    "check": ("check(plan, ignored)", lambda c: (c.plan, c.ignored)),
    "validate": ("validate(strategy)", lambda c: (c.options.strategy,)),
}

F = TypeVar("F", bound=Callable[..., Any])


def former_hook(fn: F) -> F:
    """Marks a base class's own deprecated hook, kept for direct callers: ``check_role`` does
    not call it (what it did, ``check_context`` does)."""
    fn.__former_hook__ = True  # type: ignore[attr-defined]
    return fn


def check_role(role: object, context: ConfigureContext, former: str | None = None) -> None:
    """A role's one check hook, ``check_context(context)`` (optional but for materializers),
    then ``former`` (``"check"``: a materializer's ``check(plan, ignored)``; ``"validate"``: a
    group factory's ``validate(strategy)``) where the role's class still defines it."""
    own = getattr(role, "check_context", None)
    if callable(own):
        own(context)
    legacy = getattr(role, former, None) if former is not None else None
    if callable(legacy) and not getattr(legacy, "__former_hook__", False):
        assert former is not None
        signature, arguments = _FORMER_CHECKS[former]
        warnings.warn(
            f"`{type(role).__name__}.{signature}` is deprecated: override "
            "`check_context(context)` instead (`context.plan`, `context.ignored`, "
            "`context.options.strategy`).",
            DeprecationWarning,
            stacklevel=_outside_library(),
        )
        legacy(*arguments(context))


def _outside_library() -> int:
    """The ``stacklevel`` of the first frame outside this package: the user's build call."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fsdp_builder"):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
