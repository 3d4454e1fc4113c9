"""The checkpoint-source protocol: what a loader needs from a checkpoint, whatever its format:
its tensors' global shapes and dtypes (no values read), reads of a tensor or a slice of it, and
one close. Problems with what a path holds are :class:`SourceError`, which the loader that opened
the source raises as its own ``ConfigurationError`` (its name, its argument, its fix)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from attrs import frozen

from fsdp_builder.common.describe import listed
from fsdp_builder.errors import ConfigurationError

# A read of part of a tensor: one slice per leading dim (the rest is read whole).
Index = tuple[slice, ...]


@frozen
class TensorMeta:
    """A tensor as the checkpoint stores it: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class SourceError(ConfigurationError):
    """What a path holds cannot be loaded; the message reads "'<path>' <what is wrong>".
    ``fix``: a fix particular to this problem (else the loader gives its general one)."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(problem)


class MissingPath(SourceError):
    """The path does not exist on this rank."""

    def __init__(self, path: str, rank: int, near: str | None = None) -> None:
        self.path = path
        self.rank = rank
        self.near = near  # a name in the same folder close to the one given: the likely typo
        hint = f"; did you mean '{near}'?" if near else ""
        super().__init__(f"the path '{path}' does not exist on rank {rank}{hint}")


@runtime_checkable
class CheckpointSource(Protocol):
    """An open checkpoint: its tensors' names, shapes and dtypes, and reads of their values;
    ``describe`` names the source in messages (e.g. ``"'/ckpt/model.safetensors'"``)."""

    describe: str

    def tensors(self) -> Mapping[str, TensorMeta]:
        """Every tensor the source holds, by its name in the checkpoint; no values are read."""

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        """The tensor ``key`` (a key of :meth:`tensors`), or only ``tensor[index]``, on the CPU
        in the stored dtype."""

    def close(self) -> None:
        """Release files and mappings; no read follows."""


@runtime_checkable
class ReadsInto(Protocol):
    """A source that writes a read straight into a destination the caller allocated (optional:
    loaders fall back to :meth:`CheckpointSource.read` and a copy)."""

    def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """Write ``tensor[index]`` (the whole tensor for None) into ``out``, a tensor of that
        shape on any device, of any dtype (values convert to it)."""


def reader(source: CheckpointSource) -> Callable[[str, Index | None, torch.Tensor], None]:
    """``read_into`` for ``source``, the protocol asked once (a protocol check walks the
    protocol's members: worth keeping out of a loop over many reads)."""
    if isinstance(source, ReadsInto):
        return source.read_into

    def copied(key: str, index: Index | None, out: torch.Tensor) -> None:
        out.copy_(source.read(key, index))

    return copied


@runtime_checkable
class FillsTargets(Protocol):
    """A source that writes many tensors at once more cheaply than one read each (DCP)."""

    def fill(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Write each checkpoint entry into its target: a tensor or a DTensor, whose local part
        only is written; dtypes convert to the target's."""


class _Checked:
    """A registered format's source whose reads are held to its own listing: a read of another
    shape would be broadcast into the destination (one row copied into every row) and one of
    another dtype converted without a word, so both are refused, naming the format. A
    ``read_into`` or ``fill`` the source defines is kept as it is (it writes into the loader's
    destination itself), so the protocol checks answer as for the source."""

    def __init__(self, format_name: str, source: CheckpointSource) -> None:
        self._format = format_name
        self._source = source
        self._listing: Mapping[str, TensorMeta] | None = None
        self.describe = source.describe
        for method in ("read_into", "fill"):
            if hasattr(source, method):
                setattr(self, method, getattr(source, method))

    def tensors(self) -> Mapping[str, TensorMeta]:
        self._listing = self._source.tensors()
        return self._listing

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        got = self._source.read(key, index)
        if self._listing is None:
            self._listing = self._source.tensors()
        meta = self._listing.get(key)
        if meta is None:
            return got
        # Raised in the middle of a load, where the loader names the source and quotes the
        # error: the fix goes into the message itself.
        where = f"the checkpoint format '{self._format}' read '{key}'"
        if not isinstance(got, torch.Tensor):
            raise SourceError(
                f"{where} as a {type(got).__name__}, not a torch.Tensor; make the format's "
                "read() return a tensor"
            )
        want = tuple(torch.empty(meta.shape, device="meta")[index or ()].shape)
        if tuple(got.shape) != want:
            part = "" if want == tuple(meta.shape) else f" (rows {rows(index)} of it)"
            raise SourceError(
                f"{where} as shape {list(got.shape)} where its tensors() listed "
                f"{list(meta.shape)}{part}, which the loader would broadcast into every row; "
                f"make the format's read() return exactly the {list(want)} asked for, or fix "
                "its tensors()"
            )
        if got.dtype != meta.dtype:
            raise SourceError(
                f"{where} as {got.dtype} where its tensors() listed {meta.dtype}, which the "
                "loader would convert without a word; make the format's read() return the "
                "listed dtype, or list the dtype it stores"
            )
        return got

    def close(self) -> None:
        self._source.close()


# What a path is where it is not a regular file, by the test of its mode that says so.
_NOT_REGULAR: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path: Path) -> str | None:
    """Why ``path`` (links followed) is no file a checkpoint can be read from: "does not
    exist", "is a named pipe (FIFO), not a regular file"...; None for a regular file. One
    ``stat``, which never blocks: opening a named pipe waits for a writer forever (on every
    rank, whatever the build's timeout), and a device can be read without end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be examined ({type(exc).__name__}: {exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kind = next((kind for test, kind in _NOT_REGULAR if test(mode)), "something else")
    return f"is {kind}, not a regular file"


def require_file(path: Path) -> None:
    """Refuse ``path`` unless it is a regular file (see :func:`not_a_file`): asked before a
    checkpoint file is opened."""
    problem = not_a_file(path)
    if problem is not None:
        raise SourceError(
            f"'{path}' {problem}; checkpoint files are read from regular files only",
            fix="Put the checkpoint's own file there (copy the checkpoint folder again from where "
            "it was saved)",
        )


def rows(index: Index | None) -> str:
    """``index`` as a message shows it: ``0:4, 2:``."""
    return ", ".join(
        f"{s.start or 0}:{'' if s.stop is None else s.stop}" if isinstance(s, slice) else repr(s)
        for s in index or ()
    )


def checked_source(format_name: str, source: CheckpointSource) -> CheckpointSource:
    """``source``, opened by the registered format ``format_name``, with each ``read`` checked
    against its ``tensors()`` listing (shape and dtype)."""
    return _Checked(format_name, source)


__all__ = [
    "CheckpointSource",
    "FillsTargets",
    "Index",
    "MissingPath",
    "ReadsInto",
    "SourceError",
    "TensorMeta",
    "checked_source",
    "listed",
    "not_a_file",
    "reader",
    "require_file",
    "rows",
]
