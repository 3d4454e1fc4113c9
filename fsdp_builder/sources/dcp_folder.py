"""``torch.distributed.checkpoint`` (DCP) folders, read without collectives so that each rank
reads the chunks its own targets need. Opening checks every data file the metadata names, and
the ``.metadata`` pickle is read admitting only DCP's metadata classes (no code in it runs)."""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fsdp_builder.errors import MaterializationError
from fsdp_builder.sources.base import (
    Index,
    SourceError,
    TensorMeta,
    listed,
    not_a_file,
    require_file,
)
from fsdp_builder.sources.hf_safetensors import inside_folder
from fsdp_builder.versions import DCP_NO_DIST, require

# A failed DCP read raises CheckpointException, a BaseException rather than an Exception.
_READ_ERRORS = (Exception, CheckpointException)
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# DCP's storage record, by the name its pickles give it (a private class of torch's).
_RECORD = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_PATHS = ("Path", "PurePath", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
# Names outside the metadata module that DCP's metadata pickles refer to.
_ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of a layout by its name
    _RECORD,
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in _PATHS),
}


class RefusedGlobal(pickle.UnpicklingError):
    """A ``.metadata`` pickle referred to something that is no part of DCP's metadata."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        super().__init__(f"{module}.{name}")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global (a function to call, a class
    with a reduce of its own) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        elif module == _METADATA_MODULE:
            value = getattr(dcp_metadata, name, None)
            # Its own classes only: not what it imports (``Any``, ``Enum``...).
            if isinstance(value, type) and value.__module__ == _METADATA_MODULE:
                return value
        raise RefusedGlobal(module, name)


def read_metadata(folder: Path) -> Any:
    """The ``Metadata`` of the DCP folder ``folder``, unpickled with only DCP's metadata classes
    admitted (``RefusedGlobal`` for anything else)."""
    with open(folder / ".metadata", "rb") as file:
        return _MetadataUnpickler(file).load()


class _SafeReader(FileSystemReader):
    """``FileSystemReader`` with its metadata read by ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # What FileSystemReader.read_metadata does after its pickle.load.
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DCPSource:
    """A DCP folder: its metadata when opened, values per request."""

    def __init__(self, folder: Path) -> None:
        require(DCP_NO_DIST, "FromCheckpoint", "path")
        self.describe = f"the DCP folder '{folder}'"
        self.folder = folder
        require_file(folder / ".metadata")  # a named pipe would block its read forever
        try:
            metadata = _SafeReader(str(folder)).read_metadata()
        except RefusedGlobal as exc:
            raise SourceError(
                f"{self.describe} has a .metadata ('{folder / '.metadata'}') that refers to "
                f"`{exc.module}.{exc.name}`, which is no part of a DCP checkpoint's metadata: "
                "it was refused before anything it names was called, so no code in it ran",
                fix="Load only checkpoints from a source you trust; if you trust this one, "
                "save it again with torch.distributed.checkpoint.save",
            ) from exc
        except _READ_ERRORS as exc:
            raise SourceError(
                f"{self.describe} has an unreadable .metadata ({type(exc).__name__}: {exc})"
            ) from exc
        if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
            raise SourceError(
                f"{self.describe} has a .metadata that holds {type(metadata).__name__}, not "
                "the Metadata torch.distributed.checkpoint.save writes"
            )
        self._check_data_files(self._check_records(metadata))
        self._meta = {
            key: TensorMeta(tuple(item.size), item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, dcp_metadata.TensorStorageMetadata)
        }

    def _check_records(self, metadata: Any) -> dict[str, int]:
        """Every record of the metadata is of the type ``dcp.save`` writes and ``dcp.load``
        looks up, and every tensor chunk has its storage record; returns each data file named
        with the bytes it must hold at least. Unchecked, a malformed record passes the opening
        and fails inside ``dcp.load`` at the first unit, after the model was sharded."""
        where = f"{self.describe} has a .metadata ('{self.folder / '.metadata'}')"
        fix = "Save the checkpoint again with torch.distributed.checkpoint.save"

        def refuse(problem: str) -> SourceError:
            return SourceError(f"{where} {problem}", fix=fix)

        records = getattr(metadata, "storage_data", None)
        records = {} if records is None else records  # no data: each tensor chunk says so below
        if not isinstance(records, dict):
            raise refuse(
                f"whose storage records (storage_data) are {_shown(records)}, not the dict "
                "torch.distributed.checkpoint.save writes"
            )
        needed: dict[str, int] = {}
        for key, info in records.items():
            if not isinstance(key, dcp_metadata.MetadataIndex):
                raise refuse(
                    f"with a storage record key that is {_shown(key)}, not torch's MetadataIndex"
                )
            if (type(info).__module__, type(info).__qualname__) != _RECORD:
                raise refuse(
                    f"with the storage record of '{key.fqn}' that is {_shown(info)}, not "
                    f"torch's {_RECORD[1]}"
                )
            for field in ("offset", "length"):
                value = getattr(info, field, None)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise refuse(
                        f"with the storage record of '{key.fqn}' whose {field} is "
                        f"{_shown(value)}, not a count of bytes"
                    )
            descriptors = getattr(info, "transform_descriptors", None)
            if descriptors is not None and not (
                isinstance(descriptors, list | tuple)
                and all(isinstance(d, str) for d in descriptors)
            ):
                raise refuse(
                    f"with the storage record of '{key.fqn}' whose transform_descriptors are "
                    f"{_shown(descriptors)}, not a list of names"
                )
            relative = getattr(info, "relative_path", None)
            name = os.fspath(relative) if isinstance(relative, str | os.PathLike) else None
            if not isinstance(name, str):
                raise refuse(
                    f"that names the data file of '{key.fqn}' by {_shown(relative)}, not a "
                    "file name (a str or a path)"
                )
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
        for fqn, entry in metadata.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise refuse(f"whose entry names are {_shown(fqn)}, not a str")
            if isinstance(entry, dcp_metadata.BytesStorageMetadata):
                continue  # never requested: only tensor entries are read
            if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
                raise refuse(
                    f"whose entry '{fqn}' is {_shown(entry)}, not torch's TensorStorageMetadata "
                    "or BytesStorageMetadata"
                )
            problem = _tensor_entry_problem(entry)
            if problem is not None:
                raise refuse(f"whose entry '{fqn}' {problem}")
            for chunk in entry.chunks:
                if dcp_metadata.MetadataIndex(fqn, chunk.offsets) not in records:
                    raise refuse(
                        f"that has no storage record for the chunk at {list(chunk.offsets)} of "
                        f"'{fqn}' (dcp.load would fail looking for it)"
                    )
        return needed

    def _check_data_files(self, needed: dict[str, int]) -> None:
        """Every data file named (with the bytes it must hold) is inside the folder, a regular
        file, and that long."""
        # Judged on the name, made normal (``a/../..`` climbs out), not on the resolved path: a
        # folder of links to files kept elsewhere is a folder of its own files.
        outside = sorted(n for n in needed if not inside_folder(n))
        if outside:
            raise SourceError(
                f"{self.describe} has a .metadata that names data file(s) outside the folder: "
                f"{listed(outside)}; data files are read from the checkpoint's folder only",
                fix="Save the checkpoint again with torch.distributed.checkpoint.save, which "
                "names its data files inside the folder",
            )
        problems = {n: not_a_file(self.folder / n) for n in needed}
        absent = sorted(n for n, problem in problems.items() if problem == "does not exist")
        if absent:
            raise SourceError(
                f"{self.describe} lacks data file(s) its .metadata names: {listed(absent)}",
                fix="Copy the whole folder again (every *.distcp file dcp.save wrote), or "
                "save the checkpoint again",
            )
        others = sorted(f"{n} {problem}" for n, problem in problems.items() if problem)
        if others:
            raise SourceError(
                f"{self.describe} has data file(s) that cannot be read: "
                f"{listed(others, sep='; ')}; checkpoint files are read from regular files only",
                fix="Copy the whole folder again (every *.distcp file dcp.save wrote), or "
                "save the checkpoint again",
            )
        short = sorted(n for n, end in needed.items() if (self.folder / n).stat().st_size < end)
        if short:
            raise SourceError(
                f"{self.describe} has data file(s) shorter than its .metadata says (truncated): "
                f"{listed(short)}",
                fix="Copy the whole folder again, or save the checkpoint again",
            )

    def tensors(self) -> Mapping[str, TensorMeta]:
        return self._meta

    def fill(self, targets: Mapping[str, torch.Tensor]) -> None:
        """One ``dcp.load`` of the targets (DTensors: their local chunks only)."""
        if not targets:
            return
        # DCP copies into same-dtype targets only: read into staging of the checkpoint's dtype
        # where the model's differs.
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local part read, target)
        request: dict[str, torch.Tensor] = {}
        for key, target in targets.items():
            dtype = self._meta[key].dtype
            if target.dtype == dtype:
                request[key] = target
            elif isinstance(target, DTensor):
                local = torch.empty_like(target.to_local(), dtype=dtype)
                staged.append((local, target))
                request[key] = DTensor.from_local(
                    local,
                    target.device_mesh,
                    target.placements,
                    run_check=False,
                    shape=target.shape,
                    stride=target.stride(),
                )
            else:
                request[key] = torch.empty_like(target, dtype=dtype)
                staged.append((request[key], target))
        try:
            with torch.no_grad(), warnings.catch_warnings():
                # Reading without collectives is the point, not a fallback to warn about.
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(request, storage_reader=_SafeReader(str(self.folder)), no_dist=True)
        except _READ_ERRORS as exc:
            raise MaterializationError(
                f"{self.describe} could not be read: {type(exc).__name__}: {exc}"
            ) from exc
        with torch.no_grad():
            for read, target in staged:
                (target.to_local() if isinstance(target, DTensor) else target).copy_(read)

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        meta = self._meta[key]
        full = torch.empty(meta.shape, dtype=meta.dtype)
        self.fill({key: full})
        return full[index] if index else full

    def close(self) -> None:
        pass


