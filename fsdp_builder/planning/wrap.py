"""Wrap policies: which modules become their own shard unit (module classes, a ``(module, fqn)``
predicate, a torch policy, or :class:`NoSplitModules`)."""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

from attrs import frozen
from torch import nn
from torch.distributed.fsdp.wrap import _Policy

from fsdp_builder.common.logs import build_logger, warn_user
from fsdp_builder.config import CheckpointPredicate, PerUnitFn
from fsdp_builder.errors import config_error
from fsdp_builder.planning.ignored import NamedModules, is_wrapped

WrapPredicate: TypeAlias = Callable[[nn.Module, str], bool]


@frozen
class NoSplitModules:
    """Wrap the block classes a transformers model names in ``_no_split_modules``, as
    Accelerate does; the default for such a model.

    Example:
        ```python
        FullyShardBuilder().wrap(NoSplitModules()).build(llama)  # LlamaDecoderLayer units
        ```
    """


def no_split_class_names(model: nn.Module, named: NamedModules | None = None) -> tuple[str, ...]:
    """The ``_no_split_modules`` class names of ``model`` and every module below it, in
    first-seen order (transformers' and diffusers' rule; for a diffusers model declaring none,
    :func:`diffusers_block_names`). ``named``: ``model.named_modules()``, if taken."""
    names: dict[str, None] = {}
    for _, module in model.named_modules() if named is None else named:
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, list | tuple | set):
            names.update((str(n), None) for n in declared)
        elif declared is None and is_diffusers_model(module):
            names.update(dict.fromkeys(diffusers_block_names(module)))
    return tuple(names)


# ``self.transformer_blocks[0].norm1.emb(...)`` in a forward: a part of one block called by
# the model itself, outside the block's own forward.
_INDEXED_CALL = re.compile(r"self\.(\w+)\[(\d+)\]\.\w")


_INDEXED_CALLS: dict[type[nn.Module], tuple[tuple[str, int], ...]] = {}


def _indexed_calls(cls: type[nn.Module]) -> tuple[tuple[str, int], ...]:
    """``(blocks, index)`` of each ``self.<blocks>[<index>].`` in ``cls.forward``, once per
    class (reading the source is slow)."""
    if cls not in _INDEXED_CALLS:
        try:
            found = _INDEXED_CALL.findall(inspect.getsource(cls.forward))
        except (OSError, TypeError, AttributeError):
            found = []
        _INDEXED_CALLS[cls] = tuple(dict.fromkeys((name, int(i)) for name, i in found))
    return _INDEXED_CALLS[cls]


def called_outside_blocks(named: NamedModules) -> dict[nn.Module, str]:
    """The blocks of diffusers models whose parts the model's ``forward`` calls itself, by
    name: DiT computes its output's conditioning with ``transformer_blocks[0].norm1.emb``, so
    that block's parameters must still be gathered after the block ran (its parent keeps it).
    Read from the forward's source (diffusers writes these as ``self.<blocks>[<i>].``)."""
    found: dict[nn.Module, str] = {}
    for path, module in named:
        if not is_diffusers_model(module):
            continue
        for name, index in _indexed_calls(type(module)):
            blocks = module._modules.get(name)
            if isinstance(blocks, nn.ModuleList | nn.Sequential) and index < len(blocks):
                found[blocks[index]] = f"{path}.{name}.{index}" if path else f"{name}.{index}"
    return found


def _refuse_called_outside(selected: set[nn.Module], named: NamedModules) -> None:
    """Refuse units whose parts the model's forward calls after the unit ran: their parameters
    would be resharded by then, and the forward would fail in torch with no word of why."""
    called = called_outside_blocks(named)
    bad = sorted(name for module, name in called.items() if module in selected)
    if not bad:
        return
    first = bad[0]
    raise _wrap_error(
        f"the model's forward calls parts of {', '.join(bad)} itself, after "
        f"{'that block' if len(bad) == 1 else 'those blocks'} ran (e.g. DiT's "
        "self.transformer_blocks[0].norm1.emb), so as a unit of its own its parameters "
        "would no longer be gathered then",
        f"Leave it to its parent: pass a predicate such as `.wrap(lambda module, fqn: "
        f"isinstance(module, Block) and fqn != '{first}')`, or no .wrap(...) (diffusers' "
        "blocks, less that one).",
    )


