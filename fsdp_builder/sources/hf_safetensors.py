"""Safetensors checkpoints: one ``.safetensors`` file, or a Hugging Face folder whose
``*.safetensors.index.json`` says which shard file holds each tensor, opened with safetensors'
own ``safe_open``: every dtype it reads, only the rows asked for. Whole rows of a dtype whose
stored bytes are torch's own go straight into the destination with positional reads (``preadv``);
the rest is read through ``get_slice``."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from pathlib import Path, PurePath
from typing import Any

import safetensors
import torch
from safetensors import safe_open

from fsdp_builder.common.logs import get_logger
from fsdp_builder.runtime.fast_storage import libc_madvise as _madvise
from fsdp_builder.sources.base import (
    Index,
    SourceError,
    TensorMeta,
    listed,
    not_a_file,
    require_file,
    rows,
)

log = get_logger(__name__)

# safe_open maps its file (privately, never written) and its slices view the mapping: the pages
# a read touches count as the process's memory until they are dropped. Where the mapping can be
# told (Linux, /proc/self/maps), a source copies a read in runs of rows of at most _RUN_BYTES and
# drops the mapping's pages with madvise(MADV_DONTNEED) after each: the page cache keeps the
# data, and unwritten pages of a private file mapping fault back in from it. Elsewhere it unmaps
# the files read from after _MAPPED_BYTES read (they reopen at their next read; a smaller budget
# is slower). Either way a rank's mapped pages stay near that bound instead of its whole share of
# the checkpoint (benchmarks/results/file_pages.md).
_MAPPED_BYTES = 16 << 20
_RUN_BYTES = 2 << 20
_MADV_DONTNEED = 4
_HUGE = 2 << 20
_PAGE = mmap.PAGESIZE

# Reads of whole rows into a contiguous CPU tensor of the stored dtype skip all of that: they are
# positional reads of the rows' bytes into the destination, which map nothing and copy each byte
# once. A read through a mapping costs a page fault per page touched, and again after each drop:
# ten times the CPU time of the positional read (benchmarks/results/against-293e813.md).
# safe_open(..., backend="pread") is no substitute: its get_slice reads the whole tensor for
# any slice of it (safetensors 0.8), so each rank would read the whole checkpoint.
# The dtypes whose stored bytes are torch's own, on a little-endian machine, by their names.
_PLAIN = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
# One read(2) moves at most about 2 GiB on Linux: larger reads are split.
_MAX_READ = 1 << 30
# A read into a tensor of another dtype or layout goes through a buffer of at most this many bytes.
_BUFFER_BYTES = 16 << 20
# Where positional reads into a buffer exist and stored bytes are in the machine's order.
_POSITIONAL = hasattr(os, "preadv") and sys.byteorder == "little"

# Sources opened while a recorder is set (a dry run's, ``fsdp_builder.tools.dryrun``) hand it
# each read (file, key, index) and make none; the read returns an uninitialized tensor.
RECORDER: ContextVar[Callable[[Path, str, Index | None], None] | None] = ContextVar(
    "safetensors_recorder", default=None
)


def _file_mapping(path: Path, address: int) -> tuple[int, int] | None:
    """The address range of the mapping of the file ``path`` that holds ``address``: the run of
    /proc/self/maps entries naming that file (its device and inode, or its resolved path) around
    it. None where there is none, or no such listing."""
    try:
        stat = os.stat(path)
        with open("/proc/self/maps") as maps:
            entries = maps.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"
    real = os.path.realpath(path)
    run: tuple[int, int] | None = None
    for entry in entries:
        fields = entry.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        ours = (
            len(fields) == 6
            and fields[4] != "0"
            and ((fields[3], fields[4]) == (device, str(stat.st_ino)) or fields[5] == real)
        )
        if ours and run is not None and run[1] == start:
            run = (run[0], end)
            continue
        if run is not None and run[0] <= address < run[1]:
            return run
        run = (start, end) if ours else None
    return run if run is not None and run[0] <= address < run[1] else None


def _touched(piece: torch.Tensor, span: tuple[int, int], last: bool) -> tuple[int, int] | None:
    """The address and length of the pages a copy of ``piece`` (a view into ``span``) touched,
    widened to whole huge pages before it, and after it if ``last`` (a read's last run; the next
    run's drop takes those after an earlier run): the kernel maps pages around a fault too, up to a
    huge page of a large folio. None for an empty one."""
    if not piece.numel():
        return None
    extent = sum((n - 1) * stride for n, stride in zip(piece.shape, piece.stride(), strict=True))
    start = piece.data_ptr()
    end = start + (extent + 1) * piece.element_size()
    align = _HUGE if last else _PAGE
    first, end = max(span[0], start // _HUGE * _HUGE), min(span[1], -(-end // align) * align)
    return (first, end - first) if end > first else None


class _File:
    """One file, opened with safe_open, and its slices fetched once each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = safe_open(str(path), framework="pt")
        self.slices: dict[str, Any] = {}
        # The address range of the handle's mapping, looked for at its first read (None: not
        # found, the budgeted unmap applies); the source's lock guards both.
        self.span: tuple[int, int] | None = None
        self.searched = False
        # Keys of a dtype safetensors reads whole but does not slice (packed FP4): their rows
        # are taken from the whole tensor, itself a view of the mapping.
        self.whole: set[str] = set()
        # For positional reads, from the first on (the source's lock guards both): the file's
        # descriptor, and per key its dtype name, shape and first byte in the file.
        self.fd: int | None = None
        self.layout: dict[str, tuple[str, tuple[int, ...], int]] | None = None

    def entries(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """Where each tensor lies in the file, from its header (safe_open has checked it); empty
        where it cannot be read, so that every read goes through get_slice."""
        if self.layout is None:
            self.layout = {}
            try:
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return self.layout
            try:
                head = bytearray(8)
                _read_exact(fd, memoryview(head), 0)
                (length,) = struct.unpack("<Q", head)
                text = bytearray(length)
                _read_exact(fd, memoryview(text), 8)
                header = json.loads(text)
                start = 8 + length
                self.layout = {
                    key: (str(info["dtype"]), tuple(info["shape"]), start + info["data_offsets"][0])
                    for key, info in header.items()
                    if key != "__metadata__"
                }
                self.fd, fd = fd, -1
            except (OSError, ValueError, KeyError, TypeError, IndexError, MemoryError):
                self.layout = {}
            finally:
                if fd >= 0:
                    os.close(fd)
        return self.layout

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle

    def unmap(self) -> None:
        """Drop the file's mapping (its next read opens it again): the slices hold it too."""
        self.slices, self._handle, self.span, self.searched = {}, None, None, False

    def mapped(self, part: torch.Tensor) -> tuple[int, int] | None:
        """The range of this file's mapping, where ``part`` (read from it) lies wholly in it."""
        storage = part.untyped_storage()
        start = storage.data_ptr()
        if not self.searched and start:
            self.searched = True
            self.span = _file_mapping(self.path, start) if _madvise() is not None else None
        span = self.span
        if span is None or not span[0] <= start <= start + storage.nbytes() <= span[1]:
            return None
        return span

    def piece(self, key: str) -> Any:
        piece = self.slices.get(key)
        if piece is None:
            piece = self.slices[key] = self.handle.get_slice(key)
        return piece

    def part(self, key: str, index: Index | None) -> torch.Tensor:
        """``tensor[index]``, a view of the file where safetensors gives one."""
        if key in self.whole:
            tensor: torch.Tensor = self.handle.get_tensor(key)
            return tensor[index] if index else tensor
        piece = self.piece(key)
        if index:
            return piece[index]
        return piece[:] if piece.get_shape() else piece[()]

    def meta(self, describe: str, key: str, known: dict[str, torch.dtype | None]) -> TensorMeta:
        """``key``'s shape and the dtype safetensors reads it as: that of an empty slice, asked
        once per stored dtype (``known``; None: read whole)."""
        piece = self.piece(key)
        shape, name = tuple(piece.get_shape()), piece.get_dtype()
        if name not in known:
            try:
                probe = piece[0:0] if shape else piece[()]
                sliced = tuple(probe.shape[1:]) == shape[1:]
                known[name] = probe.dtype if sliced else None
            except Exception:  # a dtype it does not slice; get_tensor may read it
                known[name] = None
        dtype = known[name]
        if dtype is not None:
            return TensorMeta(shape, dtype)
        try:
            whole = self.handle.get_tensor(key)
        except Exception as exc:  # safetensors or torch refusing the dtype
            raise SourceError(
                f"{describe} stores '{key}' as {name}, which safetensors "
                f"{safetensors.__version__} cannot read as a torch tensor "
                f"({type(exc).__name__}: {exc})",
                fix="Upgrade safetensors and torch (pip install -U safetensors torch), or "
                "convert the checkpoint to a dtype they read",
            ) from exc
        self.whole.add(key)
        return TensorMeta(tuple(whole.shape), whole.dtype)


class SafetensorsSource:
    """Tensors spread over safetensors files, read through safe_open until close()."""

    def __init__(self, describe: str, files: Mapping[Path, list[str] | None]) -> None:
        """``files``: each existing file with the keys to take from it (None: all it holds)."""
        self.describe = describe
        self._record = RECORDER.get()
        self._meta: dict[str, TensorMeta] = {}
        self._where: dict[str, _File] = {}
        self._files: list[_File] = []
        self._read = 0  # bytes read since the files in `_mapped` were last unmapped
        self._mapped: dict[Path, _File] = {}
        self._lock = threading.Lock()
        absent: list[str] = []
        try:
            for path, keys in files.items():
                require_file(path)  # a named pipe would block safe_open forever
                try:
                    file = _File(path)
                    listing = list(file.handle.keys())
                except Exception as exc:  # safetensors raises its own error, or OSError
                    raise SourceError(_unreadable(describe, path, exc)) from exc
                self._files.append(file)
                held = set(listing)
                wanted = listing if keys is None else keys
                known: dict[str, torch.dtype | None] = {}
                for key in wanted:
                    if key not in held:
                        absent.append(f"{key} (in {path.name})")
                        continue
                    self._meta[key] = file.meta(describe, key, known)
                    self._where[key] = file
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
        file = self._where[key]
        if self._record is not None:
            self._record(file.path, key, index)
            part = torch.empty(self._meta[key].shape, dtype=self._meta[key].dtype, device="meta")
            return part[index or ()].new_empty(part[index or ()].shape, device="cpu")
        meta = self._meta[key]
        selected = _rows_of(meta.shape, index)
        if selected is not None and meta.dtype in _PLAIN.values():
            out = torch.empty(selected[1], dtype=meta.dtype)
            if self._direct(file, key, index, out):
                return out
        part = file.part(key, index)
        # A tensor of its own: the part is a view of the file's mapping.
        out = torch.empty(part.shape, dtype=part.dtype)
        self._copy(file, part, out)
        return out

    def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """Write ``tensor[index]`` into ``out`` (its shape; any dtype, converted)."""
        file = self._where[key]
        if self._record is not None:
            return self._record(file.path, key, index)
        if self._direct(file, key, index, out):
            return None
        part = file.part(key, index)
        if part.shape != out.shape:
            where = f"'{key}'[{rows(index)}]" if index else f"'{key}'"
            raise ValueError(f"{where} is {list(part.shape)}, the destination {list(out.shape)}")
        self._copy(file, part, out)

    def _direct(self, file: _File, key: str, index: Index | None, out: torch.Tensor) -> bool:
        """Read ``tensor[index]`` into the CPU tensor ``out`` with positional reads, where
        ``index`` takes whole rows of a dtype the file stores as torch does; False (nothing
        read) where not. Into ``out`` itself when it is contiguous and of the stored dtype, else
        through a buffer of at most _BUFFER_BYTES, converted run by run."""
        if out.device.type != "cpu" or not _POSITIONAL:
            return False
        with self._lock:
            entry = file.entries().get(key)
            fd = file.fd
        if entry is None or fd is None or entry[0] not in _PLAIN:
            return False
        name, shape, begin = entry
        selected = _rows_of(shape, index)
        if selected is None or tuple(out.shape) != selected[1]:
            return False
        if not out.numel():
            return True
        stored = _PLAIN[name]
        row = math.prod(shape[1:]) * stored.itemsize
        offset = begin + selected[0] * row
        if out.dtype == stored and out.is_contiguous():
            _read_exact(fd, _bytes_of(out), offset)
            return True
        if not shape:
            buffer = torch.empty((), dtype=stored)
            _read_exact(fd, _bytes_of(buffer), offset)
            out.copy_(buffer)
            return True
        count = out.shape[0]
        step = max(1, min(count, _BUFFER_BYTES // row))
        buffer = torch.empty((step, *shape[1:]), dtype=stored)
        for first in range(0, count, step):
            run = buffer[: min(step, count - first)]
            _read_exact(fd, _bytes_of(run), offset + first * row)
            out[first : first + len(run)].copy_(run)
        return True

    def _copy(self, file: _File, part: torch.Tensor, out: torch.Tensor) -> None:
        """``out.copy_(part)``, then the pages it touched in ``file``'s mapping dropped: after each
        run of rows where the mapping is known, else by the budgeted unmap."""
        with self._lock:
            span = file.mapped(part)
        if span is None:
            out.copy_(part)
            nbytes = part.nbytes
            del part
            return self._count(file, nbytes)
        runs: list[Any] = [...]
        if part.dim() and part.numel():
            step = max(1, _RUN_BYTES * len(part) // part.nbytes)
            runs = [slice(first, first + step) for first in range(0, len(part), step)]
        for run in runs:
            piece = part[run]
            out[run].copy_(piece)
            drop = _touched(piece, span, run is runs[-1])
            with self._lock:  # `part` holds the mapping: `span` is still the file's
                if file.span == span and drop and _madvise()(*drop, _MADV_DONTNEED):
                    file.span = None  # refused: the budgeted unmap from now on

    def _count(self, file: _File, nbytes: int) -> None:
        with self._lock:
            self._mapped[file.path] = file
            self._read += nbytes
            if self._read >= _MAPPED_BYTES:
                for mapped in self._mapped.values():
                    mapped.unmap()
                self._mapped, self._read = {}, 0

    def close(self) -> None:
        for file in self._files:
            file.close()
        self._files, self._where, self._mapped = [], {}, {}


def _rows_of(shape: tuple[int, ...], index: Index | None) -> tuple[int, tuple[int, ...]] | None:
    """The first row ``index`` takes and the shape of ``tensor[index]``, where it takes whole
    rows (a slice of step 1 on the first dim, the others whole); None where it does not."""
    index = index or ()
    if not shape:
        return (0, ()) if not index else None
    if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        return None
    if any(s.indices(n) != (0, n, 1) for s, n in zip(index[1:], shape[1:], strict=False)):
        return None
    first, stop, step = index[0].indices(shape[0]) if index else (0, shape[0], 1)
    if step != 1:
        return None
    return first, (max(0, stop - first), *shape[1:])


def _read_exact(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill ``buffer`` with the bytes of ``fd`` from ``offset`` on; a short file raises."""
    done, size = 0, len(buffer)
    while done < size:
        chunk = buffer[done : min(size, done + _MAX_READ)]
        got = os.preadv(fd, [chunk], offset + done)
        if got <= 0:
            raise OSError(f"the file ends {size - done} byte(s) before the tensor does")
        done += got


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def _unreadable(describe: str, file: Path, exc: BaseException) -> str:
    detail = f"safetensors could not read it: {type(exc).__name__}: {exc}"
    if describe == f"'{file}'":
        return (
            f"{describe} is not a state dict ({detail}); it is truncated or not a safetensors file"
        )
    return (
        f"{describe} holds '{file.name}', which is truncated or not a safetensors file ({detail})"
    )


def refuse_a_shard(file: Path) -> None:
    """Refuse one shard of several (as the first index in its folder listing it says): loading
    it alone would report most of the model as missing, which hides the actual mistake."""
    for index in sorted(file.parent.glob("*.index.json")):
        if not_a_file(index) is not None:
            continue  # no index to read (a named pipe would block the read)
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(weight_map, dict) or file.name not in set(weight_map.values()):
            continue
        count = len(set(weight_map.values()))
        if count > 1:
            raise SourceError(
                f"'{file}' is one of the {count} shard files that '{index.name}' lists; pass "
                f"the folder '{file.parent}' (or the index) to load the whole checkpoint",
                fix=f"Pass the folder: '{file.parent}'",
            )
        return


def open_file(path: Path) -> SafetensorsSource:
    """One ``.safetensors`` file (not one shard of several)."""
    refuse_a_shard(path)
    return SafetensorsSource(f"'{path}'", {path: None})


def read_weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map``: tensor name → shard file name."""
    where = f"'{index}'"
    require_file(index)
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
    """Whether the file name ``name`` (from a checkpoint's own listing) stays inside its folder:
    judged on the name, not the resolved path, as a folder of links (the Hugging Face cache's
    snapshots) is a folder of its own files, but an absolute or ``..`` name is not."""
    path = PurePath(name)
    climbs = PurePath(os.path.normpath(path)).parts[:1] == ("..",)
    return bool(name) and not path.is_absolute() and not climbs


def shard_keys(index: Path) -> dict[str, list[str]]:
    """Each shard file an index names, with its keys; a SourceError names absent files."""
    files: dict[str, list[str]] = {}
    for key, name in read_weight_map(index).items():
        files.setdefault(name, []).append(key)
    problems = {n: not_a_file(index.parent / n) for n in files}
    absent = sorted(n for n, problem in problems.items() if problem == "does not exist")
    if absent:
        raise SourceError(f"'{index}' names shard file(s) that do not exist: {listed(absent)}")
    others = sorted(f"'{n}' {problem}" for n, problem in problems.items() if problem)
    if others:
        raise SourceError(
            f"'{index}' names shard file(s) that cannot be read: {listed(others, sep='; ')}; "
            "checkpoint files are read from regular files only",
            fix="Put the checkpoint's own files there (copy the folder again from where it was "
            "saved)",
        )
    return files


def open_index(index: Path) -> SafetensorsSource:
    """A ``*.safetensors.index.json`` and the shard files it names."""
    files = {index.parent / name: keys for name, keys in shard_keys(index).items()}
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


def is_single_file_folder(path: Path) -> bool:
    return path.is_dir() and len(list(path.glob("*.safetensors"))) == 1


def open_single_file_folder(folder: Path) -> SafetensorsSource:
    (file,) = folder.glob("*.safetensors")
    return SafetensorsSource(f"'{file}'", {file: None})


__all__ = [
    "SafetensorsSource",
    "inside_folder",
    "is_single_file_folder",
    "only_index",
    "open_file",
    "open_index",
    "open_single_file_folder",
    "read_weight_map",
    "refuse_a_shard",
    "shard_keys",
]
