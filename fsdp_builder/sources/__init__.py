"""Checkpoint sources: one protocol for reading a checkpoint, whatever its format, and a
registry of formats (safetensors files and Hugging Face folders, ``torch.save`` files and their
``.bin`` index folders, DCP folders, state dicts in memory) that users can extend with
:func:`register_format`; and rules that read a model's tensors out of checkpoints laid out
differently (per-expert tensors merged into a mixture-of-experts model's fused ones), chosen by
the model's ``model_type`` and extended with :func:`register_checkpoint_rules`."""

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
]