def is_diffusers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a diffusers ``ModelMixin`` (told without importing diffusers)."""
    cls = type(module)
    found = _DIFFUSERS_CLASSES.get(cls)
    if found is None:  # per class: the plan asks it of every module
        found = _DIFFUSERS_CLASSES[cls] = any(
            base.__name__ == "ModelMixin" and base.__module__.startswith("diffusers.")
            for base in cls.__mro__
        )
    return found


_DIFFUSERS_CLASSES: dict[type, bool] = {}


def diffusers_block_names(model: nn.Module) -> tuple[str, ...]:
    """The block classes of a diffusers model that declares no ``_no_split_modules`` (DiT):
    its ``_repeated_blocks`` (the classes diffusers compiles one by one), else the classes of
    the members of its ModuleLists named ``*blocks`` (``transformer_blocks``, ``down_blocks``
    ...), diffusers' naming of the repeated parts of a model."""
    repeated = getattr(model, "_repeated_blocks", None)
    if isinstance(repeated, list | tuple | set) and repeated:
        return tuple(dict.fromkeys(str(n) for n in repeated))
    names: dict[str, None] = {}
    for name, child in model._modules.items():
        if isinstance(child, nn.ModuleList) and name.endswith("blocks"):
            names.update((type(member).__name__, None) for member in child)
    return tuple(names)


def _wrap_error(problem: str, fix: str) -> Exception:
    return config_error("ShardingBuilder.wrap", "policy", problem, fix)


def _is_module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


