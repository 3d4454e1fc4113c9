"""Ties a transformers model declares (``all_tied_weights_keys``) but holds as two meta tensors
(Accelerate's ``init_empty_weights`` makes every parameter anew). The plan treats each pair as
one state; the build ties it (``UnitPlan.tie_declared``) only once ranks agreed, so a refused
build leaves the model as given."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
from attrs import frozen
from torch import nn

from fsdp_builder.planning.ignored import IgnoredStates, NamedModules


@frozen(eq=False)
class DeclaredTie:
    """One declared pair to tie: the slot ``name`` of ``owner`` is to hold ``source``;
    ``untied`` is the parameter it holds now."""

    owner: nn.Module = attrs.field(repr=False)
    name: str
    untied: nn.Parameter = attrs.field(repr=False)
    source: nn.Parameter = attrs.field(repr=False)

    def tie(self) -> None:
        # What transformers' tie_weights does per pair. It is not called itself: it would also
        # tie pairs holding real, different values (a model untied on purpose).
        setattr(self.owner, self.name, self.source)


def _parameter_at(
    root: nn.Module, name: str, ignored: IgnoredStates
) -> tuple[nn.Module, str, nn.Parameter] | None:
    """The module, local name and parameter at ``name`` below ``root``; None when it is not a
    parameter, or it or a module on its path is ignored."""
    path, _, local = name.rpartition(".")
    modules = [root]
    for part in path.split(".") if path else ():
        child = modules[-1]._modules.get(part)
        if child is None:
            return None
        modules.append(child)
    if any(m in ignored.modules for m in modules):
        return None
    param = modules[-1]._parameters.get(local)
    if not isinstance(param, nn.Parameter) or ignored.ignores(param):
        return None
    return modules[-1], local, param


def declared_ties(
    model: nn.Module, ignored: IgnoredStates, named: NamedModules | None = None
) -> tuple[DeclaredTie, ...]:
    """Declared pairs whose target is a separate meta parameter (no values to lose) of the
    source's shape and dtype, neither side ignored. Local and pure."""
    found: dict[tuple[int, str], DeclaredTie] = {}
    for _, module in named if named is not None else model.named_modules():
        keys = module.__dict__.get("all_tied_weights_keys")
        if not keys or not isinstance(keys, dict):
            continue
        # On the class: a missing attribute on a module instance costs an exception.
        if not callable(getattr(type(module), "tie_weights", None)):
            continue
        for target, source in keys.items():
            at_target = _parameter_at(module, str(target), ignored)
            at_source = _parameter_at(module, str(source), ignored)
            if at_target is None or at_source is None:
                continue
            owner, name, untied = at_target
            shared = at_source[2]
            if (
                untied is shared
                or not untied.is_meta
                or untied.shape != shared.shape
                or untied.dtype != shared.dtype
                or (id(owner), name) in found
            ):
                continue
            found[(id(owner), name)] = DeclaredTie(owner, name, untied, shared)
    return tuple(found.values())


@contextlib.contextmanager
def held(ties: tuple[DeclaredTie, ...]) -> Iterator[None]:
    """``ties`` tied inside the block and untied when it ends, however it ends."""
    # The modules' own dicts: no registration hooks run for a tie that is undone.
    for tie in ties:
        tie.owner._parameters[tie.name] = tie.source
    try:
        yield
    finally:
        for tie in reversed(ties):
            tie.owner._parameters[tie.name] = tie.untied
