"""``torch.distributed.checkpoint`` (DCP) folders, read without collectives so that each rank
reads the chunks its own targets need. Opening checks every data file the metadata names, and
the ``.metadata`` pickle is read admitting only DCP's metadata classes (no code in it runs)."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fsdp_builder.errors import MaterializationError
from fsdp_builder.sources.base import Index, SourceError, TensorMeta, listed
from fsdp_builder.sources.hf_safetensors import inside_folder
from fsdp_builder.versions import DCP_NO_DIST, require

# A failed DCP read raises CheckpointException, a BaseException rather than an Exception.
_READ_ERRORS = (Exception, CheckpointException)
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PATHS = ("Path", "PurePath", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
# Names outside the metadata module that DCP's metadata pickles refer to.
_ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of a layout by its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
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
        self._check_data_files(metadata)
        self._meta = {
            key: TensorMeta(tuple(item.size), item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, dcp_metadata.TensorStorageMetadata)
        }

    def _check_data_files(self, metadata: object) -> None:
        """Every data file the metadata names exists and holds the bytes it points to."""
        needed: dict[str, int] = {}
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", None)
            if isinstance(name, str):
                end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
                needed[name] = max(needed.get(name, 0), end)
        outside = sorted(n for n in needed if not inside_folder(n))
        if outside:
            raise SourceError(
                f"{self.describe} has a .metadata that names data file(s) outside the folder: "
                f"{listed(outside)}; data files are read from the checkpoint's folder only",
                fix="Save the checkpoint again with torch.distributed.checkpoint.save, which "
                "names its data files inside the folder",
            )
        absent = sorted(n for n in needed if not (self.folder / n).is_file())
        if absent:
            raise SourceError(
                f"{self.describe} lacks data file(s) its .metadata names: {listed(absent)}",
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


def is_dcp_folder(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


__all__ = ["DCPSource", "RefusedGlobal", "is_dcp_folder", "read_metadata"]
