"""Module paths of earlier releases, kept importable with a ``DeprecationWarning``.

``import fsdp_builder.plan`` (and ``from fsdp_builder.plan import Unit``) still works after the
module moved to ``fsdp_builder.planning.plan``: a finder on ``sys.meta_path`` answers the old
name with a module that forwards every attribute to the new one and warns once, naming the new
path. ``python -m fsdp_builder.cli`` needs a file of its own (``fsdp_builder/cli.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from functools import partial

# Old path -> new path, for every public module that moved.
MOVED: dict[str, str] = {
    "fsdp_builder.agreement": "fsdp_builder.runtime.agreement",
    "fsdp_builder.buffers": "fsdp_builder.materializers.buffers",
    "fsdp_builder.checkpoints": "fsdp_builder.materializers.checkpoints",
    "fsdp_builder.collectives": "fsdp_builder.runtime.collectives",
    "fsdp_builder.demo": "fsdp_builder.tools.demo",
    "fsdp_builder.environment": "fsdp_builder.runtime.environment",
    "fsdp_builder.estimate": "fsdp_builder.tools.estimate",
    "fsdp_builder.ignored": "fsdp_builder.planning.ignored",
    "fsdp_builder.launch": "fsdp_builder.tools.launch",
    "fsdp_builder.loading": "fsdp_builder.materializers.loading",
    "fsdp_builder.moving": "fsdp_builder.runtime.tree",
    "fsdp_builder.nonfinite": "fsdp_builder.materializers.nonfinite",
    "fsdp_builder.plan": "fsdp_builder.planning.plan",
    "fsdp_builder.report": "fsdp_builder.runtime.report",
    "fsdp_builder.runtime.moving": "fsdp_builder.runtime.tree",
    "fsdp_builder.sharded_init": "fsdp_builder.materializers.sharded",
    "fsdp_builder.tools.export": "fsdp_builder.export",
    "fsdp_builder.tree": "fsdp_builder.runtime.tree",
    "fsdp_builder.wrap": "fsdp_builder.planning.wrap",
}


def _importer(old: str) -> types.FrameType | None:
    """The frame of the code that imported ``old``: the first frame outside this module, the
    module ``old`` itself and the import machinery. Counted from the top rather than by a fixed
    ``stacklevel``, since how many frames the import system adds differs between Python versions
    and between ``import x``, ``from x import y`` and ``importlib.import_module``."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        file = frame.f_code.co_filename
        machinery = file.startswith("<frozen importlib") or file == importlib.__file__
        if name not in (__name__, old) and not machinery:
            return frame
        frame = frame.f_back
    return None


def warn_moved(old: str, new: str) -> None:
    """A DeprecationWarning attributed to the line that imported ``old``, so that Python's
    default filters show it when that line is the user's script (they show DeprecationWarnings
    triggered in ``__main__`` only) and ``-W``/``filterwarnings`` filters by the user's module."""
    message = (
        f"`{old}` moved to `{new}`; import it from there (the old path will be removed in a "
        "future release)."
    )
    frame = _importer(old)
    if frame is None:
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return
    where = frame.f_globals
    warnings.warn_explicit(
        message,
        DeprecationWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=where.get("__name__", "<string>"),
        registry=where.setdefault("__warningregistry__", {}),
    )


class _Forwarder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old path of :data:`MOVED` and loads it as a module forwarding to the new."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        target = importlib.import_module(new)
        warn_moved(spec.name, new)
        module = types.ModuleType(spec.name, target.__doc__)
        module.__dict__["__getattr__"] = partial(getattr, target)
        module.__dict__["__all__"] = getattr(
            target, "__all__", [n for n in vars(target) if not n.startswith("_")]
        )
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (importing the package calls it)."""
    if not any(isinstance(f, _Forwarder) for f in sys.meta_path):
        sys.meta_path.append(_Forwarder())
