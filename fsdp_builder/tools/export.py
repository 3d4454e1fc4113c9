"""Export of a sharded model to Hugging Face safetensors, one unit at a time.

``save_hf_checkpoint`` is the reverse of :class:`~fsdp_builder.FromCheckpoint`: it writes the
folder ``FromCheckpoint`` reads (``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json``) from a model built by either backend, without any rank ever
holding the whole model.

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
their number is known; a failure on rank 0 (a name collision, a full disk) removes them and is
raised on every rank after the last collective, so no rank is left waiting.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from attrs import frozen
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_builder.errors import ConfigurationError, config_error
from fsdp_builder.materializers.checkpoints import KeyMap, key_mapper
from fsdp_builder.planning.ignored import clean_name

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_FLAT_PARAM = "_flat_param"


@frozen
class HFExport:
    """What ``save_hf_checkpoint`` wrote (the same on every rank).

    Attributes:
        files: the shard files' names, in order.
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
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.buffer)))
        self.buffer = {}
        self.buffered = 0

    def finish(self) -> tuple[str, ...]:
        self.flush()
        count = len(self.parts)
        names = [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        for stale in self.folder.iterdir():
            if _SHARD.match(stale.name) and stale.name not in names:
                stale.unlink()
        weight_map: dict[str, str] = {}
        for (path, keys), name in zip(self.parts, names, strict=True):
            os.replace(path, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return tuple(names)

    def abandon(self) -> None:
        self.buffer = {}
        for path, _ in self.parts:
            path.unlink(missing_ok=True)


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

    Collective: every rank calls it with the same arguments; rank 0 writes
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``) into ``folder`` (created if needed; shard files of
    an earlier export that the new one does not name are removed). ``FromCheckpoint(folder)``
    loads it back; for a transformers model (one with a ``config``) rank 0 also writes its
    ``config.json``, so ``from_pretrained(folder)`` loads it too.

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
        ConfigurationError: a bad ``key_map`` or ``max_shard_bytes`` (raised before any
            collective), or two model names mapped to one checkpoint name (raised on every
            rank, after the last collective, with no file left behind).
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
                name = mapper(model_name)
                if name is not None:
                    writer.add(model_name, name, tensor, owned)
            except Exception as exc:
                writer.error = exc
            del tensor
    files: tuple[str, ...] = ()
    if rank == 0 and writer.error is None:
        try:
            files = writer.finish()
            _save_config(model, target)
        except Exception as exc:
            writer.error = exc
    if rank == 0 and writer.error is not None:
        writer.abandon()
    failure = None if writer.error is None else _describe(writer.error)
    outcome: list[Any] = [(files, writer.total, failure)]
    if distributed:
        dist.broadcast_object_list(outcome, src=0)
    files, total, failure = outcome[0]
    if failure is not None:
        if rank == 0 and writer.error is not None:
            raise writer.error
        kind, message = failure
        if kind == ConfigurationError.__name__:
            raise ConfigurationError(message)
        raise RuntimeError(f"save_hf_checkpoint failed on rank 0: {kind}: {message}")
    return HFExport(files=files, total_size=total, peak_bytes=tally.peak if rank == 0 else 0)


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
