"""Safetensors checkpoints: one ``.safetensors`` file, or a Hugging Face folder whose
``*.safetensors.index.json`` says which shard file holds each tensor (``save_pretrained``).

Only headers are read when a source opens; values are read per tensor, or per slice of rows
(``get_slice``), so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from fsdp_builder.sources.base import Index, SourceError, TensorMeta, listed

log = structlog.get_logger(__name__)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsSource:
    """Tensors spread over safetensors files; every file stays open (mapped) until close()."""

    def __init__(self, describe: str, files: Mapping[Path, list[str] | None]) -> None:
        """``files``: each file with the keys to take from it (None: all it holds)."""
        from safetensors import safe_open

        self.describe = describe
        self._meta: dict[str, TensorMeta] = {}
        self._file_of: dict[str, Any] = {}
        self._handles: list[Any] = []
        absent_files = sorted(f.name for f in files if not f.is_file())
        if absent_files:
            raise SourceError(
                f"{describe} names shard file(s) that do not exist: {listed(absent_files)}"
            )
        absent: list[str] = []
        try:
            for file, keys in files.items():
                try:
                    handle = safe_open(str(file), framework="pt", device="cpu")
                except Exception as exc:
                    raise SourceError(_unreadable(describe, file, exc)) from exc
                self._handles.append(handle)
                present = list(handle.keys())
                wanted = present if keys is None else keys
                held = set(present)
                for key in wanted:
                    if key not in held:
                        absent.append(f"{key} (in {file.name})")
                        continue
                    piece = handle.get_slice(key)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise SourceError(
                            f"{describe} stores '{key}' as {piece.get_dtype()}, not supported"
                        )
                    self._meta[key] = TensorMeta(tuple(piece.get_shape()), dtype)
                    self._file_of[key] = handle
            if absent:
                raise SourceError(
                    f"{describe} has {len(absent)} key(s) in its index but not in their file: "
                    f"{listed(absent)}"
                )
        except BaseException:
            self.close()
            raise

    def tensors(self) -> Mapping[str, TensorMeta]:
        return self._meta

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        handle = self._file_of[key]
        if not index:
            tensor: torch.Tensor = handle.get_tensor(key)
            return tensor
        part: torch.Tensor = handle.get_slice(key)[index]
        return part

    def close(self) -> None:
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles = []
        self._file_of = {}


def _unreadable(describe: str, file: Path, exc: BaseException) -> str:
    detail = f"safetensors could not read it: {type(exc).__name__}: {exc}"
    if describe == f"'{file}'":
        return (
            f"{describe} is not a state dict ({detail}); it is truncated or not a safetensors file"
        )
    return (
        f"{describe} holds '{file.name}', which is truncated or not a safetensors file ({detail})"
    )


def index_of_shard(file: Path) -> Path | None:
    """The index in ``file``'s folder that lists ``file`` as one of several shards, if any."""
    for index in sorted(file.parent.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(weight_map, dict) and file.name in set(weight_map.values()):
            return index
    return None


def refuse_a_shard(file: Path) -> None:
    """One shard of a sharded checkpoint given instead of its folder: loading it alone would
    report most of the model as missing, which hides the actual mistake."""
    index = index_of_shard(file)
    if index is None:
        return
    count = len(set(json.loads(index.read_text())["weight_map"].values()))
    if count > 1:
        raise SourceError(
            f"'{file}' is one of the {count} shard files that '{index.name}' lists; pass the "
            f"folder '{file.parent}' (or the index) to load the whole checkpoint",
            fix=f"Pass the folder: '{file.parent}'",
        )


def open_file(path: Path) -> SafetensorsSource:
    """One ``.safetensors`` file (not one shard of several)."""
    refuse_a_shard(path)
    return SafetensorsSource(f"'{path}'", {path: None})


def read_weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map``: tensor name → shard file name."""
    where = f"'{index}'"
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"{where} is not readable JSON ({exc})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SourceError(f"{where} has no `weight_map` of tensor names to file names")
    return weight_map


def open_index(index: Path) -> SafetensorsSource:
    """A ``*.safetensors.index.json`` and the shard files it names."""
    files: dict[Path, list[str] | None] = {}
    for key, name in read_weight_map(index).items():
        keys = files.setdefault(index.parent / name, [])
        assert keys is not None
        keys.append(key)
    return SafetensorsSource(f"'{index}'", files)


def only_index(folder: Path, pattern: str) -> Path:
    """The one index matching ``pattern`` in ``folder``."""
    indexes = sorted(folder.glob(pattern))
    if len(indexes) > 1:
        raise SourceError(
            f"'{folder}' holds several indexes ({listed([i.name for i in indexes])}); pass the "
            "path of the one to load"
        )
    return indexes[0]


def is_index_folder(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors.index.json"))


def is_single_file_folder(path: Path) -> bool:
    return path.is_dir() and len(list(path.glob("*.safetensors"))) == 1


def open_index_folder(folder: Path) -> SafetensorsSource:
    return open_index(only_index(folder, "*.safetensors.index.json"))


def open_single_file_folder(folder: Path) -> SafetensorsSource:
    (file,) = folder.glob("*.safetensors")
    return SafetensorsSource(f"'{file}'", {file: None})


__all__ = [
    "SafetensorsSource",
    "index_of_shard",
    "is_index_folder",
    "is_single_file_folder",
    "only_index",
    "open_file",
    "open_index",
    "open_index_folder",
    "open_single_file_folder",
    "read_weight_map",
    "refuse_a_shard",
]
