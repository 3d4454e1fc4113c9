"""``.compile(...)``: ``module.compile`` of each unit below the root before it is sharded (as
torchtitan compiles only the blocks), or of the sharded root. In place, so no ``_orig_mod.`` key
prefix; see docs/recipes/composition.md for the order."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from attrs import frozen
from torch import nn

from fsdp_builder.common.describe import describe
from fsdp_builder.errors import config_error, require_bool

_WHERE = "ShardingBuilder.compile"


def _to_items(
    value: Mapping[str, Any] | tuple[tuple[str, Any], ...],
) -> tuple[tuple[str, Any], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))


@frozen
class CompileSpec:
    """What ``.compile(per_unit, **kwargs)`` asked for; ``kwargs`` go to ``module.compile``."""

    per_unit: bool = True
    kwargs: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_to_items)

    def __attrs_post_init__(self) -> None:
        require_bool(self.per_unit, _WHERE, "per_unit")
        # torch.compile's keyword arguments in this torch, the model excepted.
        known = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(name for name, _ in self.kwargs if name not in known)
        if unknown:
            raise config_error(
                _WHERE,
                unknown[0],
                f"torch.compile takes no argument(s) {unknown}",
                f"Pass torch.compile's own keywords: {sorted(known)}.",
            )
        given = dict(self.kwargs)
        if given.get("mode") is not None and given.get("options") is not None:
            raise config_error(
                _WHERE,
                "options",
                "torch.compile takes either mode or options, not both",
                "Drop one of them (mode presets are option sets).",
            )
        # torch.compile refuses these only when the first unit is compiled, after the units
        # before it were checkpointed and sharded: refuse them when they are set.
        _check_backend(given.get("backend", "inductor"))
        _check_mode(given.get("mode"))

    def describe(self) -> str:
        return f"compile(per_unit={self.per_unit}, {describe(dict(self.kwargs))})"

    def before_shard(self, is_root: bool) -> bool:
        """Whether a unit is compiled before it is sharded (per unit, every unit but the root)."""
        return self.per_unit and not is_root

    def after_shard(self, is_root: bool) -> bool:
        """Whether a unit is compiled after it is sharded (the whole model: the root)."""
        return not self.per_unit and is_root


def _check_backend(backend: Any) -> None:
    if callable(backend):
        return
    if not isinstance(backend, str):
        raise config_error(
            _WHERE,
            "backend",
            f"expected a backend name or a callable, got {type(backend).__name__}",
            "Pass e.g. backend='inductor' or backend='aot_eager'.",
        )
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    try:
        lookup_backend(backend)
    except Exception as exc:
        raise config_error(
            _WHERE,
            "backend",
            f"torch.compile has no backend {backend!r}",
            f"Pass one of {[n for n in list_backends(exclude_tags=()) if 'TESTING' not in n]}, "
            "or a callable backend.",
        ) from exc


def _check_mode(mode: Any) -> None:
    if mode is None:
        return
    import torch._inductor

    modes = sorted(torch._inductor.list_mode_options())
    if not isinstance(mode, str) or mode not in modes:
        raise config_error(
            _WHERE,
            "mode",
            f"{mode!r} is not a torch.compile mode",
            f"Pass one of {modes}, or leave mode out.",
        )


def check_units(spec: CompileSpec, unit_count: int, where: str) -> None:
    """Refuse ``per_unit=True`` on a plan with no unit below the root (nothing to compile)."""
    if spec.per_unit and unit_count <= 1:
        raise config_error(
            where,
            "per_unit",
            "compile(per_unit=True) compiles each wrap unit below the root, but the plan has only "
            "the root",
            "Choose units with .wrap(BlockClass), or compile the whole model with "
            "compile(per_unit=False).",
        )


def compile_in_place(module: nn.Module, spec: CompileSpec) -> nn.Module:
    """``module.compile(**kwargs)``: in place, same slot, same state-dict keys."""
    module.compile(**dict(spec.kwargs))
    return module


__all__ = ["CompileSpec", "check_units", "compile_in_place"]