def _shown(value: object) -> str:
    """``value`` as a refusal names it: its type and a short repr."""
    try:
        text = repr(value)
    except Exception:  # a record unpickled without a field its repr shows
        text = "(no repr)"
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _tensor_entry_problem(entry: dcp_metadata.TensorStorageMetadata) -> str | None:
    """What is wrong with a tensor entry's dtype, size or chunks, if anything."""
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return f"has the dtype {_shown(dtype)}, not a torch.dtype"
    size = getattr(entry, "size", None)
    if not _counts(size):
        return f"has the size {_shown(size)}, not a torch.Size"
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        return f"has chunks {_shown(chunks)}, not a list"
    for chunk in chunks:
        if not isinstance(chunk, dcp_metadata.ChunkStorageMetadata):
            return f"has a chunk that is {_shown(chunk)}, not torch's ChunkStorageMetadata"
        for field in ("offsets", "sizes"):
            value = getattr(chunk, field, None)
            if not _counts(value) or len(value) != len(size):
                return (
                    f"has a chunk whose {field} are {_shown(value)}, not {len(size)} counts "
                    "(one per dim)"
                )
    return None


def _counts(value: object) -> TypeGuard[tuple[int, ...]]:
    """Whether ``value`` is a tuple (``torch.Size`` included) of non-negative ints."""
    return isinstance(value, tuple) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def is_dcp_folder(path: Path) -> bool:
    # A .metadata that is no regular file (a named pipe) still marks the folder as DCP's, so
    # that the opening refuses it by name.
    metadata = path / ".metadata"
    return path.is_dir() and metadata.exists() and not metadata.is_dir()


__all__ = ["DCPSource", "RefusedGlobal", "is_dcp_folder", "read_metadata"]
