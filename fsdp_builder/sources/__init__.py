"""Checkpoint sources: one protocol for reading a checkpoint whatever its format, a registry of
formats users extend with :func:`register_format`, and rules reading checkpoints laid out
differently from the model (per-expert tensors merged into fused ones), chosen by the model's
``model_type`` and extended with :func:`register_checkpoint_rules`."""

from fsdp_builder.sources.base import (
    CheckpointSource,
    FillsTargets,
    Index,
    MissingPath,
    ReadsInto,
    SourceError,
    TensorMeta,
)
from fsdp_builder.sources.derived import DerivedSource, MergeExperts, Rename, Rule, derive
from fsdp_builder.sources.model_rules import (
    checkpoint_rules,
    register_checkpoint_rules,
    unregister_checkpoint_rules,
)
from fsdp_builder.sources.registry import (
    Format,
    formats,
    open_source,
    register_format,
    unregister_format,
    wrapping_sources,
)

__all__ = [
    "CheckpointSource",
    "DerivedSource",
    "MergeExperts",
    "Rename",
    "Rule",
    "checkpoint_rules",
    "derive",
    "register_checkpoint_rules",
    "unregister_checkpoint_rules",
    "FillsTargets",
    "Format",
    "Index",
    "MissingPath",
    "ReadsInto",
    "SourceError",
    "TensorMeta",
    "formats",
    "open_source",
    "register_format",
    "unregister_format",
    "wrapping_sources",
]
