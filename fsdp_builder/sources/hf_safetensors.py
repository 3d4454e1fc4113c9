"""Safetensors checkpoints: one ``.safetensors`` file, or a Hugging Face folder whose
``*.safetensors.index.json`` says which shard file holds each tensor, read through safetensors'
own ``safe_open`` / ``get_slice``: every dtype it reads, only the rows asked for."""

from __future__ import annotations

import json
import mmap
import os
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

# Sources opened while a recorder is set (a dry run's, ``fsdp_builder.tools.dryrun``) hand it
# each read (file, key, index) and make none; the read returns an uninitialized tensor.
# The recorder is handed the destination too, as the read would write it.
RECORDER: ContextVar[Callable[[Path, str, Index | None, torch.Tensor], None] | None] = ContextVar(
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
            part = torch.empty(self._meta[key].shape, dtype=self._meta[key].dtype, device="meta")
            made = part[index or ()].new_empty(part[index or ()].shape, device="cpu")
            self._record(file.path, key, index, made)
            return made
        part = file.part(key, index)
        # A tensor of its own: the part is a view of the file's mapping.
        out = torch.empty(part.shape, dtype=part.dtype)
        self._copy(file, part, out)
        return out

    def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """Write ``tensor[index]`` into ``out`` (its shape; any dtype, converted)."""
        file = self._where[key]
        if self._record is not None:
            return self._record(file.path, key, index, out)
        part = file.part(key, index)
        if part.shape != out.shape:
            where = f"'{key}'[{rows(index)}]" if index else f"'{key}'"
            raise ValueError(f"{where} is {list(part.shape)}, the destination {list(out.shape)}")
        self._copy(file, part, out)

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
        self._files, self._where, self._mapped = [], {}, {}


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
