"""The base of every ``Base*`` strategy class: a misspelled hook would be silently ignored (and
could change how ranks agree), so it is refused when the class is created."""

from __future__ import annotations

import difflib
from typing import Any

from fsdp_builder.errors import ConfigurationError


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
