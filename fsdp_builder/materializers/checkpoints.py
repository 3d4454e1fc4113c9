"""``FromCheckpoint``: a checkpoint every rank opens and validates itself (``prepare``), then
reads only what it keeps, unit by unit: its shards' rows with FSDP2, one unit's full tensors at a
time with FSDP1. No collective carries weights; without a shared filesystem rank 0 reads."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import attrs
import torch
from attrs import define, frozen
from torch.distributed.tensor import DTensor, Replicate, Shard
from typing_extensions import override

from fsdp_builder.common.hashing import digest63
from fsdp_builder.errors import MaterializationError, config_error
from fsdp_builder.materializers.ignored import give_storage_in_place, meta_ignored
from fsdp_builder.materializers.initializers import MaterializerRun
from fsdp_builder.materializers.loading import (
    KeyMap,
    Loader,
    LoaderSpec,
    LoadRun,
    Rank0Run,
    check_key_map,
    describe_key_map,
    key_mapper,
    open_matched,
    prepare_rank0,
    report_match,
    unit_entries,
)
from fsdp_builder.materializers.nonfinite import (
    check_nonfinite_mode,
    holds_nonfinite,
    nonfinite_names,
)
from fsdp_builder.planning.plan import Unit
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.runtime.collectives import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.shards import local_slices
from fsdp_builder.runtime.tree import allocate_unit, local_tensor
from fsdp_builder.sources import CheckpointSource, FillsTargets
from fsdp_builder.sources.base import Index, reader

_FIX = (
    "Pass the path of a .safetensors file, of a folder holding a *.safetensors.index.json and "
    "its shards (or a pytorch_model.bin index and its .bin shards), of a torch.save file, or of "
    "a torch.distributed.checkpoint folder (with its .metadata), saved from this model; map "
    "differing names with key_map"
)

CHECKPOINT_SPEC = LoaderSpec(
    name="FromCheckpoint",
    argument="path",
    word="checkpoint",
    fix=_FIX,
    check_kinds=True,
    missing_fix=(
        "Check the path for a typo. If the checkpoint is on rank 0's disk only (no shared "
        "filesystem), pass shared_filesystem=False: rank 0 then reads it and sends the weights"
    ),
    mismatch_fix=(
        "Pass a checkpoint saved from a model of the same architecture and config, and map "
        "names that differ with key_map"
    ),
)


def local_index(tensor: DTensor) -> tuple[slice, ...]:
    """The slices of the full tensor that ``tensor``'s local shard holds (plain ``Shard`` and
    ``Replicate`` placements: a strided or partial one is no box of the full tensor)."""
    if any(type(p) not in (Shard, Replicate) for p in tensor.placements):
        raise MaterializationError(
            f"FromCheckpoint cannot fill a DTensor placed as {tensor.placements}."
        )
    return local_slices(tensor)


def _check_path(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, str | os.PathLike):
        return
    raise config_error(
        "FromCheckpoint",
        "path",
        f"expected a str or os.PathLike naming the checkpoint, got {type(value).__name__}",
        "Pass the path every rank can read, e.g. FromCheckpoint('/ckpt/model'); for a state "
        "dict that rank 0 holds in memory, use FromStateDict(state_dict)",
    )


def _check_flag(fix: str) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, bool):
            raise config_error(
                "FromCheckpoint",
                attribute.name,
                f"expected True or False, got {value!r} ({type(value).__name__})",
                fix,
            )

    return check


@frozen
class FromCheckpoint(Loader):
    """Materializes from a checkpoint every rank reads itself, in any format
    ``fsdp_builder.sources`` knows (a ``.safetensors`` file, a Hugging Face folder of
    safetensors or ``.bin`` shards, a ``torch.save`` file, a ``torch.distributed.checkpoint``
    folder, or a format you registered with :func:`fsdp_builder.sources.register_format`),
    detected from the path every rank passes.

    Each rank reads only what it keeps (FSDP2: its shards' rows; FSDP1: one unit's full tensors
    at a time); no collective carries weights. ``shared_filesystem=False``: rank 0 alone reads
    and the weights travel as with ``FromStateDict``.

    ``key_map`` maps checkpoint names to model names: a dict (names it lacks are kept),
    ``(regex, replacement)`` pairs applied in order, or a callable (None leaves an entry out).
    Floating dtypes convert to the model's; ``strict=False`` loads what matches (the rest must
    already be real). Non-persistent buffers are computed, not loaded; ignored states are
    loaded whole on every rank.

    Raises:
        ConfigurationError: on every rank before any weight is written: no checkpoint at the
            path, missing or unexpected keys, wrong shapes, an integer/float mismatch, a broken
            or truncated checkpoint, a key_map that fails or differs between ranks.
        MaterializationError: ``nonfinite="error"`` and NaN/inf found (named).

    Example:
        ```python
        hf = {"model.embed_tokens.weight": "tok_embeddings.weight"}  # ... one per key
        FullyShardBuilder().wrap(TransformerBlock).materialize(
            FromCheckpoint("/ckpt/llama-hf", key_map=hf)
        ).build(meta_model)
        ```
    """

    path: str | os.PathLike[str] = attrs.field(validator=_check_path)
    key_map: KeyMap = attrs.field(
        default=None,
        validator=lambda _, __, value: check_key_map("FromCheckpoint", value),
        eq=False,
    )
    strict: bool = attrs.field(
        default=True,
        validator=_check_flag(
            "Pass strict=True (every state of the model from the checkpoint, nothing left "
            "over) or strict=False (load what matches; the rest must already be real)"
        ),
    )
    shared_filesystem: bool = attrs.field(
        default=True,
        validator=_check_flag(
            "Pass shared_filesystem=True (every rank reads the path itself) or "
            "shared_filesystem=False (rank 0 reads it and sends the weights)"
        ),
    )
    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=check_bucket_bytes)
    # NaN / inf in the loaded weights: "warn" (a UserWarning naming the tensors), "error"
    # (MaterializationError on every rank) or "ignore".
    nonfinite: str = attrs.field(default="warn", validator=check_nonfinite_mode)

    @property
    def communicates(self) -> bool:  # type: ignore[override]
        """Collectives per unit only where rank 0 alone reads or where NaN in one rank's shard
        must stop every rank; else the ranks agree once, when the build ends."""
        return not self.shared_filesystem or self.nonfinite == "error"

    @override
    def fills_placed(self) -> bool:
        return self.shared_filesystem

    def describe(self) -> str:
        """What ranks compare: the path (unless rank 0 alone reads it) and the key_map."""
        path = repr(os.fspath(self.path)) if self.shared_filesystem else "<read by rank 0>"
        return (
            f"FromCheckpoint(path={path}, key_map={describe_key_map(self.key_map)}, "
            f"strict={self.strict}, shared_filesystem={self.shared_filesystem}, "
            f"bucket_bytes={self.bucket_bytes}, nonfinite={self.nonfinite!r})"
        )

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Open and validate the checkpoint (on every rank, or on rank 0 alone without a shared
        filesystem); every rank raises if any rank's check failed (collective)."""
        opener = partial(
            open_matched,
            self.path,
            env,
            CHECKPOINT_SPEC,
            key_mapper(self.key_map),
            strict=self.strict,
            every_state=not self.shared_filesystem,
        )
        if not self.shared_filesystem:
            run = Rank0Run(env, CHECKPOINT_SPEC, self.nonfinite, bucket_bytes=self.bucket_bytes)
            return prepare_rank0(env, run, opener)
        local = LocalRun(env, CHECKPOINT_SPEC, self.nonfinite)
        found, error = local.open(opener, f"'{os.fspath(self.path)}'")
        # What ranks compare after opening: where each checkpoint key goes, its shape and dtype.
        settings = [
            (f"key_map({key!r})", f"{found.mapped.get(key)!r} {list(meta.shape)} {meta.dtype}")
            for key, meta in sorted((local.source.tensors() if local.source else {}).items())
        ]
        with local.starting():
            agree(
                "materialize (validate)",
                error,
                group=env.agreement_group,
                fingerprint=digest63(repr(settings)),
                description={"config": settings, "plan": []},
            )
        report_match(env, found)
        return local


