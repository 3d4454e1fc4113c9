"""``save_hf_checkpoint``: a sharded model (either backend) written as the Hugging Face
safetensors folder ``FromCheckpoint`` and ``from_pretrained`` read, one unit at a time, with no
rank ever holding the whole model; only a complete export replaces an earlier one."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from attrs import define, frozen
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_builder.errors import ConfigurationError, ExportError, FSDPBuilderError, config_error
from fsdp_builder.groups import collective_device
from fsdp_builder.materializers.loading import KeyMap, Mapper, check_key_map, key_mapper, map_name
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.planning.wrap import is_diffusers_model
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.sources.dcp_folder import is_dcp_folder

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"  # a model that fits one file: no index, as transformers writes
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
# diffusers' file names (its SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME and shard names)
DIFFUSERS_STEM = "diffusion_pytorch_model"
_SHARD = re.compile(r"^(model|diffusion_pytorch_model)-\d{5}-of-\d{5}\.safetensors$")
_EARLIER = frozenset(
    f"{stem}{suffix}"
    for stem in ("model", DIFFUSERS_STEM)
    for suffix in (".safetensors", ".safetensors.index.json")
)
_FLAT_PARAM = "_flat_param"
# The staging folder's name in the export folder; a rank 0 that was killed leaves it behind.
_STAGING_PREFIX = ".save_hf_checkpoint-"


@frozen
class HFExport:
    """What ``save_hf_checkpoint`` wrote (the same on every rank): the weight files, the bytes
    of all tensors, and the most tensor bytes rank 0 held at once (0 on other ranks)."""

    files: tuple[str, ...]
    total_size: int
    peak_bytes: int


@define
class _Tally:
    """Bytes of the tensors rank 0 holds, released when the tensors are garbage-collected."""

    live: int = 0
    peak: int = 0

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        self.extra(_nbytes(tensor))
        weakref.finalize(tensor, self.extra, -_nbytes(tensor))
        return tensor

    def extra(self, size: int) -> None:
        """Account for bytes held outside the tally's tensors (an unsharded FSDP1 unit)."""
        self.live += size
        self.peak = max(self.peak, self.live)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Writer:
    """Rank 0's file buffer, written when the next tensor would not fit, into a staging folder
    inside ``folder``; :meth:`commit` swaps the export in, :meth:`settle` undoes it."""

    def __init__(
        self, folder: Path, max_shard_bytes: int, tally: _Tally, stem: str = "model"
    ) -> None:
        self.folder = folder
        self.stem = stem  # "model" as transformers names files, diffusers' for its models
        self.max_shard_bytes = max_shard_bytes
        self.tally = tally
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.sources: dict[str, str] = {}  # checkpoint name → model name, for collisions
        self.error: FSDPBuilderError | None = None  # rank 0's, as every rank raises it
        self.staging: Path | None = None
        self.placed: list[Path] = []  # new files moved into ``folder``
        self.replaced: list[Path] = []  # earlier files moved aside, under ``staging / "old"``

    def fail(self, error: BaseException) -> None:
        """Keep rank 0's first failure, as the library error every rank raises."""
        if self.error is None:
            self.error = _library_error(error, self.folder)

    def open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, suffix=".tmp", dir=self.folder)
        self.staging = Path(staging)
        (self.staging / "new").mkdir()
        (self.staging / "old").mkdir()

    def add(self, model_name: str, name: str, tensor: torch.Tensor, owned: bool) -> None:
        """Buffer ``tensor`` under ``name``; one not ``owned`` (the model's storage) is copied."""
        if name in self.sources:
            raise ConfigurationError(
                f"`save_hf_checkpoint`: key_map maps both {self.sources[name]!r} and "
                f"{model_name!r} to {name!r}. Map each model name to a name of its own"
            )
        self.sources[name] = model_name
        if isinstance(tensor, DTensor):
            # Only an FSDP1 unit yields one: its summon gathers the data-parallel shards on rank
            # 0, and the state's other tensor-parallel shards stay on the other ranks.
            raise config_error(
                "save_hf_checkpoint",
                "model",
                f"its state {model_name!r} is a tensor-parallel DTensor inside an FSDP1 unit, "
                "whose full value rank 0 cannot gather alone",
                "Build the model with FullyShardBuilder, whose tensor-parallel models export",
            )
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
        """Name the staged files as ``save_pretrained`` does (one file, or shards and index)."""
        self.flush()
        assert self.staging is not None
        new = self.staging / "new"
        names = _file_names(self.stem, len(self.parts))
        weight_map: dict[str, str] = {}
        for (path, keys), name in zip(self.parts, names, strict=True):
            os.replace(path, new / name)
            weight_map.update(dict.fromkeys(keys, name))
        if len(names) != 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            _write_index(new / self.index_name, index)
        return names

    @property
    def index_name(self) -> str:
        return f"{self.stem}.safetensors.index.json"

    def commit(self) -> None:
        """Move an earlier export's files aside and the new ones in (renames, index last)."""
        assert self.staging is not None
        new, old = self.staging / "new", self.staging / "old"
        incoming = sorted(p.name for p in new.iterdir())
        for present in sorted(self.folder.iterdir()):
            # An earlier export under either library's names: two would leave the folder
            # with two checkpoints, of which a load cannot tell the current one.
            ours = _SHARD.match(present.name) or present.name in _EARLIER
            if (ours or present.name in incoming) and not present.is_dir():
                os.replace(present, old / present.name)
                self.replaced.append(present)
        # The index last: a reader that opens it finds every shard it names.
        for name in sorted(incoming, key=lambda n: n == self.index_name):
            os.replace(new / name, self.folder / name)
            self.placed.append(self.folder / name)

    def settle(self, done: bool) -> None:
        """Remove the staging folder; unless ``done``, first put the earlier export back."""
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


