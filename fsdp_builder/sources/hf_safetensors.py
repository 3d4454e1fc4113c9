"""Safetensors checkpoints: one ``.safetensors`` file, or a Hugging Face folder whose
``*.safetensors.index.json`` says which shard file holds each tensor (``save_pretrained``).

Only headers are read when a source opens. Values are read with positional reads (``preadv``)
of the byte range a read needs, straight into the destination's storage where it can take them
(:meth:`SafetensorsSource.read_into`): a rank reads only the bytes it keeps, maps no file (its
file-backed memory stays flat) and copies each byte once.

The format: 8 bytes (little-endian ``u64``) give the header's length; the header is JSON, each
tensor's ``dtype``, ``shape`` and ``data_offsets`` (begin, end in bytes, counted from the end of
the header), plus an optional ``__metadata__``; then the data, row-major and little-endian.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path, PurePath

import torch
from attrs import frozen

from fsdp_builder.common.logs import get_logger
from fsdp_builder.sources.base import Index, SourceError, TensorMeta, listed

log = get_logger(__name__)

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
# A header larger than this is not one (the format's own readers refuse past 100 MB).
_MAX_HEADER = 100 * 2**20
# One preadv moves at most about 2 GiB on Linux: larger reads are split.
_MAX_READ = 1 << 30


class HeaderError(ValueError):
    """A file's header is not that of a safetensors file."""


@frozen
class _Stored:
    """Where one tensor lies: its file, dtype, shape and first byte in the file."""

    file: int  # the index of its file's descriptor
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def _read_exact(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill ``buffer`` with the bytes of ``fd`` from ``offset`` on; a short file raises."""
    done, size = 0, len(buffer)
    while done < size:
        chunk = buffer[done : min(size, done + _MAX_READ)]
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [chunk], offset + done)
        else:  # no preadv (older macOS): seek and read; each source reads from one thread
            os.lseek(fd, offset + done, os.SEEK_SET)
            got = os.readv(fd, [chunk])
        if got <= 0:
            raise OSError(f"the file ends {size - done} byte(s) before the tensor does")
        done += got


def _header(fd: int, size: int) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Per tensor of a file: its dtype name, shape, first byte (from the start of the file) and
    length in bytes. Raises HeaderError when the file is not a complete safetensors file: a
    header that is not JSON of tensors, or offsets past the end of the file."""
    if size < 8:
        raise HeaderError(f"{size} byte(s) are too few for a header")
    head = bytearray(8)
    _read_exact(fd, memoryview(head), 0)
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, _MAX_HEADER):
        raise HeaderError(f"its header claims {length} bytes, more than the file holds")
    text = bytearray(length)
    _read_exact(fd, memoryview(text), 8)
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise HeaderError(f"its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise HeaderError("its header is not a JSON object")
    start = 8 + length
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end))
                and begin <= end
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise HeaderError(f"its header entry for '{key}' is not a tensor's: {info!r}")
        if start + end > size:
            raise HeaderError(f"'{key}' ends past the end of the file")
        entries[key] = (dtype, tuple(shape), start + begin, end - begin)
    return entries