def fill_checked(
    source: CheckpointSource, targets: Mapping[str, torch.Tensor], *, check: bool = True
) -> list[str]:
    """Write each entry into its target (a DTensor: its local part), converting dtypes; returns
    the keys holding NaN or inf (with ``check``). Each run of rows is checked right after its
    read, still in cache (a second pass over the unit cost a fifth of the read's time)."""
    if isinstance(source, FillsTargets):
        source.fill(targets)
        return nonfinite_names(targets.items()) if check else []
    bad: list[str] = []
    read = reader(source)  # a large tensor is read in many runs
    with torch.no_grad():
        for key, target in targets.items():
            if isinstance(target, DTensor):
                local = local_tensor(target)
                if local.numel() and _read_rows(read, key, local_index(target), local, check):
                    bad.append(key)
            elif _read_rows(read, key, None, target, check):
                bad.append(key)
    return bad


# How much of a tensor is read before that part is checked: well inside a core's share of the
# last-level cache.
CHECK_RUN_BYTES = 4 << 20


def _read_rows(
    read: Callable[[str, Index | None, torch.Tensor], None],
    key: str,
    index: Index | None,
    out: torch.Tensor,
    check: bool,
) -> bool:
    """Read ``key[index]`` into ``out``; with ``check``, True when it holds NaN/inf (checked run
    by run on a large CPU tensor with torch on one thread, else after the whole read)."""
    rows = out.shape[0] if out.dim() else 0
    # Runs pay off for a sum on the reading thread alone: with several threads each run starts
    # a parallel region (with ranks sharing cores, three times slower in all than one sum), and
    # on an accelerator each run's verdict would be a synchronization.
    by_runs = (
        check
        and rows > 1
        and (out.is_floating_point() or out.is_complex())
        and out.device.type == "cpu"
        and torch.get_num_threads() == 1
        and out.is_contiguous()
        and out.numel() * out.element_size() > CHECK_RUN_BYTES
    )
    if not by_runs:
        read(key, index, out)
        return check and holds_nonfinite(out)
    first = index[0] if index else slice(0, rows)
    base, step = first.start or 0, first.step or 1
    rest = tuple(index[1:]) if index else ()
    per_run = max(1, CHECK_RUN_BYTES * rows // (out.numel() * out.element_size()))
    found = False
    for a in range(0, rows, per_run):
        b = min(rows, a + per_run)
        run = out[a:b]
        read(key, (slice(base + a * step, base + b * step, step), *rest), run)
        found = holds_nonfinite(run) or found
    return found


@define
class LocalRun(LoadRun):
    """The rank-local load: each unit reads only this rank's part of its states."""

    def materialize(self, unit: Unit) -> int:
        env = self.env
        assert self.source is not None, "materialize after close"
        modules = list(unit.modules)
        # In place, so that an ignored parameter stays the one FSDP ignores; it is read whole.
        give_storage_in_place(meta_ignored(modules, env.ignored), env.device)
        allocate_unit(env.sharded_root(unit), modules, env.device, env.shard_specs)
        targets: dict[str, torch.Tensor] = {}
        loaded: list[str] = []
        written = 0
        for entry in unit_entries(unit):
            name = next((n for n in entry.names if n in self.keys), None)
            if name is None:
                continue  # strict=False and real: keeps its value
            target = entry.tensor if isinstance(entry.tensor, DTensor) else entry.tensor.detach()
            targets[self.keys[name]] = target
            loaded.append(name)
            local = local_tensor(target)
            written += local.numel() * local.element_size()
        error: MaterializationError | None = None
        bad: set[str] = set()
        try:
            bad = set(fill_checked(self.source, targets, check=self.nonfinite != "ignore"))
        except Exception as exc:
            error = self.unreadable(unit, exc)
        # FSDP1: every rank read the same full tensors and decides alone; FSDP2 shards: agreed.
        self.finish(
            unit,
            modules,
            env.device,
            lambda: [n for n in loaded if self.keys[n] in bad],
            error,
            alike=not env.shard_first,
        )
        env.logger.debug("loaded_unit", unit=unit.label, tensors=len(targets), bytes=written)
        return written


__all__ = [
    "CHECKPOINT_SPEC",
    "FromCheckpoint",
    "KeyMap",
    "LocalRun",
    "describe_key_map",
    "key_mapper",
    "local_index",
]