@frozen
class WrapPolicy:
    """A normalized wrap policy. Exactly one of its fields is set, or none (root-only plan)."""

    classes: tuple[type[nn.Module], ...] = ()
    predicate: WrapPredicate | None = None
    torch_policy: _Policy | None = None
    # FSDP1's callable policies, e.g. partial(transformer_auto_wrap_policy, ...): called as
    # (module, recurse, nonwrapped_numel).
    legacy_policy: Callable[..., bool] | None = None
    # Classes named by the model's ``_no_split_modules``, resolved against the model at plan time.
    no_split: bool = False

    @classmethod
    def of(cls, spec: Any) -> WrapPolicy:
        """Normalize what a user passes to ``.wrap(...)``; raises a ConfigurationError otherwise."""
        if isinstance(spec, WrapPolicy):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, NoSplitModules):
            return cls(no_split=True)
        if spec is NoSplitModules:
            raise _wrap_error(
                "the class NoSplitModules was given, not an instance of it",
                "Call it: `.wrap(NoSplitModules())`.",
            )
        if isinstance(spec, _Policy):
            return cls(torch_policy=spec)
        if _is_module_class(spec):
            return cls(classes=(spec,))
        if isinstance(spec, type):
            raise _wrap_error(
                f"the class {spec.__name__} is not an nn.Module subclass",
                "Pass module classes such as `.wrap(TransformerBlock)` (the classes whose "
                "instances become units), or a callable (module, fqn) -> bool.",
            )
        if isinstance(spec, Iterable) and not isinstance(spec, str | bytes | Mapping | nn.Module):
            items = list(spec)  # taken once: a generator is empty the second time
            bad = [repr(i) for i in items if not _is_module_class(i)]
            if not items or bad:
                raise _wrap_error(
                    f"expected nn.Module subclasses, got {', '.join(bad) or 'an empty collection'}",
                    "Pass module classes such as `.wrap(TransformerBlock)`.",
                )
            return cls(classes=tuple(items))
        if callable(spec):
            if _is_legacy_policy(spec):
                return cls(legacy_policy=spec)
            _check_predicate_arity(spec)
            return cls(predicate=spec)
        raise _wrap_error(
            f"{type(spec).__name__} is not a wrap policy",
            "Pass module classes, a callable (module, fqn) -> bool, or a torch wrap policy "
            "(ModuleWrapPolicy, CustomPolicy, or a callable such as "
            "partial(transformer_auto_wrap_policy, ...)).",
        )

    def is_default(self) -> bool:
        return self == WrapPolicy()

    def select(
        self,
        root: nn.Module,
        ignored_modules: frozenset[nn.Module],
        named: NamedModules | None = None,
    ) -> set[nn.Module]:
        """The modules of ``root`` (root excluded) that this policy makes units. Raises when
        module classes are given and the model has none of them."""
        if self.no_split or self.is_default():
            named = list(root.named_modules()) if named is None else named
            declared = no_split_class_names(root, named)
            if self.no_split or declared:
                return self._select_no_split(root, ignored_modules, named, declared)
        if self.torch_policy is not None:
            # torch's policies answer for a root; their target kwargs are FSDP1 overrides we
            # do not apply per unit, so only the selected modules matter here.
            chosen = self.torch_policy._run_policy(root, set(ignored_modules), {})
            return {m for m in chosen if m is not root}
        if self.legacy_policy is not None:
            return _legacy_select(root, self.legacy_policy, ignored_modules)
        # torch's and legacy policies walk the model themselves: the list is taken only here.
        named = list(root.named_modules()) if named is None else named
        if self.is_default():
            warn_one_unit(root, ignored_modules, named)
            return set()
        selected = self._chosen(root, ignored_modules, named)
        _refuse_called_outside(selected, named)
        return selected

    def _chosen(
        self, root: nn.Module, ignored_modules: frozenset[nn.Module], named: NamedModules
    ) -> set[nn.Module]:
        """The modules the classes or the predicate choose."""
        selected: set[nn.Module] = set()
        # Whether the model has a module of the classes at all (the root and ignored ones too):
        # none at all is a policy written for another model.
        has_class = False
        for fqn, module in named:
            if self.classes and isinstance(module, self.classes):
                has_class = True
                if module is not root and module not in ignored_modules:
                    selected.add(module)
            elif module is root or module in ignored_modules:
                continue
            elif self.predicate is not None and self.predicate(module, fqn):
                selected.add(module)
        if self.classes and not has_class:
            raise _wrap_error(
                f"no module of {type(root).__name__} is a "
                f"{' or '.join(c.__name__ for c in self.classes)}, so the model would be one unit",
                _wrap_fix(root),
            )
        return selected

    def _select_no_split(
        self,
        root: nn.Module,
        ignored_modules: frozenset[nn.Module],
        named: NamedModules,
        declared: tuple[str, ...],
    ) -> set[nn.Module]:
        names = set(declared)
        classes = tuple(dict.fromkeys(type(m) for _, m in named if type(m).__name__ in names))
        if not classes:
            raise _wrap_error(
                f"NoSplitModules() found no module of the classes "
                f"{list(declared) or '(none declared)'} that "
                f"{type(root).__name__}._no_split_modules names",
                _wrap_fix(root),
            )
        picked = WrapPolicy(classes=classes)._chosen(root, ignored_modules, named)
        # A block tied to a parameter outside it (BERT's MLM decoder) cannot be a unit of its
        # own: its parent keeps it, as Accelerate leaves tied modules to the root. Nor can a
        # block whose parts the model's forward calls itself (DiT's first block).
        tied = _tied_outside(named, picked)
        called = {m: n for m, n in called_outside_blocks(named).items() if m in picked}
        build_logger(__name__).info(
            "wrap_no_split_modules",
            classes=[c.__name__ for c in classes],
            explicit=self.no_split,
            left_to_parent=sorted({*tied.values(), *called.values()}),
        )
        chosen = picked - set(tied) - set(called)
        if not chosen and self.is_default():
            warn_one_unit(root, ignored_modules, named)
        return chosen

    def overrides(
        self, root: nn.Module, ignored_modules: frozenset[nn.Module]
    ) -> dict[nn.Module, dict[str, Any]]:
        """The per-unit kwargs a torch ``CustomPolicy`` returns. One for the root is refused:
        FSDP1's auto-wrap would silently drop it."""
        if self.torch_policy is None:
            return {}
        chosen = self.torch_policy._run_policy(root, set(ignored_modules), {})
        found = {m: dict(kwargs) for m, kwargs in chosen.items() if kwargs}
        if root in found:
            raise _wrap_error(
                f"{type(self.torch_policy).__name__} returned overrides "
                f"{sorted(found[root])} for the root module, which FullyShardedDataParallel's "
                "auto-wrap ignores",
                "Return True (or False) for the root and set the root's options on the builder "
                "(or through per_unit(...)).",
            )
        return found

    def describe(self) -> str:
        if self.no_split:
            return "NoSplitModules"
        if self.torch_policy is not None:
            return type(self.torch_policy).__name__
        if self.legacy_policy is not None:
            func = getattr(self.legacy_policy, "func", self.legacy_policy)
            return getattr(func, "__name__", "policy")
        if self.classes:
            return ",".join(c.__name__ for c in self.classes)
        if self.predicate is not None:
            return getattr(self.predicate, "__name__", "predicate")
        return "root-only"


