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
is one unit plus one file buffer. Files are written under temporary names and renamed once
their number is known, then the index is written under a temporary name and renamed last. A
failure on rank 0 (a name collision, a key map that raises, a full disk, a folder that cannot be
written) removes every file the export wrote and is raised on every rank after the last
collective, as the same library error (ConfigurationError or ExportError) with the same message
and rank 0's own error as ``__cause__``, so no rank is left waiting. A model that was not built
(states on the meta device) is refused on every rank before any collective.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
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
    """Rank 0's file buffer: tensors of the current file, written when the next would not fit."""

    def __init__(self, folder: Path, max_shard_bytes: int, tally: _Tally) -> None:
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self.tally = tally
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.written: list[Path] = []  # every file this export created, to remove on failure
        self.total = 0
        self.sources: dict[str, str] = {}  # checkpoint name → model name, for collisions
        self.error: BaseException | None = None

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

        path = self.folder / f"model-{len(self.parts) + 1:05d}.safetensors.tmp"
        self.written.append(path)
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.buffer)))
        self.buffer = {}
        self.buffered = 0

    def finish(self) -> tuple[str, ...]:
        """Name the files as transformers' ``save_pretrained`` does: one file is
        ``model.safetensors`` with no index; several are ``model-0000k-of-0000n.safetensors``
        with ``model.safetensors.index.json``. Then remove what an earlier export left that the
        new one does not name (its shards, its index or its single file)."""
        self.flush()
        count = len(self.parts)
        single = count == 1
        names = (
            [SINGLE_NAME]
            if single
            else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        )
        weight_map: dict[str, str] = {}
        for (path, keys), name in zip(self.parts, names, strict=True):
            self.written.append(self.folder / name)
            os.replace(path, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        if not single:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            staged = self.folder / f"{INDEX_NAME}.tmp"
            self.written.append(staged)
            _write_index(staged, index)
            self.written.append(self.folder / INDEX_NAME)
            os.replace(staged, self.folder / INDEX_NAME)
        # Only a complete export replaces an earlier one's files.
        keep = {*names} if single else {*names, INDEX_NAME}
        for stale in self.folder.iterdir():
            ours = _SHARD.match(stale.name) or stale.name in (SINGLE_NAME, INDEX_NAME)
            if ours and stale.name not in keep:
                stale.unlink()
        return tuple(names)

    def abandon(self) -> None:
        self.buffer = {}
        for path in self.written:
            path.unlink(missing_ok=True)


def _write_index(path: Path, index: dict[str, Any]) -> None:
    path.write_text(json.dumps(index, indent=2) + "\n")


def _check_arguments(key_map: KeyMap, max_shard_bytes: int) -> None:
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
    (``metadata.total_size``, ``weight_map``). Files of an earlier export that the new one does
    not name (shards, index, single file) are removed. ``FromCheckpoint(folder)`` loads it back;
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
            ``__cause__``, after removing every file the export wrote.
    """
    _check_arguments(key_map, max_shard_bytes)
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
    if rank == 0:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            writer.error = exc
    fsdp1 = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    states = _fsdp1_states if fsdp1 else _dtensor_states
    with torch.no_grad():
        # Every rank runs the whole loop (its collectives), even after rank 0 failed.
        for model_name, tensor, owned in states(model, rank, tally):
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
            _save_config(model, target)
        except (Exception, CheckpointException) as exc:
            writer.error = exc
    failure: tuple[str, str, BaseException | None] | None = None
    if rank == 0 and writer.error is not None:
        writer.abandon()
        failure = _failure(writer.error, target)
    outcome: list[Any] = [(files, writer.total, failure)]
    if distributed:
        dist.broadcast_object_list(outcome, src=0)
    files, total, failure = outcome[0]
    if failure is not None:
        kind, message, cause = failure
        if isinstance(writer.error, FSDPBuilderError):
            raise writer.error  # rank 0's own, with its cause
        if writer.error is not None:
            cause = writer.error
        error_type = ConfigurationError if kind == ConfigurationError.__name__ else ExportError
        raise error_type(message) from cause
    return HFExport(files=files, total_size=total, peak_bytes=tally.peak if rank == 0 else 0)


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


def _describe(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFExport", "save_hf_checkpoint"]
