"""Export of a sharded model to Hugging Face safetensors, one unit at a time.

``save_hf_checkpoint`` is the reverse of :class:`~fsdp_builder.FromCheckpoint`: it writes the
folder ``FromCheckpoint`` reads, named as ``save_pretrained`` names it (``model.safetensors``
for one file; ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` for
several) from a model built by either backend, without any rank ever holding the whole model.

How the states are gathered:

- FSDP2 (``fully_shard``): the sharded ``state_dict()`` (DTensors, no communication), then one
  ``full_tensor()`` per entry: every rank takes part in each all-gather, only rank 0 keeps the
  result. At most one full parameter is in flight.
- FSDP1 (``FullyShardedDataParallel``): ``summon_full_params(unit, recurse=False,
  rank0_only=True, offload_to_cpu=True)`` per unit (no offload for a unit already on the CPU),
  root first, so one unit's flat parameter is unsharded at a time (and only on rank 0, on the
  CPU). Not ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: it unshards unit
  by unit too, but returns every tensor of the model on rank 0 at once.

Rank 0 copies each tensor into the current file's buffer and writes the file (with
``safetensors.torch.save_file``) before the buffer would pass ``max_shard_bytes``, so its peak
is one unit plus one file buffer. Every file (shards, index, ``config.json``) is written into a
staging folder inside the export folder (``.save_hf_checkpoint-*.tmp``); only once the export is
complete are an earlier export's files moved aside and the new ones moved in (renames in one
file system, the index last), and the earlier files are deleted only after the last collective
succeeded. A failure at any point before that puts the earlier export back as it was.

A failure on rank 0 (a name collision, a key map that raises, a full disk, a folder that cannot be
written) removes every file the export wrote and is raised on every rank after the last
collective, as the same library error (ConfigurationError or ExportError) with the same message
and rank 0's own error as ``__cause__``, so no rank is left waiting. A collective that fails (a
peer rank died or failed mid-export) is raised by each survivor as an ExportError saying so, its
cause the backend's error, after the same clean-up. A model that was not built (states on the
meta device) is refused on every rank before any collective.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_builder.errors import ConfigurationError, ExportError, FSDPBuilderError, config_error
from fsdp_builder.materializers.checkpoints import KeyMap, key_mapper
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.runtime.agreement import agree

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"  # a model that fits one file: no index, as transformers writes
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_FLAT_PARAM = "_flat_param"
# The staging folder's name in the export folder; a rank 0 that was killed leaves it behind.
_STAGING_PREFIX = ".save_hf_checkpoint-"


@frozen
class HFExport:
    """What ``save_hf_checkpoint`` wrote (the same on every rank).

    Attributes:
        files: the weight files' names, in order (``model.safetensors`` alone for one file).
        total_size: the bytes of all tensors (the index's ``metadata.total_size``).
        peak_bytes: the most bytes of gathered and buffered tensors rank 0 held at once
            (0 on other ranks, which keep nothing).
    """

    files: tuple[str, ...]
    total_size: int
    peak_bytes: int


class _Tally:
    """Bytes of the tensors rank 0 holds, released when the tensors are garbage-collected."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        size = _nbytes(tensor)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)
        return tensor

    def extra(self, size: int) -> None:
        """Account for bytes held outside the tally's tensors (an unsharded FSDP1 unit)."""
        self.live += size
        self.peak = max(self.peak, self.live)

    def _release(self, size: int) -> None:
        self.live -= size


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Writer:
    """Rank 0's file buffer: tensors of the current file, written when the next would not fit.

    Every file goes to a staging folder inside ``folder`` first; an earlier export's files are
    touched only by :meth:`commit`, once the new export is complete, and put back by
    :meth:`settle` when the export fails after that."""

    def __init__(self, folder: Path, max_shard_bytes: int, tally: _Tally) -> None:
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self.tally = tally
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.sources: dict[str, str] = {}  # checkpoint name → model name, for collisions
        self.error: BaseException | None = None
        self.staging: Path | None = None
        self.placed: list[Path] = []  # new files moved into ``folder``
        self.replaced: list[Path] = []  # earlier files moved aside, under ``staging / "old"``

    def open(self) -> None:
        """Create ``folder`` (if needed) and the staging folder in it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, suffix=".tmp", dir=self.folder)
        self.staging = Path(staging)
        (self.staging / "new").mkdir()
        (self.staging / "old").mkdir()

    def add(self, model_name: str, name: str, tensor: torch.Tensor, owned: bool) -> None:
        """Buffer ``tensor`` under ``name``; a tensor not ``owned`` (a view of an unsharded
        unit, the model's own storage) is copied, after the full buffer is written."""
        if name in self.sources:
            raise ConfigurationError(
                f"`save_hf_checkpoint`: key_map maps both {self.sources[name]!r} and "
                f"{model_name!r} to {name!r}. Map each model name to a name of its own"
            )
        self.sources[name] = model_name
        size = _nbytes(tensor)
        if self.buffer and self.buffered + size > self.max_shard_bytes:
            self.flush()
        if not owned:
            tensor = self.tally.hold(tensor.detach().to("cpu", copy=True).contiguous())
        self.buffer[name] = tensor
        self.buffered += size
        self.total += size

    def flush(self) -> None:
        if not self.buffer:
            return
        from safetensors.torch import save_file

        assert self.staging is not None
        path = self.staging / f"part-{len(self.parts) + 1:05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.buffer)))
        self.buffer = {}
        self.buffered = 0

    def finish(self) -> tuple[str, ...]:
        """Name the staged files as transformers' ``save_pretrained`` does: one file is
        ``model.safetensors`` with no index; several are ``model-0000k-of-0000n.safetensors``
        with ``model.safetensors.index.json``."""
        self.flush()
        assert self.staging is not None
        new = self.staging / "new"
        count = len(self.parts)
        single = count == 1
        names = (
            [SINGLE_NAME]
            if single
            else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        )
        weight_map: dict[str, str] = {}
        for (path, keys), name in zip(self.parts, names, strict=True):
            os.replace(path, new / name)
            weight_map.update(dict.fromkeys(keys, name))
        if not single:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            _write_index(new / INDEX_NAME, index)
        return tuple(names)

    def commit(self) -> None:
        """Replace an earlier export with the complete new one: the earlier one's files
        (shards, index, single file, and any file the new one also writes) are moved aside,
        the new files moved in. Renames in one folder only, undone by :meth:`settle`."""
        assert self.staging is not None
        new, old = self.staging / "new", self.staging / "old"
        incoming = sorted(p.name for p in new.iterdir())
        for present in sorted(self.folder.iterdir()):
            ours = _SHARD.match(present.name) or present.name in (SINGLE_NAME, INDEX_NAME)
            if (ours or present.name in incoming) and not present.is_dir():
                os.replace(present, old / present.name)
                self.replaced.append(present)
        # The index last: a reader that opens it finds every shard it names.
        for name in sorted(incoming, key=lambda n: n == INDEX_NAME):
            os.replace(new / name, self.folder / name)
            self.placed.append(self.folder / name)

    def settle(self, done: bool) -> None:
        """Remove the staging folder; unless ``done``, first take the new files out of
        ``folder`` and put the earlier export's back, byte for byte (renames)."""
        self.buffer = {}
        if self.staging is None:
            return
        if not done:
            for path in reversed(self.placed):
                path.unlink(missing_ok=True)
            kept = False
            for path in reversed(self.replaced):
                try:
                    os.replace(self.staging / "old" / path.name, path)
                except OSError:
                    kept = True
            if kept:
                # Never delete an earlier export's file: what could not be put back stays in
                # the staging folder.
                return
        self.placed, self.replaced = [], []
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging = None


def _write_index(path: Path, index: dict[str, Any]) -> None:
    path.write_text(json.dumps(index, indent=2) + "\n")


def _check_arguments(folder: object, key_map: KeyMap, max_shard_bytes: int) -> None:
    if not isinstance(folder, str | os.PathLike) or folder == "":
        raise config_error(
            "save_hf_checkpoint",
            "folder",
            f"expected a folder path (a str or os.PathLike), got {type(folder).__name__} "
            f"{folder!r}",
            "Pass the folder to write into, e.g. save_hf_checkpoint(model, 'out/model')",
        )
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise config_error(
            "save_hf_checkpoint",
            "max_shard_bytes",
            f"expected an int, got {type(max_shard_bytes).__name__}",
            "Pass a number of bytes, e.g. 5 * 10**9",
        )
    if max_shard_bytes <= 0:
        raise config_error(
            "save_hf_checkpoint",
            "max_shard_bytes",
            f"{max_shard_bytes} is not positive",
            "Pass a number of bytes, e.g. 5 * 10**9",
        )
    ok = key_map is None or callable(key_map) or isinstance(key_map, Mapping)
    if not ok and isinstance(key_map, Sequence) and not isinstance(key_map, str):
        ok = all(
            isinstance(pair, tuple | list)
            and len(pair) == 2
            and all(isinstance(x, str) for x in pair)
            for pair in key_map
        )
    if not ok:
        raise config_error(
            "save_hf_checkpoint",
            "key_map",
            f"expected a dict, (regex, replacement) pairs or a callable, got {key_map!r}",
            "Pass e.g. {'output.weight': 'lm_head.weight'} or [(r'^layers\\.', 'model.layers.')]",
        )


def _own_modules(unit: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """The modules of an FSDP1 unit's subtree that no nested unit manages, with their names."""
    yield prefix, unit
    for name, child in unit._modules.items():
        if child is None or isinstance(child, FullyShardedDataParallel):
            continue
        yield from _own_modules(child, f"{prefix}{name}.")


def _persistent_states(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module._parameters.items():
        if param is not None and name != _FLAT_PARAM:
            yield name, param
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield name, buf


States = Iterator[tuple[str, torch.Tensor, bool]]


def _fsdp1_states(model: nn.Module, rank: int, tally: _Tally) -> States:
    """Each FSDP1 unit's own states, unsharded one unit at a time (collective per unit), as
    views rank 0 must copy (other ranks get nothing)."""
    if rank == 0 and not isinstance(model, FullyShardedDataParallel):
        # States of modules outside every unit (a root that is not wrapped) are full already.
        for name, module in _own_modules(model, ""):
            for state_name, tensor in _persistent_states(module):
                yield clean_name(f"{name}{state_name}"), tensor, False
    units = [
        (name, m) for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)
    ]
    # Root first: its summon runs FSDP's lazy init with the right root.
    for path, unit in units:
        prefix = f"{path}." if path else ""
        # Offloading a unit that is already on the CPU fails in torch (an empty storage).
        offload = any(p.device.type != "cpu" for p in unit.parameters())
        with FullyShardedDataParallel.summon_full_params(
            unit, recurse=False, writeback=False, rank0_only=True, offload_to_cpu=offload
        ):
            if rank != 0:
                continue
            states = [
                (f"{name}{state_name}", tensor)
                for name, module in _own_modules(unit, prefix)
                for state_name, tensor in _persistent_states(module)
            ]
            unsharded = sum(_nbytes(t) for _, t in states)
            tally.extra(unsharded)
            try:
                for name, tensor in states:
                    yield clean_name(name), tensor, False
            finally:
                tally.extra(-unsharded)


def _dtensor_states(model: nn.Module, rank: int, tally: _Tally) -> States:
    """The sharded state dict, one entry gathered at a time (collective per DTensor)."""
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            if value.device.type != value.device_mesh.device_type:
                # Shards offloaded to the CPU gather on the mesh's device (NCCL takes no CPU
                # tensors), one parameter at a time.
                value = value.to(value.device_mesh.device_type)
            full = value.full_tensor()
            if rank != 0:
                del full
                continue
            tensor = tally.hold(full.detach().cpu().contiguous())
            del full
            yield clean_name(name), tensor, True
            del tensor
        elif isinstance(value, torch.Tensor) and rank == 0:
            yield clean_name(name), value, False


def save_hf_checkpoint(
    model: nn.Module,
    folder: str | os.PathLike[str],
    key_map: KeyMap = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> HFExport:
    """Write a sharded model as a Hugging Face safetensors folder, unit by unit.

    Collective: every rank calls it with the same arguments; rank 0 writes into ``folder``
    (created if needed) what transformers' ``save_pretrained`` writes: ``model.safetensors``
    alone when the model fits one file of ``max_shard_bytes``, else
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``). Only a complete export replaces an earlier one:
    the files are written beside it first (so the disk needs room for both), and a failure at any
    point leaves the earlier export's files as they were. Files of an earlier export that the
    new one does not name (shards, index, single file) are removed. ``FromCheckpoint(folder)``
    loads it back;
    for a transformers model (one with a ``config``) rank 0 also writes its ``config.json``, so
    ``from_pretrained(folder)`` loads it too. A mixture-of-experts model is written with its
    fused expert tensors (``mlp.experts.gate_up_proj``), which ``from_pretrained`` and
    ``FromCheckpoint`` both read.

    No rank holds the whole model. With FSDP2 each DTensor of the sharded state dict is gathered
    on its own (``full_tensor()``); with FSDP1 one unit is unsharded at a time with
    ``summon_full_params(unit, recurse=False, rank0_only=True, offload_to_cpu=True)``, and only
    on rank 0. Rank 0's peak is one unit (FSDP2: one parameter) plus one file buffer of at most
    ``max_shard_bytes`` (a single larger tensor gets a file of its own); other ranks hold their
    shards and one gathered tensor or unit. The values are the full-precision parameters
    (mixed precision only changes the compute dtype), as ``get_model_state_dict`` returns them.

    Args:
        model: the model a builder returned (``FSDPBuilder`` or ``FullyShardBuilder``), or any
            module whose state dict holds DTensors or plain tensors.
        folder: where to write.
        key_map: model name → checkpoint name, in the forms ``FromCheckpoint`` takes (a dict
            that renames the names it holds, (regex, replacement) pairs applied in order, or a
            callable; a callable returning None leaves the state out). Model names are the clean
            ones (no ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.`` or
            ``_orig_mod.``). Non-persistent buffers are never written.
        max_shard_bytes: the largest size of one file's tensors.

    Returns:
        The files written, the total size and rank 0's peak of held tensor bytes.

    Raises:
        ConfigurationError: a bad ``key_map`` or ``max_shard_bytes``, or a model that was not
            built (states on the meta device), raised on every rank before any collective; two
            model names mapped to one checkpoint name, or a ``key_map`` that raises or returns
            something other than a str or None (raised on every rank, after the last
            collective, with no file left behind).
        ExportError: rank 0 could not write the files (``folder`` is a file, no permission, a
            full disk) or gather a state; raised on every rank with rank 0's error as
            ``__cause__``, after removing every file the export wrote. Also raised by every
            surviving rank when a collective of the export fails (a peer rank died or failed),
            with the backend's error as ``__cause__``, after the same clean-up.
    """
    _check_arguments(folder, key_map, max_shard_bytes)
    try:
        mapper: Callable[[str], str | None] = key_mapper(key_map)
    except re.error as exc:
        raise config_error(
            "save_hf_checkpoint", "key_map", f"a pattern is not a regex ({exc})", "Fix it"
        ) from exc
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    agree("export (check)", _unbuilt(model))
    target = Path(folder)
    tally = _Tally()
    writer = _Writer(target, max_shard_bytes, tally)
    try:
        outcome = _export(model, rank, distributed, mapper, writer)
    except BaseException as exc:
        # A collective failed (a peer died or failed) or the rank was interrupted: the
        # earlier export is put back, the staged files go.
        writer.settle(done=False)
        if isinstance(exc, Exception) and distributed:
            raise _peer_lost(target, rank, exc) from exc
        raise
    writer.settle(done=True)
    files, total, failure = outcome
    if failure is not None:
        kind, message, cause = failure
        if isinstance(writer.error, FSDPBuilderError):
            raise writer.error  # rank 0's own, with its cause
        if writer.error is not None:
            cause = writer.error
        error_type = ConfigurationError if kind == ConfigurationError.__name__ else ExportError
        raise error_type(message) from cause
    return HFExport(files=files, total_size=total, peak_bytes=tally.peak if rank == 0 else 0)


def _export(
    model: nn.Module,
    rank: int,
    distributed: bool,
    mapper: Callable[[str], str | None],
    writer: _Writer,
) -> tuple[tuple[str, ...], int, tuple[str, str, BaseException | None] | None]:
    """Every rank's collectives of the export and rank 0's writes; the files, the total size
    and rank 0's failure (or None), as rank 0 broadcast them. On rank 0 the new export is in
    place (the earlier one moved aside) when this returns without a failure."""
    if rank == 0:
        try:
            writer.open()
        except OSError as exc:
            writer.error = exc
    fsdp1 = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    states = _fsdp1_states if fsdp1 else _dtensor_states
    with torch.no_grad():
        # Every rank runs the whole loop (its collectives), even after rank 0 failed.
        for model_name, tensor, owned in states(model, rank, writer.tally):
            if writer.error is not None:
                continue
            try:
                name = _mapped(mapper, model_name)
                if name is not None:
                    writer.add(model_name, name, tensor, owned)
            except (Exception, CheckpointException) as exc:
                writer.error = exc
            del tensor
    files: tuple[str, ...] = ()
    if rank == 0 and writer.error is None:
        try:
            files = writer.finish()
            assert writer.staging is not None
            _save_config(model, writer.staging / "new")
            writer.commit()
        except (Exception, CheckpointException) as exc:
            writer.error = exc
    failure: tuple[str, str, BaseException | None] | None = None
    if rank == 0 and writer.error is not None:
        writer.settle(done=False)
        failure = _failure(writer.error, writer.folder)
    outcome: list[Any] = [(files, writer.total, failure)]
    if distributed:
        # The last collective: a peer that dies here undoes rank 0's commit (in the caller).
        dist.broadcast_object_list(outcome, src=0)
    files, total, failure = outcome[0]
    return files, total, failure


def _peer_lost(folder: Path, rank: int, error: BaseException) -> ExportError:
    """The survivor's error when a collective of the export failed."""
    text = str(error).strip()
    detail = text.splitlines()[0] if text else ""
    return ExportError(
        f"`save_hf_checkpoint` into '{folder}' stopped on rank {rank}: a peer rank died or "
        f"failed during the export (a collective failed: {type(error).__name__}: {detail}). "
        "Its own log says why; run the export again on every rank. Nothing of this export was "
        "kept, and an earlier export in that folder is left as it was."
    )


def _unbuilt(model: nn.Module) -> ConfigurationError | None:
    """A model whose states are still on the meta device: the same on every rank of a program
    that exports what it built, so every rank refuses before the first collective."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if not left:
        return None
    return config_error(
        "save_hf_checkpoint",
        "model",
        f"its states {', '.join(left[:4])}{' ...' if len(left) > 4 else ''} are on the meta "
        "device: it was not built",
        "Export the model a builder returned (model = builder.build(model))",
    )


def _mapped(mapper: Callable[[str], str | None], model_name: str) -> str | None:
    try:
        name = mapper(model_name)
    except Exception as exc:
        raise config_error(
            "save_hf_checkpoint",
            "key_map",
            f"it raised {type(exc).__name__}: {exc} for the model name {model_name!r}",
            "Make it return a checkpoint name (a str), or None to leave a state out, for every "
            "model name",
        ) from exc
    if name is not None and not isinstance(name, str):
        raise config_error(
            "save_hf_checkpoint",
            "key_map",
            f"it returned {type(name).__name__} {name!r} for the model name {model_name!r}",
            "Make it return a checkpoint name (a str), or None to leave a state out",
        )
    return name


# What an OSError's errno says about the folder, and the fix.
_OS_FIXES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "Free space on that disk, or export to another folder"),
    errno.EDQUOT: ("the disk quota is used up", "Free space, or export to another folder"),
    errno.EACCES: ("no permission to write there", "Pass a folder this process may write to"),
    errno.EPERM: ("no permission to write there", "Pass a folder this process may write to"),
    errno.EROFS: ("the file system is read-only", "Pass a folder on a writable file system"),
    errno.EEXIST: (
        "it is a file, not a folder",
        "Pass a folder path (it is created if needed), or move the file away",
    ),
    errno.ENOTDIR: (
        "a part of the path is a file, not a folder",
        "Pass a folder path whose parents are folders",
    ),
}


def _failure(error: BaseException, folder: Path) -> tuple[str, str, BaseException | None]:
    """Rank 0's failure as every rank raises it: the library error's type name, its message,
    and its cause (the OS's, torch's or the key map's error; its text where it cannot travel to
    the other ranks)."""
    cause = error.__cause__ if isinstance(error, FSDPBuilderError) else error
    if isinstance(error, FSDPBuilderError):
        kind, message = type(error).__name__, str(error)
    else:
        if isinstance(error, OSError) and error.errno in _OS_FIXES:
            what, fix = _OS_FIXES[error.errno]
        else:
            what, fix = "rank 0 could not write or gather a state", "Fix the cause above"
        kind = ExportError.__name__
        message = (
            f"`save_hf_checkpoint` could not write to '{folder}': {what} "
            f"({type(error).__name__}: {error}). {fix}; the files this export wrote were "
            "removed."
        )
    return kind, message, None if cause is None else _portable(cause)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it can be sent to the other ranks as it is, else its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _save_config(model: nn.Module, folder: Path) -> None:
    """A transformers model's ``config.json`` next to its weights, so that
    ``from_pretrained(folder)`` loads the export (an FSDP1 root hands ``config`` on from the
    model it wraps)."""
    save = getattr(getattr(model, "config", None), "save_pretrained", None)
    if callable(save):
        save(folder)


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFExport", "save_hf_checkpoint"]