def _file_names(stem: str, count: int) -> tuple[str, ...]:
    """The weight files of an export in ``count`` files, named as ``save_pretrained`` names them
    (one file, or numbered shards)."""
    if count == 1:
        return (f"{stem}.safetensors",)
    return tuple(f"{stem}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1))


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
        problem = f"expected an int, got {type(max_shard_bytes).__name__}"
    elif max_shard_bytes <= 0:
        problem = f"{max_shard_bytes} is not positive"
    else:
        check_key_map("save_hf_checkpoint", key_map)
        return
    raise config_error(
        "save_hf_checkpoint", "max_shard_bytes", problem, "Pass a number of bytes, e.g. 5 * 10**9"
    )


def _own_states(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent states of an FSDP1 unit's subtree that no nested unit manages, named."""
    for name, param in module._parameters.items():
        if param is not None and name != _FLAT_PARAM:
            yield f"{prefix}{name}", param
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield f"{prefix}{name}", buf
    for name, child in module._modules.items():
        if child is not None and not isinstance(child, FullyShardedDataParallel):
            yield from _own_states(child, f"{prefix}{name}.")


States = Iterator[tuple[str, torch.Tensor, bool]]


def _fsdp1_states(model: nn.Module, rank: int, tally: _Tally) -> States:
    """Each FSDP1 unit's own states, unsharded one unit at a time (collective per unit, only
    rank 0 gets them, as views to copy)."""
    if rank == 0 and not isinstance(model, FullyShardedDataParallel):
        # States of modules outside every unit (a root that is not wrapped) are full already.
        for name, tensor in _own_states(model, ""):
            yield clean_name(name), tensor, False
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
            states = list(_own_states(unit, prefix))
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
    what ``save_pretrained`` writes (``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
    shards and ``model.safetensors.index.json``) and, for a transformers model, its
    ``config.json``; for a diffusers model, diffusers' names (``diffusion_pytorch_model...``)
    and its ``config.json`` through ``save_config``. ``FromCheckpoint(folder)`` and
    ``from_pretrained(folder)`` load it back.
    Only a complete export replaces an earlier one (the disk needs room for both); a failure
    leaves the earlier files as they were. No rank holds the whole model: rank 0's peak is one
    unit (FSDP2: one parameter) plus one file buffer of at most ``max_shard_bytes``.

    Args:
        model: the model a builder returned, or any module whose state dict holds DTensors or
            plain tensors.
        folder: where to write (created if needed).
        key_map: model name → checkpoint name, in the forms ``FromCheckpoint`` takes (None from
            a callable leaves the state out). Non-persistent buffers are never written.
        max_shard_bytes: the largest size of one file's tensors.

    Returns:
        The files written, the total size and rank 0's peak of held tensor bytes.

    Raises:
        ConfigurationError: a bad argument or a model not built, on every rank before any
            collective; two names mapped to one, or a failing ``key_map`` (on every rank, after
            the last gather, no file left behind).
        ExportError: rank 0 could not write or gather, or a peer rank died; on every rank, after
            removing every file the export wrote. Rank 0's error keeps the cause as
            ``__cause__``; the other ranks' message names it.
    """
    _check_arguments(folder, key_map, max_shard_bytes)
    mapper = key_mapper(key_map)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    agree("export (check)", _unbuilt(model) or _another_checkpoint(Path(folder)))
    stem = DIFFUSERS_STEM if is_diffusers_model(_unwrapped(model)) else "model"
    writer = _Writer(Path(folder), max_shard_bytes, _Tally(), stem)
    try:
        _gather_and_write(model, rank, mapper, writer)
        # Rank 0's failure reaches every rank through the agreement, as every rank-0 failure
        # of the library does: a key map's first (nothing committed yet), then the writing's.
        _agree_on(writer, "export (names)", ConfigurationError, shared=ConfigurationError)
        if rank == 0:
            _commit(model, writer)
        _agree_on(writer, "export (write)", FSDPBuilderError, shared=ExportError)
        count, total = _rank0_numbers(writer, distributed)
    except BaseException as exc:
        # The earlier export is put back, the staged files go.
        writer.settle(done=False)
        if writer.error is not None and isinstance(exc, Exception):
            # Rank 0 raises its own error, with its cause (the agreement raised its message).
            raise writer.error from writer.error.__cause__
        if isinstance(exc, Exception) and distributed and not _agreed(exc):
            # A collective failed: a peer died or failed, or never came to the agreement.
            raise _peer_lost(writer.folder, rank, exc) from exc
        raise
    writer.settle(done=True)
    return HFExport(
        files=_file_names(stem, count),
        total_size=total,
        peak_bytes=writer.tally.peak if rank == 0 else 0,
    )


def _gather_and_write(model: nn.Module, rank: int, mapper: Mapper, writer: _Writer) -> None:
    """Every rank's collectives and rank 0's staged writes; rank 0's failure stays in
    ``writer.error`` (the loop goes on: the other ranks are in its collectives)."""
    if rank == 0:
        try:
            writer.open()
        except OSError as exc:
            writer.fail(exc)
    fsdp1 = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    states = _fsdp1_states if fsdp1 else _dtensor_states
    with torch.no_grad():
        # Every rank runs the whole loop (its collectives), even after rank 0 failed.
        for model_name, tensor, owned in states(model, rank, writer.tally):
            if writer.error is not None:
                continue
            try:
                name = map_name(
                    mapper, model_name, "save_hf_checkpoint", "model name", "a checkpoint name"
                )
                if name is not None:
                    writer.add(model_name, name, tensor, owned)
            except (Exception, CheckpointException) as exc:
                writer.fail(exc)
            del tensor


def _commit(model: nn.Module, writer: _Writer) -> None:
    """Rank 0: name the staged files, add the config and swap the export in, unless failed."""
    if writer.error is not None:
        return
    try:
        writer.finish()
        assert writer.staging is not None
        _save_config(model, writer.staging / "new")
        writer.commit()
    except (Exception, CheckpointException) as exc:
        writer.fail(exc)


def _agree_on(
    writer: _Writer,
    stage: str,
    kind: type[FSDPBuilderError],
    shared: type[ConfigurationError] | type[ExportError],
) -> None:
    """Every rank: agree on rank 0's failure if it is a ``kind``; every rank then raises it as
    ``shared`` (rank 0 its own, in the caller). Rank 0 removes its files before any rank hears
    of the failure."""
    error = writer.error if isinstance(writer.error, kind) else None
    if error is not None:
        writer.settle(done=False)
    agree(stage, error, shared=shared)


def _rank0_numbers(writer: _Writer, distributed: bool) -> tuple[int, int]:
    """Rank 0's count of files and bytes written, on every rank (the last collective: a peer
    that dies here undoes rank 0's commit, in the caller)."""
    numbers = [len(writer.parts), writer.total]
    if not distributed:
        return numbers[0], numbers[1]
    sent = torch.tensor(numbers, dtype=torch.int64, device=collective_device(None))
    dist.broadcast(sent, src=0)
    return int(sent[0]), int(sent[1])


def _agreed(error: Exception) -> bool:
    """Whether ``error`` is rank 0's failure as the agreement raised it (not a lost peer)."""
    return isinstance(error, ConfigurationError | ExportError)


def _save_config(model: nn.Module, folder: Path) -> None:
    """The model's ``config.json``, so that ``from_pretrained(folder)`` loads the export: a
    transformers config's ``save_pretrained``, a diffusers model's ``save_config``."""
    save = getattr(getattr(model, "config", None), "save_pretrained", None)
    if callable(save):
        save(folder)
    else:
        inner: Any = _unwrapped(model)
        if is_diffusers_model(inner):
            inner.save_config(folder)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's model inside an FSDP1 root unit."""
    return model.module if isinstance(model, FullyShardedDataParallel) else model


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


def _another_checkpoint(folder: Path) -> ConfigurationError | None:
    """The refusal of an export into a folder holding a checkpoint of another format: a DCP
    checkpoint (the folder a model was loaded from, say) would stay beside the export, and a
    load of the folder could not tell which of the two is current."""
    if not is_dcp_folder(folder):
        return None
    return config_error(
        "save_hf_checkpoint",
        "folder",
        f"'{folder}' holds a DCP checkpoint ('{folder / '.metadata'}' and its data files); "
        "the export would put Hugging Face weights beside it, and a load of the folder could "
        "not tell which checkpoint is current",
        "Export into a fresh folder (or one holding only an earlier export), e.g. "
        f"save_hf_checkpoint(model, '{folder.parent / (folder.name + '-hf')}')",
    )


def _unbuilt(model: nn.Module) -> ConfigurationError | None:
    """The refusal of a model with states on meta (every rank alike, before any collective)."""
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


def _library_error(error: BaseException, folder: Path) -> FSDPBuilderError:
    """Rank 0's failure as every rank raises it: the library's own as it is, any other as an
    ExportError naming it, with it as the cause."""
    if isinstance(error, FSDPBuilderError):
        return error
    what, fix = "rank 0 could not write or gather a state", "Fix that cause"
    if isinstance(error, OSError) and error.errno in _OS_FIXES:
        what, fix = _OS_FIXES[error.errno]
    wrapped = ExportError(
        f"`save_hf_checkpoint` could not write to '{folder}': {what} "
        f"({type(error).__name__}: {error}). {fix}; the files this export wrote were removed."
    )
    wrapped.__cause__ = error
    return wrapped


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFExport", "save_hf_checkpoint"]
