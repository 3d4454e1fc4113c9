"""Checkpoint sources: one protocol for reading a checkpoint, whatever its format, and a
registry of formats (safetensors files and Hugging Face folders, ``torch.save`` files and their
``.bin`` index folders, DCP folders, state dicts in memory) that users can extend with
:func:`register_format`."""

from fsdp_builder.sources.base import (
    CheckpointSource,
    FillsTargets,
    Index,
    MissingPath,
    SourceError,
    TensorMeta,
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
    "FillsTargets",
    "Format",
    "Index",
    "MissingPath",
    "SourceError",
    "TensorMeta",
    "formats",
    "open_source",
    "register_format",
    "unregister_format",
]
