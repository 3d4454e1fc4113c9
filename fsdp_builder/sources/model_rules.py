"""Which derived-tensor rules a model's checkpoints get, by its ``config.model_type``: rules
registered with :func:`register_checkpoint_rules`, else transformers' own conversion mapping
(its renames always; a converter this library cannot apply refuses only the keys it acts on),
else the built-in Mixtral and Qwen-MoE rules."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from attrs import field, frozen

from fsdp_builder.common.logs import get_logger
from fsdp_builder.errors import config_error
from fsdp_builder.sources.base import SourceError, listed
from fsdp_builder.sources.derived import MergeExperts, Rename, Rule

log = get_logger(__name__)

_MIXTRAL: tuple[Rule, ...] = (
    Rename(r"\.block_sparse_moe\.", ".mlp."),
    MergeExperts((".experts.*.w1.weight", ".experts.*.w3.weight"), ".experts.gate_up_proj", 1),
    MergeExperts((".experts.*.w2.weight",), ".experts.down_proj"),
)
_QWEN_MOE: tuple[Rule, ...] = (
    MergeExperts(
        ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
        "mlp.experts.gate_up_proj",
        1,
    ),
    MergeExperts(("mlp.experts.*.down_proj.weight",), "mlp.experts.down_proj"),
)
_BUILT_IN: dict[str, tuple[Rule, ...]] = {
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
}
_USER: dict[str, tuple[Rule, ...]] = {}


def register_checkpoint_rules(model_type: str, rules: Iterable[Rule]) -> None:
    """Read the checkpoints of models whose ``config.model_type`` is ``model_type`` through
    ``rules`` (:class:`~fsdp_builder.sources.derived.Rename` and
    :class:`~fsdp_builder.sources.derived.MergeExperts`, applied renames first); they replace
    what transformers' mapping or the built-in rules would give. An empty sequence turns
    derivation off for that model type. Any iterable of rules is taken (once). Register on
    every rank before the build: ranks compare their registered rules in the configure stage.

    Raises:
        ConfigurationError: ``model_type`` is not a non-empty string, ``rules`` is not an
            iterable of rules (None, a string, a single rule), or a rule is neither a
            ``Rename`` nor a ``MergeExperts``.

    Example:
        ```python
        register_checkpoint_rules("my_moe", [
            Rename(r"\\.moe\\.", ".mlp."),
            MergeExperts((".experts.*.w_in.weight",), ".experts.up_proj"),
        ])
        ```
    """
    if not isinstance(model_type, str) or not model_type:
        raise config_error(
            "register_checkpoint_rules",
            "model_type",
            f"expected a model type such as 'mixtral', got {model_type!r}",
            "Pass the model's config.model_type",
        )
    fix = "Pass a list such as [Rename(r'\\.moe\\.', '.mlp.')] (an empty list turns derivation off)"
    rules_error = partial(config_error, "register_checkpoint_rules", "rules", fix=fix)
    if isinstance(rules, str | bytes | Rename | MergeExperts) or not isinstance(rules, Iterable):
        raise rules_error(
            f"expected a sequence of Rename and MergeExperts rules, got {type(rules).__name__} "
            f"{rules!r}"
        )
    items = tuple(rules)  # taken once: a generator would be empty the second time
    bad = [r for r in items if not isinstance(r, Rename | MergeExperts)]
    if bad:
        raise rules_error(
            f"expected Rename and MergeExperts rules, got {type(bad[0]).__name__} {bad[0]!r}"
        )
    _USER[model_type] = items
    log.debug("checkpoint_rules_registered", model_type=model_type, rules=len(items))


def registered_rules() -> dict[str, tuple[Rule, ...]]:
    """The rules registered with :func:`register_checkpoint_rules`, by model type."""
    return dict(_USER)


def unregister_checkpoint_rules(model_type: str) -> None:
    """Forget the rules registered for ``model_type`` (the other sources of rules stay)."""
    _USER.pop(model_type, None)


@frozen
class _Transformers(Rename):
    """One of transformers' renames, applied by transformers itself: its scope (a sub-model's
    prefix, with or without the base model's), capture groups and name boundaries are then
    exactly as ``from_pretrained`` reads them. ``pattern``/``replacement`` only describe it."""

    transform: Any = field(default=None, eq=False, repr=False)

    def apply(self, name: str) -> str:
        renamed, _ = self.transform.rename_source_key(name)
        return str(renamed)


@frozen
class _Unexpressed(Rename):
    """Transformers' converters in their order, some of which this loader cannot apply
    (``unexpressed``): a name the first matching converter of which is one of those is refused,
    naming the converter; every other name is kept. It comes after every rename, as the
    converters act on renamed names in transformers too."""

    converters: tuple[Any, ...] = field(default=(), eq=False, repr=False)
    unexpressed: frozenset[int] = field(default=frozenset(), eq=False, repr=False)
    model: str = ""

    def apply(self, name: str) -> str:
        for i, converter in enumerate(self.converters):
            if converter.rename_source_key(name)[1] is None:
                continue
            if i in self.unexpressed:
                raise SourceError(
                    f"holds '{name}', which transformers' conversion mapping for {self.model} "
                    f"converts into {listed([repr(t) for t in converter.target_patterns])} with "
                    f"{_describe(converter)}; this loader cannot apply that transform (every "
                    f"key matching {listed([repr(s) for s in converter.source_patterns])} "
                    "needs it)",
                    fix="Load the folder with transformers' from_pretrained and pass the "
                    "model's state_dict() to FromCheckpoint, or save the tensors under the "
                    "model's own names (torch.save or safetensors of its state_dict())",
                )
            break
        return name


def _describe(converter: Any) -> str:
    ops = ", ".join(repr(op) for op in getattr(converter, "operations", ())) or "no operation"
    scope = getattr(converter, "scope_prefix", None)
    where = f" within '{scope}'" if scope else ""
    return f"{type(converter).__name__}({ops}){where}"


def _merge(t: Any, merge_list: Any, concatenate: Any) -> MergeExperts | None:
    """A converter as a MergeExperts rule; None where it is not one (or is scoped to a
    sub-model, which MergeExperts cannot express)."""
    sources, targets = list(t.source_patterns), list(t.target_patterns)
    if getattr(t, "scope_prefix", None) or len(targets) != 1:
        return None
    ops = list(t.operations)
    originals = list(getattr(t, "_original_source_patterns", sources))
    stacked = bool(ops) and type(ops[0]) is merge_list and ops[0].dim == 0
    if not stacked or any(s.count("*") != 1 for s in originals):
        return None
    last = ops[-1]
    if len(originals) == 1 and len(ops) == 1:
        return MergeExperts((originals[0],), targets[0])
    if len(originals) > 1 and len(ops) == 2 and type(last) is concatenate and last.dim >= 1:
        return MergeExperts(tuple(originals), targets[0], last.dim)
    return None


def _from_transformers(model: Any) -> tuple[Rule, ...] | None:
    """transformers' conversion mapping for ``model`` as rules (None if it has none): every
    rename, prefix changes among them; the converters that stack experts as MergeExperts; and
    a check that refuses a name only where a converter this loader cannot apply would act on
    it. A transform that is neither a rename nor a converter leaves the mapping out (as before
    transformers had such transforms): nothing partial is applied then."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
        )

        transforms = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # an older transformers, or a model it does not know
        return None
    renames: list[Rule] = []
    merges: list[Rule] = []
    converters: list[Any] = []
    unexpressed: set[int] = set()
    for t in transforms:
        if isinstance(t, WeightRenaming):
            renames.append(_Transformers(t.compiled_sources.pattern, str(t.target_patterns[0]), t))
        elif isinstance(t, WeightConverter):
            merge = _merge(t, MergeModulelist, Concatenate)
            if merge is None:
                unexpressed.add(len(converters))
            else:
                merges.append(merge)
            converters.append(t)
        else:
            log.debug("conversion_mapping_skipped", transform=type(t).__name__)
            return None
    if unexpressed:
        check = _Unexpressed(
            "", "", tuple(converters), frozenset(unexpressed), type(model).__name__
        )
        renames.append(check)
    return (*renames, *merges)


def checkpoint_rules(model: Any, *, complete: bool = False) -> tuple[Rule, ...]:
    """The rules ``model``'s checkpoints are read through (empty: as they are). ``complete``:
    the checkpoint holds every state under the model's own name, so only registered rules
    apply (building transformers' mapping costs a good part of a second)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        return ()
    if model_type in _USER:
        return _USER[model_type]
    if complete:
        return ()
    found = _from_transformers(model)
    return found if found is not None else _BUILT_IN.get(model_type, ())


__all__ = [
    "checkpoint_rules",
    "register_checkpoint_rules",
    "registered_rules",
    "unregister_checkpoint_rules",
]
