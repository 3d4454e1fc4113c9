"""Which derived-tensor rules a model's checkpoints get, by its ``config.model_type``: rules
registered with :func:`register_checkpoint_rules`, else transformers' own conversion mapping
where this library can express it, else the built-in Mixtral and Qwen-MoE rules."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from fsdp_builder.common.logs import get_logger
from fsdp_builder.errors import config_error
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


def _from_transformers(model: Any) -> tuple[Rule, ...] | None:
    """transformers' conversion mapping for ``model`` as rules; None if it has none or some
    transform in it cannot be expressed."""
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
    rules: list[Rule] = []
    for t in transforms:
        sources, targets = list(t.source_patterns), list(t.target_patterns)
        if getattr(t, "scope_prefix", None) or len(targets) != 1:
            return None
        if type(t) is WeightRenaming and len(sources) == 1:
            rules.append(Rename(sources[0], targets[0]))
            continue
        if type(t) is not WeightConverter:
            return None
        ops = list(t.operations)
        originals = list(getattr(t, "_original_source_patterns", sources))
        stacked = bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
        if not stacked or any(s.count("*") != 1 for s in originals):
            return None
        last = ops[-1]
        if len(originals) == 1 and len(ops) == 1:
            rules.append(MergeExperts((originals[0],), targets[0]))
        elif len(originals) > 1 and len(ops) == 2 and type(last) is Concatenate and last.dim >= 1:
            rules.append(MergeExperts(tuple(originals), targets[0], last.dim))
        else:
            return None
    return tuple(rules)


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