# Above this many bytes of parameters, a model that would be one unit because nothing chose
# units (no .wrap, no _no_split_modules) is warned about: every rank would gather all of it.
ONE_UNIT_WARNING_BYTES = 8 * 2**20


def warn_one_unit(
    root: nn.Module, ignored_modules: frozenset[nn.Module], named: NamedModules
) -> None:
    """Warn (a ``one_unit_model`` event and a UserWarning) that ``root`` will be a single unit
    when its parameters, ignored ones aside, exceed :data:`ONE_UNIT_WARNING_BYTES`.

    A size-based default wrap (FSDP's ``size_based_auto_wrap_policy``) is not taken instead:
    its units cut through modules that share a parameter (a tied embedding and head, which the
    plan then refuses) and change with the threshold; which modules are blocks is the user's
    knowledge, so the warning names the classes that look like blocks."""
    ignored = {id(p) for m in ignored_modules for p in m.parameters()}
    params = {id(p): p for p in root.parameters() if id(p) not in ignored}
    size = sum(p.numel() * p.element_size() for p in params.values())
    if size <= ONE_UNIT_WARNING_BYTES:
        return
    model = type(root).__name__
    blocks = block_like_classes(root)
    example = f"`.wrap({blocks[0]})`" if blocks else "`.wrap(Block)`"
    looks = f" (classes of {model} that look like blocks: {', '.join(blocks[:6])})"
    looks = looks if blocks else ""
    build_logger(__name__).warning(
        "one_unit_model", model=model, parameter_bytes=size, block_like=blocks[:6]
    )
    warn_user(
        f"{model} ({size / 2**20:.1f} MiB of parameters) declares no _no_split_modules and no "
        f"`.wrap(...)` was given, so the whole model is one shard unit: every rank gathers all "
        f"of its parameters in forward and backward. Pass the classes of its blocks to "
        f"`.wrap(...)`, e.g. {example}{looks}, or a callable (module, fqn) -> bool; "
        "`.wrap(lambda module, fqn: False)` keeps one unit on purpose, without this warning."
    )


def _tied_outside(named: NamedModules, chosen: set[nn.Module]) -> dict[nn.Module, str]:
    """The modules of ``chosen`` holding a parameter also registered outside them, by name."""
    registrations = _registrations(m for _, m in named)
    names = {m: n for n, m in named}
    return {
        module: names.get(module, "?")
        for module in chosen
        if any(registrations[i] > n for i, n in _registrations(module.modules()).items())
    }


def _registrations(modules: Iterable[nn.Module]) -> Counter[int]:
    """How many times each parameter (by id) is registered in ``modules``."""
    return Counter(id(p) for m in modules for p in m._parameters.values() if p is not None)


def block_like_classes(model: nn.Module) -> list[str]:
    """Names of the classes that look like a model's blocks: those its ``_no_split_modules``
    names, then the classes of ``nn.ModuleList`` members, most frequent first."""
    counts = Counter(
        type(child).__name__
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for child in module
    )
    ranked = [name for name, _ in counts.most_common()]
    return list(dict.fromkeys([*no_split_class_names(model), *ranked]))


def _wrap_fix(model: nn.Module) -> str:
    blocks = block_like_classes(model)
    if not blocks:
        return "Pass classes of modules of this model, or a callable (module, fqn) -> bool."
    return (
        f"Classes of {type(model).__name__} that look like blocks: {', '.join(blocks[:6])}; "
        f"pass those, e.g. `.wrap({blocks[0]})`, or a callable (module, fqn) -> bool."
    )


