"""Safetensors checkpoints: one ``.safetensors`` file, or a Hugging Face folder whose
``*.safetensors.index.json`` says which shard file holds each tensor, opened with safetensors'
own ``safe_open``: every dtype it reads, only the rows asked for. Whole rows in the stored dtype
are positional reads into the destination; the rest is read through ``get_slice``."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import safetensors
import torch
from safetensors import safe_open

from fsdp_builder.common.logs import get_logger
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
# a read through get_slice touches count as the process's memory for as long as the file stays
# mapped, and the kernel maps more than the rows asked for (the page-cache folio around each
# fault, up to a huge page). A source copies such a read in runs of rows spanning at most
# _MAPPED_BYTES of the file and unmaps the file after each run (drops its handle and slices; the
# next read opens it again): a rank holds about one run of the checkpoint mapped while it reads,
# and none between reads, whatever the size of a read or of its share of a file
# (benchmarks/results/file_pages.md). The page cache keeps the data either way; a smaller run
# reopens the file more often.
_MAPPED_BYTES = 2 << 20

# Whole rows of a dtype stored as torch stores it, read into a contiguous tensor of that dtype (a
# rank's rows in the model's dtype: nearly every byte of a load), are positional reads of the
# rows' bytes straight into it: nothing is mapped and each byte is copied once. Kept beside
# get_slice for its A/B on the rank-local load (benchmarks/results/reader_ab.md: 11 % of the
# load's time against the same load by hand, no file-backed pages). Their offsets come from the
# file's header, which safe_open has already checked; anything else goes through get_slice.
_PLAIN = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_POSITIONAL = hasattr(os, "preadv") and sys.byteorder == "little"
_MAX_READ = 1 << 30  # one read(2) moves at most about 2 GiB on Linux


class _File:
    """One file, opened with safe_open, and its slices fetched once each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = safe_open(str(path), framework="pt")
        self.slices: dict[str, Any] = {}
        # Keys of a dtype safetensors reads whole but does not slice (packed FP4): their rows
        # are taken from the whole tensor, itself a view of the mapping.
        self.whole: set[str] = set()
        # Each tensor's stored dtype name and first byte, from the header (read on first use).
        self.offsets: dict[str, tuple[str, int]] | None = None

    def offset_of(self, key: str) -> tuple[str, int] | None:
        """``key``'s stored dtype name and first byte in the file; None where the header
        cannot be read here (the read then goes through get_slice)."""
        if self.offsets is None:
            try:
                with open(self.path, "rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(length))
                self.offsets = {
                    k: (str(v["dtype"]), 8 + length + int(v["data_offsets"][0]))
                    for k, v in header.items()
                    if k != "__metadata__"
                }
            except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
                self.offsets = {}
        return self.offsets.get(key)

    @property
    def handle(self) -> Any:
        handle = self._handle  # another thread may unmap the file meanwhile
        if handle is None:
            handle = self._handle = safe_open(str(self.path), framework="pt")
        return handle

    def unmap(self) -> None:
        """Drop the file's mapping (its next read opens it again): the slices hold it too, and
        each part read from it until that part is dropped."""
        self.slices, self._handle = {}, None

    def piece(self, key: str) -> Any:
        slices = self.slices
        piece = slices.get(key)
        if piece is None:
            piece = slices[key] = self.handle.get_slice(key)
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


def _shape(meta: TensorMeta, index: Index | None) -> tuple[int, ...]:
    """The shape of ``tensor[index]``."""
    kept = [len(range(n)[s]) for s, n in zip(index or (), meta.shape, strict=False)]
    return (*kept, *meta.shape[len(kept) :])


class SafetensorsSource:
    """Tensors spread over safetensors files, read through safe_open until close()."""

    def __init__(self, describe: str, files: Mapping[Path, list[str] | None]) -> None:
        """``files``: each existing file with the keys to take from it (None: all it holds)."""
        self.describe = describe
        self._meta: dict[str, TensorMeta] = {}
        self._where: dict[str, _File] = {}
        self._files: list[_File] = []
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
                file.unmap()  # mapped again for each run of rows read from it
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

    def file_of(self, key: str) -> Path:
        """The file holding ``key`` (a key of :meth:`tensors`)."""
        return self._where[key].path

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        meta = self._meta[key]
        # A tensor of its own: a part read is a view of the file's mapping.
        out = torch.empty(_shape(meta, index), dtype=meta.dtype)
        self._copy(key, index, out)
        return out

    def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """Write ``tensor[index]`` into ``out`` (its shape; any dtype, converted)."""
        shape = _shape(self._meta[key], index)
        if shape != tuple(out.shape):
            where = f"'{key}'[{rows(index)}]" if index else f"'{key}'"
            raise ValueError(f"{where} is {list(shape)}, the destination {list(out.shape)}")
        self._copy(key, index, out)

    def _copy(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """``out.copy_(key[index])``: positional reads where they apply, else in runs of rows each
        spanning at most _MAPPED_BYTES of the file (one row where a row is larger), the file
        unmapped after each."""
        file, meta = self._where[key], self._meta[key]
        if _positional(file, key, meta, index, out):
            return None
        if not out.dim():
            return self._run(file, key, index, out)
        row = math.prod(meta.shape[1:]) * meta.dtype.itemsize
        chosen = range(meta.shape[0])[index[0]] if index else range(meta.shape[0])
        per_run = max(1, (_MAPPED_BYTES // max(row, 1) - 1) // chosen.step + 1)
        rest = tuple(index[1:]) if index else ()
        for at in range(0, max(len(chosen), 1), per_run):
            run = chosen[at : at + per_run]
            stop = run.stop if run.stop >= 0 else None
            self._run(file, key, (slice(run.start, stop, run.step), *rest), out[at : at + per_run])

    @staticmethod
    def _run(file: _File, key: str, index: Index | None, out: torch.Tensor) -> None:
        try:
            out.copy_(file.part(key, index))
        finally:
            # The part is gone: nothing else holds the mapping (a part another thread is
            # copying from holds it until that copy is done).
            file.unmap()

    def close(self) -> None:
        self._files, self._where = [], {}


def _positional(
    file: _File, key: str, meta: TensorMeta, index: Index | None, out: torch.Tensor
) -> bool:
    """Read ``key[index]`` into ``out`` with positional reads where ``index`` takes whole rows
    (a slice of step 1 on the first dim) of a plain dtype, into a contiguous CPU tensor of that
    dtype; False (nothing read) elsewhere."""
    if not _POSITIONAL or out.device.type != "cpu" or not out.is_contiguous():
        return False
    if not all(isinstance(s, slice) for s in index or ()) or not meta.shape:
        return False
    found = file.offset_of(key)
    if found is None or _PLAIN.get(found[0]) is not out.dtype or out.dtype != meta.dtype:
        return False
    first, _, step = index[0].indices(meta.shape[0]) if index else (0, meta.shape[0], 1)
    rest = zip((index or ())[1:], meta.shape[1:], strict=False)
    whole = all(s.indices(n) == (0, n, 1) for s, n in rest)
    if step != 1 or not whole:
        return False
    row = math.prod(meta.shape[1:]) * out.element_size()
    view = out.detach().reshape(-1).view(torch.uint8).numpy().data
    with open(file.path, "rb", buffering=0) as f:
        done, offset = 0, found[1] + first * row
        while done < len(view):
            got = os.preadv(f.fileno(), [view[done : done + _MAX_READ]], offset + done)
            if got <= 0:
                raise SourceError(f"'{file.path}' ends before '{key}' does")
            done += got
    return True


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