class SafetensorsSource:
    """Tensors spread over safetensors files; every file stays open until close()."""

    def __init__(self, describe: str, files: Mapping[Path, list[str] | None]) -> None:
        """``files``: each file with the keys to take from it (None: all it holds)."""
        self.describe = describe
        self._meta: dict[str, TensorMeta] = {}
        self._stored: dict[str, _Stored] = {}
        self._fds: list[int] = []
        absent_files = sorted(f.name for f in files if not f.is_file())
        if absent_files:
            raise SourceError(
                f"{describe} names shard file(s) that do not exist: {listed(absent_files)}"
            )
        if sys.byteorder != "little":
            raise SourceError(
                f"{describe} holds little-endian values and this machine is {sys.byteorder}-"
                "endian; safetensors files are read here only on little-endian machines"
            )
        absent: list[str] = []
        try:
            for file, keys in files.items():
                fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds.append(fd)
                try:
                    entries = _header(fd, os.fstat(fd).st_size)
                except (HeaderError, OSError) as exc:
                    raise SourceError(_unreadable(describe, file, exc)) from exc
                wanted = list(entries) if keys is None else keys
                for key in wanted:
                    if key not in entries:
                        absent.append(f"{key} (in {file.name})")
                        continue
                    name, shape, offset, length = entries[key]
                    dtype = _DTYPES.get(name)
                    if dtype is None:
                        raise SourceError(f"{describe} stores '{key}' as {name}, not supported")
                    if length != math.prod(shape) * dtype.itemsize:
                        problem = HeaderError(
                            f"'{key}' ({name} {list(shape)}) has {length} bytes, not "
                            f"{math.prod(shape) * dtype.itemsize}"
                        )
                        raise SourceError(_unreadable(describe, file, problem))
                    self._meta[key] = TensorMeta(shape, dtype)
                    self._stored[key] = _Stored(len(self._fds) - 1, dtype, shape, offset)
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
        stored = self._stored[key]
        shape, span = _span(stored.shape, index)
        out = torch.empty(shape, dtype=stored.dtype)
        self._fill(stored, shape, span, out)
        return out

    def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """Write ``tensor[index]`` into ``out`` (its shape; any dtype, converted). The bytes go
        straight into ``out`` when it is a contiguous CPU tensor of the stored dtype."""
        stored = self._stored[key]
        shape, span = _span(stored.shape, index)
        if tuple(out.shape) != shape:
            raise ValueError(
                f"'{key}'{_shown(index)} is {list(shape)}, the destination {list(out.shape)}"
            )
        if out.dtype == stored.dtype and out.device.type == "cpu" and out.is_contiguous():
            self._fill(stored, shape, span, out)
        else:
            temp = torch.empty(shape, dtype=stored.dtype)
            self._fill(stored, shape, span, temp)
            out.copy_(temp)

    def _fill(
        self, stored: _Stored, shape: tuple[int, ...], span: _Span, out: torch.Tensor
    ) -> None:
        """Read the selection ``span`` describes into the contiguous ``out`` (stored dtype)."""
        if not out.numel():
            return
        fd = self._fds[stored.file]
        item = stored.dtype.itemsize
        first, count, strides = span
        if count == out.numel():  # the selection is one run of bytes: read it in place
            _read_exact(fd, _bytes_of(out), stored.offset + first * item)
            return
        covering = torch.empty(count, dtype=stored.dtype)
        _read_exact(fd, _bytes_of(covering), stored.offset + first * item)
        out.copy_(covering.as_strided(shape, strides))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._stored = {}


# A selection of a row-major tensor: its first element, the elements from the first to the last
# (their count), and its strides within that run.
_Span = tuple[int, int, tuple[int, ...]]


def _span(shape: tuple[int, ...], index: Index | None) -> tuple[tuple[int, ...], _Span]:
    """The shape of ``tensor[index]`` and where its elements lie."""
    index = index or ()
    if len(index) > len(shape):
        raise IndexError(f"{len(index)} slices for a tensor of {len(shape)} dim(s)")
    sizes: list[int] = []
    strides: list[int] = []
    first = last = 0
    stride = 1
    for d in reversed(range(len(shape))):
        start, stop, step = index[d].indices(shape[d]) if d < len(index) else (0, shape[d], 1)
        if step < 1:
            raise ValueError(f"a safetensors read takes slices with a positive step, got {step}")
        length = max(0, math.ceil((stop - start) / step))
        sizes.append(length)
        strides.append(stride * step)
        first += start * stride
        last += (start + (length - 1) * step) * stride
        stride *= shape[d]
    sizes.reverse()
    strides.reverse()
    count = last - first + 1 if math.prod(sizes) else 0
    return tuple(sizes), (first, count, tuple(strides))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def _shown(index: Index | None) -> str:
    if not index:
        return ""
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"


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
    for key, name in weight_map.items():
        if not inside_folder(name):
            raise SourceError(
                f"{where} names the shard file '{name}' for '{key}', which lies outside the "
                f"index's folder '{index.parent}'; shard files are read from that folder only",
                fix="Put the shard files next to the index and name each by its file name in "
                "`weight_map` (e.g. 'model-00001-of-00002.safetensors')",
            )
    return weight_map


def inside_folder(name: str) -> bool:
    """Whether the relative file name ``name`` (from a checkpoint's own listing) stays inside
    the folder it is relative to. Checked on the name, not on the resolved path: a folder of
    links to files elsewhere (the Hugging Face cache's snapshots) is a folder of its own files,
    while an absolute name or one that climbs out with ``..`` reads what the folder's owner did
    not put there."""
    path = PurePath(name)
    climbs = PurePath(os.path.normpath(path)).parts[:1] == ("..",)
    return bool(name) and not path.is_absolute() and not climbs


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
    "inside_folder",
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