def unit_overrides(
    module: nn.Module,
    fqn: str,
    from_policy: Mapping[str, Any],
    per_unit: PerUnitFn | None,
    where: str,
) -> dict[str, Any]:
    """One unit's overrides: the wrap policy's (``CustomPolicy``) and ``per_unit(module, fqn)``'s.
    The same argument from both is refused: each is set in one place."""
    merged = dict(from_policy)
    extra = None if per_unit is None else per_unit(module, fqn)
    if extra is None:
        return merged
    label = fqn or "<root>"
    if not isinstance(extra, Mapping):
        raise config_error(
            f"{where}.per_unit",
            "per_unit",
            f"the function returned {type(extra).__name__} for unit '{label}'",
            "Return a dict of arguments for the unit, or None for no override.",
        )
    both = sorted(set(extra) & set(merged))
    if both:
        raise config_error(
            f"{where}.per_unit",
            "per_unit",
            f"both the wrap policy and per_unit set {both} for unit '{label}'",
            "Set each per-unit argument in one place.",
        )
    merged.update(extra)
    return merged


def checkpoint_predicate(spec: Any) -> CheckpointPredicate:
    """Module classes or a ``(module, fqn)`` predicate, as a predicate."""

    def refused(problem: str) -> Exception:
        return config_error(
            "ShardingBuilder.activation_checkpointing",
            "policy",
            problem,
            "Pass module classes or a callable (module, fqn) -> bool.",
        )

    if isinstance(spec, _Policy) or (callable(spec) and _is_legacy_policy(spec)):
        raise refused("a torch wrap policy was given")
    try:
        policy = WrapPolicy.of(spec)
    except Exception as exc:
        raise refused(str(exc).split(": ", 1)[-1]) from exc
    if policy.predicate is not None:
        return policy.predicate
    if not policy.classes:
        raise refused("no module classes were given")
    return ChosenClasses(policy.classes)


@frozen
class ChosenClasses:
    """``.activation_checkpointing(classes)`` as a predicate: the modules of those classes.
    Ranks compare it (and messages name it) by its classes."""

    classes: tuple[type[nn.Module], ...]

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return isinstance(module, self.classes)


def checkpoint_unit(
    module: nn.Module, fqn: str, chosen: CheckpointPredicate, stop: frozenset[nn.Module]
) -> nn.Module:
    """Wrap the outermost modules of one unit that ``chosen`` selects in ``checkpoint_wrapper``,
    not entering sharded units or ``stop``. Returns the module to shard (the wrapper when the
    unit itself is chosen)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if chosen(module, fqn):
        return checkpoint_wrapper(module)

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            if child in stop or is_wrapped(child):
                continue
            child_fqn = f"{prefix}.{name}" if prefix else name
            if chosen(child, child_fqn):
                setattr(parent, name, checkpoint_wrapper(child))
            else:
                visit(child, child_fqn)

    visit(module, fqn)
    return module


def _check_predicate_arity(fn: Callable[..., Any]) -> None:
    """A predicate is called as ``fn(module, fqn)``: refuse one that cannot take those two
    positional arguments (a signature that cannot be read is accepted)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(nn.Module(), "")
    except TypeError as exc:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise _wrap_error(
            f"the predicate {name}{signature} cannot be called as {name}(module, fqn) ({exc})",
            "Pass a callable taking two arguments, the module and its fully-qualified name: "
            "e.g. `lambda module, fqn: isinstance(module, Block)`.",
        ) from None


def _is_legacy_policy(fn: Callable[..., Any]) -> bool:
    """FSDP1's callable policies take ``recurse`` and ``nonwrapped_numel``; predicates do not."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def _legacy_select(
    root: nn.Module, policy: Callable[..., bool], ignored_modules: frozenset[nn.Module]
) -> set[nn.Module]:
    """The modules FSDP1's recursive auto-wrap would wrap with ``policy``, without wrapping."""
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    selected: set[nn.Module] = set()

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(
            visit(child, False) for child in module.children() if child not in ignored_modules
        )
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            selected.add(module)
            return numel
        return wrapped

    visit(root, True)
    return selected


__all__ = [
    "ONE_UNIT_WARNING_BYTES",
    "ChosenClasses",
    "NoSplitModules",
    "WrapPolicy",
    "block_like_classes",
    "called_outside_blocks",
    "diffusers_block_names",
    "is_diffusers_model",
    "no_split_class_names",
    "WrapPredicate",
    "checkpoint_predicate",
    "checkpoint_unit",
    "unit_overrides",
    "warn_one_unit",
]
