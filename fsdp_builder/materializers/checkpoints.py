"""Loading checkpoint folders that every rank can read: Hugging Face safetensors (one file, or
shards listed by a ``*.safetensors.index.json``) and ``torch.distributed.checkpoint`` (DCP)
folders.

Why a materializer of its own rather than another source of :class:`FromStateDict`: the two
have different contracts. ``FromStateDict`` trusts rank 0 alone (other ranks pass None, and
only rank 0 needs the file); ``FromCheckpoint`` expects every rank to be given the same path
and to open it itself, maps checkpoint names to model names (``key_map``), converts floating
dtypes and loads a subset with ``strict=False``. Keeping them apart keeps both signatures
honest; with ``shared_filesystem=False`` ``FromCheckpoint`` falls back to ``FromStateDict``'s
rank-0 read and scatter/broadcast, reusing its run.

How a load goes:

- ``prepare``: every rank opens the checkpoint's headers (safetensors) or metadata (DCP), maps
  the names and validates them against the unit plan: missing and unexpected keys, shapes,
  integer/float mismatches, files an index names but that are absent, keys an index lists but
  its file lacks, truncated or unreadable files. The ranks then agree, so a bad checkpoint
  stops every rank before any weight is written.
- per unit, **rank-local reads**: with a backend that shards first (FSDP2) the unit's
  parameters are already DTensors, and each rank reads only the rows of its local shard
  (``safe_open(...).get_slice(name)[rows]``; for DCP, a ``dcp.load`` of the unit's DTensors
  without collectives, which plans the reads from each DTensor's local chunk). With FSDP1 each
  rank reads the unit's full tensors (one unit at a time) and FSDP1 keeps its shard. No
  collective carries weights, only the pipeline's tiny agreements.

DCP loads go unit by unit too (``dcp.load(..., no_dist=True)`` on the unit's own states), not
once for the whole model at the root: each rank then holds at most one unfilled unit, the
FSDP1 path works the same way as the FSDP2 one, and no step needs the whole model sharded.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from attrs import define, frozen
from torch.distributed.tensor import DTensor, Replicate, Shard
from typing_extensions import override

from fsdp_builder.errors import ConfigurationError, MaterializationError, config_error
from fsdp_builder.materializers.buffers import Computed, fill_buffers
from fsdp_builder.materializers.initializers import (
    BaseMaterializer,
    MaterializerRun,
    buffers_to_compute,
)
from fsdp_builder.materializers.loading import _LoadRun, _Reader, _unit_entries, start_rank0_load
from fsdp_builder.materializers.nonfinite import (
    check_nonfinite_mode,
    nonfinite_names,
    nonfinite_verdict,
)
from fsdp_builder.planning.ignored import IgnoredStates, clean_name
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.runtime.collectives import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import allocate_empty, unit_modules
from fsdp_builder.versions import DCP_NO_DIST, require

KeyMap = Mapping[str, str] | Sequence[tuple[str, str]] | Callable[[str], "str | None"] | None

_FIX = (
    "Pass the path of a .safetensors file, of a folder holding a *.safetensors.index.json and "
    "its shards, or of a torch.distributed.checkpoint folder (with its .metadata), saved from "
    "this model; map differing names with key_map"
)
_SHOWN = 8


def _listed(items: Sequence[str], sep: str = ", ") -> str:
    shown = sep.join(items[:_SHOWN])
    return shown + (f"{sep}... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")


def _invalid(describe: str, problem: str) -> ConfigurationError:
    return config_error("FromCheckpoint", "path", f"{describe} {problem}", _FIX)


# -- key maps -------------------------------------------------------------------------------


def _check_key_map(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None or callable(value) or isinstance(value, Mapping):
        return
    if isinstance(value, Sequence) and not isinstance(value, str):
        for pair in value:
            if not (
                isinstance(pair, tuple | list)
                and len(pair) == 2
                and all(isinstance(x, str) for x in pair)
            ):
                raise config_error(
                    "FromCheckpoint",
                    "key_map",
                    f"expected (regex, replacement) pairs of strings, got {pair!r}",
                    "Pass e.g. [(r'^model\\.', '')]",
                )
            try:
                re.compile(pair[0])
            except re.error as exc:
                raise config_error(
                    "FromCheckpoint", "key_map", f"{pair[0]!r} is not a regex ({exc})", "Fix it"
                ) from exc
        return
    raise config_error(
        "FromCheckpoint",
        "key_map",
        f"expected a dict, (regex, replacement) pairs or a callable, got {type(value).__name__}",
        "Pass e.g. {'lm_head.weight': 'output.weight'} or [(r'^model\\.', '')]",
    )


def key_mapper(key_map: KeyMap) -> Callable[[str], str | None]:
    """Checkpoint name → model name (None: leave the checkpoint entry out).

    A dict renames the names it holds and keeps the others; (regex, replacement) pairs are
    applied in order with ``re.sub``; a callable is used as it is."""
    if key_map is None:
        return lambda name: name
    if isinstance(key_map, Mapping):
        table = dict(key_map)
        return lambda name: table.get(name, name)
    if callable(key_map):
        return key_map
    rules = [(re.compile(p), r) for p, r in key_map]

    def apply(name: str) -> str:
        for pattern, replacement in rules:
            name = pattern.sub(replacement, name)
        return name

    return apply


# -- sources ----------------------------------------------------------------------------------


@frozen
class _Meta:
    shape: tuple[int, ...]
    dtype: torch.dtype


_ST_DTYPES = {
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


class _Source:
    """A checkpoint every rank opened itself: names with shapes and dtypes, and reads."""

    describe: str = ""
    meta: dict[str, _Meta]

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        raise NotImplementedError

    def fill(self, targets: dict[str, torch.Tensor]) -> None:
        """Write each checkpoint entry into its target (a tensor or a DTensor)."""
        with torch.no_grad():
            for key, target in targets.items():
                if isinstance(target, DTensor):
                    local = target.to_local()
                    if local.numel():
                        local.copy_(self.read(key, local_index(target)))
                else:
                    target.copy_(self.read(key))

    def close(self) -> None:
        return None


class _SafetensorsSource(_Source):
    """One .safetensors file, or the shards an index lists; files stay open until close()."""

    def __init__(self, files: dict[str, Path], describe: str) -> None:
        from safetensors import safe_open

        self.describe = describe
        self.meta = {}
        self._file_of: dict[str, Any] = {}
        self._handles: list[Any] = []
        by_file: dict[Path, list[str]] = {}
        for key, file in files.items():
            by_file.setdefault(file, []).append(key)
        absent_files = sorted(str(f.name) for f in by_file if not f.is_file())
        if absent_files:
            raise _invalid(
                describe, f"names shard file(s) that do not exist: {_listed(absent_files)}"
            )
        absent: list[str] = []
        for file, keys in by_file.items():
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:
                raise _invalid(
                    describe,
                    f"holds '{file.name}', which is truncated or not a safetensors file "
                    f"({type(exc).__name__}: {exc})",
                ) from exc
            self._handles.append(handle)
            present = set(handle.keys())
            for key in keys:
                if key not in present:
                    absent.append(f"{key} (in {file.name})")
                    continue
                piece = handle.get_slice(key)
                dtype = _ST_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise _invalid(
                        describe, f"stores '{key}' as {piece.get_dtype()}, not supported"
                    )
                self.meta[key] = _Meta(tuple(piece.get_shape()), dtype)
                self._file_of[key] = handle
        if absent:
            raise _invalid(
                describe,
                f"has {len(absent)} key(s) in its index but not in their file: {_listed(absent)}",
            )

    @override
    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        handle = self._file_of[key]
        if index is None or not index:
            tensor: torch.Tensor = handle.get_tensor(key)
            return tensor
        part: torch.Tensor = handle.get_slice(key)[index]
        return part

    @override
    def close(self) -> None:
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles = []
        self._file_of = {}


class _DCPSource(_Source):
    """A torch.distributed.checkpoint folder: its metadata, and loads without collectives."""

    def __init__(self, folder: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        require(DCP_NO_DIST, "FromCheckpoint", "path")
        self.describe = f"the DCP folder '{folder}'"
        self.folder = folder
        try:
            metadata = FileSystemReader(str(folder)).read_metadata()
        except Exception as exc:
            raise _invalid(
                self.describe, f"has an unreadable .metadata ({type(exc).__name__}: {exc})"
            ) from exc
        self.meta = {
            key: _Meta(tuple(item.size), item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }

    @override
    def fill(self, targets: dict[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        if not targets:
            return
        # DCP copies into same-dtype targets only: read into staging of the checkpoint's dtype
        # where the model's differs.
        staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        request: dict[str, torch.Tensor] = {}
        for key, target in targets.items():
            dtype = self.meta[key].dtype
            if target.dtype == dtype:
                request[key] = target
                continue
            if isinstance(target, DTensor):
                buf: torch.Tensor = DTensor.from_local(
                    torch.empty_like(target.to_local(), dtype=dtype),
                    target.device_mesh,
                    target.placements,
                    run_check=False,
                    shape=target.shape,
                    stride=target.stride(),
                )
            else:
                buf = torch.empty_like(target, dtype=dtype)
            staged[key] = (buf, target)
            request[key] = buf
        with torch.no_grad():
            dcp.load(request, checkpoint_id=str(self.folder), no_dist=True)
            for buf, target in staged.values():
                if isinstance(target, DTensor):
                    assert isinstance(buf, DTensor)
                    target.to_local().copy_(buf.to_local())
                else:
                    target.copy_(buf)

    @override
    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        meta = self.meta[key]
        full = torch.empty(meta.shape, dtype=meta.dtype)
        self.fill({key: full})
        return full[index] if index else full


def open_checkpoint(path: str | os.PathLike[str]) -> _Source:
    """Open the checkpoint at ``path``, detecting its format from what the path holds."""
    p = Path(os.fspath(path))
    where = f"'{p}'"
    if not p.exists():
        raise _invalid(where, f"does not exist (on rank {_rank()})")
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise _invalid(
                where,
                f"holds several indexes ({_listed([i.name for i in indexes])}); pass the path "
                "of the one to load",
            )
        if indexes:
            return _open_index(indexes[0])
        if (p / ".metadata").is_file():
            return _DCPSource(p)
        singles = sorted(p.glob("*.safetensors"))
        if len(singles) == 1:
            return _SafetensorsSource(_single_keys(singles[0]), f"'{singles[0]}'")
        if any(p.glob("*.distcp")):
            raise _invalid(where, "holds DCP shard files (*.distcp) but no .metadata file")
        if singles:
            raise _invalid(
                where,
                f"holds {len(singles)} .safetensors files but no *.safetensors.index.json "
                "saying which tensor lives where",
            )
        raise _invalid(where, "holds no .safetensors file, index or DCP .metadata")
    if p.name.endswith(".index.json"):
        return _open_index(p)
    if p.suffix == ".safetensors":
        return _SafetensorsSource(_single_keys(p), where)
    raise _invalid(
        where,
        "is neither a .safetensors file nor an index (for torch.save files use FromStateDict)",
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _single_keys(file: Path) -> dict[str, Path]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            keys = list(handle.keys())
    except Exception as exc:
        raise _invalid(
            f"'{file}'", f"is truncated or not a safetensors file ({type(exc).__name__}: {exc})"
        ) from exc
    return dict.fromkeys(keys, file)


def _open_index(index: Path) -> _SafetensorsSource:
    where = f"'{index}'"
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise _invalid(where, f"is not readable JSON ({exc})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise _invalid(where, "has no `weight_map` of tensor names to file names")
    files = {key: index.parent / name for key, name in weight_map.items()}
    return _SafetensorsSource(files, where)


# -- which rows a rank keeps ------------------------------------------------------------------


def local_index(tensor: DTensor) -> tuple[slice, ...]:
    """The slices of the full tensor that ``tensor``'s local shard holds: for each ``Shard(d)``
    on mesh dim ``i``, ``fully_shard``'s layout (torch.chunk: ``ceil(n / size)`` per rank, the
    last ranks shorter or empty); ``Replicate`` keeps the whole dim."""
    mesh = tensor.device_mesh
    shape = tuple(tensor.shape)
    offsets = [0] * len(shape)
    seen: set[int] = set()
    for i, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            d = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
            if d in seen:
                raise MaterializationError(
                    f"FromCheckpoint cannot read a tensor sharded twice along dim {d} "
                    f"({tensor.placements})."
                )
            seen.add(d)
            chunk = math.ceil(shape[d] / mesh.size(i)) if shape[d] else 0
            offsets[d] = min(mesh.get_local_rank(i) * chunk, shape[d])
        elif not isinstance(placement, Replicate):
            raise MaterializationError(
                f"FromCheckpoint cannot fill a DTensor placed as {tensor.placements}."
            )
    local = tensor.to_local().shape
    return tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))


# -- validation -------------------------------------------------------------------------------


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if dtype == torch.bool else "integer"


@define
class Match:
    """How a checkpoint fits a model: the checkpoint key of each model name, what was left out,
    and the dtype conversions a load makes (``"bfloat16->float32": count``)."""

    keys: dict[str, str] = attrs.field(factory=dict)
    missing: list[str] = attrs.field(factory=list)
    unexpected: list[str] = attrs.field(factory=list)
    converted: dict[str, int] = attrs.field(factory=dict)


def match_checkpoint(
    meta: Mapping[str, _Meta],
    mapper: Callable[[str], str | None],
    plan: UnitPlan,
    ignored: IgnoredStates,
    *,
    strict: bool,
    describe: str,
    every_state: bool = False,
) -> Match:
    """Map the checkpoint's names and compare them with the plan; raises a ConfigurationError
    naming every problem, capped per kind. ``every_state``: missing keys are errors even when
    not ``strict``."""
    mapped: dict[str, str] = {}
    collisions: list[str] = []
    for key in meta:
        name = mapper(key)
        if name is None:
            continue
        name = clean_name(name)
        if name in mapped:
            collisions.append(f"'{mapped[name]}' and '{key}' both map to '{name}'")
        mapped[name] = key
    found = Match()
    shapes: list[str] = []
    dtypes: list[str] = []
    unfillable: list[str] = []
    matched = 0
    for unit in plan:
        for entry in _unit_entries(unit, ignored, plan):
            present = [n for n in entry.names if n in mapped]
            if not present:
                found.missing.append(" / ".join(entry.names))
                if entry.tensor.is_meta:
                    unfillable.append(entry.names[0])
                continue
            matched += 1
            key = mapped[present[0]]
            got, want = meta[key], entry.tensor
            if got.shape != tuple(want.shape):
                shapes.append(
                    f"'{key}' is {list(got.shape)} in the checkpoint but "
                    f"{list(want.shape)} in the model"
                )
            elif _kind(got.dtype) != _kind(want.dtype):
                dtypes.append(
                    f"'{key}' is {got.dtype} in the checkpoint but {want.dtype} in the model"
                )
            elif got.dtype != want.dtype:
                pair = f"{str(got.dtype).removeprefix('torch.')}->" + str(want.dtype).removeprefix(
                    "torch."
                )
                found.converted[pair] = found.converted.get(pair, 0) + 1
            for n in entry.names:
                found.keys[n] = key
    known = {clean_name(k) for k in plan.root.module.state_dict(keep_vars=True)}
    found.unexpected = sorted(mapped[n] for n in set(mapped) - known)
    problems: list[str] = []
    if collisions:
        problems.append(f"{len(collisions)} name collision(s) after key_map: {_listed(collisions)}")
    if found.missing and (strict or every_state or unfillable):
        shown = found.missing if strict or every_state else unfillable
        problems.append(f"{len(shown)} missing key(s): {_listed(shown)}")
    if found.unexpected and strict:
        problems.append(f"{len(found.unexpected)} unexpected key(s): {_listed(found.unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} wrong shape(s): {_listed(shapes, '; ')}")
    if dtypes:
        problems.append(f"{len(dtypes)} integer/float mismatch(es): {_listed(dtypes, '; ')}")
    if not problems:
        return found
    hint = ""
    total = matched + len(found.missing)
    if matched * 2 < total:
        names = [n for u in plan for e in _unit_entries(u, ignored, plan) for n in e.names]
        hint = (
            f". Only {matched} of the model's {total} states are in it: a checkpoint of another "
            "model, or a key_map that misses a rule? Checkpoint keys start "
            f"{_listed(sorted(meta)[:3])}; model names start {_listed(names[:3])}"
        )
    elif not strict and unfillable and not every_state:
        hint = " (strict=False leaves out only states that are already real, not on meta)"
    raise ConfigurationError(
        f"`FromCheckpoint` got an invalid `path`: {describe} does not match the model: "
        f"{'; '.join(problems)}{hint}. {_FIX}."
    )


# -- the materializer -------------------------------------------------------------------------


@frozen
class FromCheckpoint(BaseMaterializer):
    """Materializes from a checkpoint every rank reads itself: a ``.safetensors`` file, a
    folder with ``*.safetensors.index.json`` and its shard files (Hugging Face layout), or a
    ``torch.distributed.checkpoint`` folder (``.metadata``); the format is detected from the
    path, which every rank passes.

    Each rank reads only what it keeps: with a backend that shards first (FSDP2,
    ``FullyShardBuilder``) the rows of its local shards; with FSDP1 one unit's full tensors at a
    time. No collective carries weights. ``shared_filesystem=False``: only rank 0 reads and the
    weights travel as with ``FromStateDict`` (scatter with FSDP2, broadcast with FSDP1); every
    state must then be in the checkpoint.

    ``key_map`` maps checkpoint names to model names: a dict (names it lacks are kept),
    ``(regex, replacement)`` pairs applied in order, or a callable (returning None leaves an
    entry out). Keys, shapes and dtypes are checked on every rank before any weight is written;
    a bad checkpoint raises the same ``ConfigurationError`` everywhere. Floating dtypes convert
    to the model's (logged as the ``converted_dtypes`` event); integer/float mismatches are
    errors. ``strict=False`` loads what matches and logs the rest (``checkpoint_partial``);
    states missing from the checkpoint must then already be real. Non-persistent buffers are
    not in checkpoints and are not loaded: build the modules that own them on a real device.

    Raises:
        ConfigurationError: on every rank before any weight is written: a path that holds no
            checkpoint, missing or unexpected keys, wrong shapes, an index naming a missing file,
            a truncated file, a DCP folder without metadata, an integer/float mismatch.
        MaterializationError: ``nonfinite="error"`` and NaN/inf found (named).

    Example:
        ```python
        hf = {"model.embed_tokens.weight": "tok_embeddings.weight"}  # ... one per key
        FullyShardBuilder().wrap(TransformerBlock).materialize(
            FromCheckpoint("/ckpt/llama-hf", key_map=hf)
        ).build(meta_model)
        ```
    """

    path: str | os.PathLike[str] = attrs.field(
        validator=attrs.validators.instance_of((str, os.PathLike))
    )
    key_map: KeyMap = attrs.field(default=None, validator=_check_key_map, eq=False)
    strict: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    shared_filesystem: bool = attrs.field(
        default=True, validator=attrs.validators.instance_of(bool)
    )
    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=check_bucket_bytes)
    # NaN / inf in the loaded weights: "warn" (a UserWarning naming the tensors), "error"
    # (MaterializationError on every rank) or "ignore".
    nonfinite: str = attrs.field(default="warn", validator=check_nonfinite_mode)
    shard_first: ClassVar[bool] = True

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Open and validate the checkpoint (on every rank, or on rank 0 alone without a shared
        filesystem); every rank raises if any rank's check failed (collective)."""
        if not self.shared_filesystem:
            return self._prepare_rank0(env)
        source: _Source | None = None
        error: BaseException | None = None
        found = Match()
        computed: Computed = {}
        try:
            # No checkpoint holds non-persistent buffers: the model computes them.
            computed = buffers_to_compute(env.plan.root.module, env.ignored, initialized=False)
            source = open_checkpoint(self.path)
            found = match_checkpoint(
                source.meta,
                key_mapper(self.key_map),
                env.plan,
                env.ignored,
                strict=self.strict,
                describe=source.describe,
            )
        except ConfigurationError as exc:
            error = exc
        except Exception as exc:  # a reader's own error: every rank must hear about it
            error = _invalid(f"'{self.path}'", f"could not be read ({type(exc).__name__}: {exc})")
        try:
            agree("materialize (validate)", error, group=env.agreement_group)
        except BaseException:
            if source is not None:
                source.close()
            raise
        assert source is not None
        _report(env, found)
        return _LocalRun(env, source, found.keys, self.nonfinite, computed)

    def _prepare_rank0(self, env: Environment) -> MaterializerRun:
        verdict: str | None = None
        reader: _Reader | None = None
        if dist.get_rank() == 0:
            source: _Source | None = None
            try:
                source = open_checkpoint(self.path)
                found = match_checkpoint(
                    source.meta,
                    key_mapper(self.key_map),
                    env.plan,
                    env.ignored,
                    strict=self.strict,
                    describe=source.describe,
                    every_state=True,
                )
                reader = _MappedReader(source, found.keys)
                _report(env, found)
            except Exception as exc:
                if source is not None:
                    source.close()
                verdict = str(
                    exc
                    if isinstance(exc, ConfigurationError)
                    else _invalid(f"'{self.path}'", f"could not be read ({exc})")
                )
        run = _LoadRun(
            env, reader, self.bucket_bytes, nonfinite=self.nonfinite, loader="FromCheckpoint"
        )
        return start_rank0_load(env, verdict, run)

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        raise MaterializationError(
            "`FromCheckpoint` loads through the run its prepare(env) returns; build through a "
            "builder, which calls prepare(env) first."
        )


def _report(env: Environment, found: Match) -> None:
    if found.converted:
        env.logger.info("converted_dtypes", conversions=dict(found.converted))
    if found.missing or found.unexpected:
        env.logger.warning(
            "checkpoint_partial",
            missing=found.missing[:_SHOWN],
            missing_count=len(found.missing),
            unexpected=found.unexpected[:_SHOWN],
            unexpected_count=len(found.unexpected),
        )


class _MappedReader(_Reader):
    """Rank 0's view of a checkpoint under model names, for ``FromStateDict``'s run."""

    def __init__(self, source: _Source, keys: dict[str, str]) -> None:
        super().__init__({}, source.describe)
        self._source = source
        self._keys = keys

    @override
    def keys(self) -> list[str]:
        return list(self._keys)

    @override
    def shape(self, key: str) -> tuple[int, ...]:
        return self._source.meta[self._keys[key]].shape

    @override
    def get(self, key: str) -> torch.Tensor:
        return self._source.read(self._keys[key])

    @override
    def close(self) -> None:
        self._source.close()
        super().close()


@define
class _LocalRun:
    """One build's rank-local load: the open checkpoint and the checkpoint key of each model
    name. Each unit reads only this rank's part of its states."""

    env: Environment
    source: _Source | None
    keys: dict[str, str]
    nonfinite: str = "warn"
    computed: Computed = attrs.field(factory=dict)

    def materialize(self, unit: Unit) -> int:
        env = self.env
        assert self.source is not None, "materialize after close"
        modules = unit_modules(unit.module, env.ignored.modules)
        allocate_empty(modules, env.device)
        targets: dict[str, torch.Tensor] = {}
        loaded: list[tuple[str, torch.Tensor]] = []
        written = 0
        for entry in _unit_entries(unit, env.ignored):
            name = next((n for n in entry.names if n in self.keys), None)
            if name is None:
                continue  # strict=False and real: keeps its value
            target = (
                entry.tensor.detach() if not isinstance(entry.tensor, DTensor) else entry.tensor
            )
            targets[self.keys[name]] = target
            loaded.append((name, target))
            local = target.to_local() if isinstance(target, DTensor) else target
            written += local.numel() * local.element_size()
        error: MaterializationError | None = None
        try:
            self.source.fill(targets)
        except Exception as exc:
            error = MaterializationError(
                f"`FromCheckpoint` could not read unit '{unit.label}' out of "
                f"{self.source.describe}: {type(exc).__name__}: {exc}. {_FIX}."
            )
            error.__cause__ = exc
        # With FSDP1 every rank read the same full tensors and decides alone; with shards
        # (FSDP2) a refusal is agreed, every rank taking part, also one whose read failed.
        verdict = nonfinite_verdict(
            self.nonfinite,
            [] if error is not None else nonfinite_names(loaded),
            loader="FromCheckpoint",
            unit=unit.label,
            source=self.source.describe,
            alike=not env.shards_first,
            group=env.agreement_group,
        )
        if error is not None:
            raise error
        if verdict is not None:
            raise verdict
        fill_buffers(modules, self.computed, env.device)
        env.logger.debug("loaded_unit", unit=unit.label, tensors=len(targets), bytes=written)
        return written

    def close(self) -> None:
        self.computed = {}
        if self.source is not None:
            self.source.close()
            self.source = None


__all__ = ["FromCheckpoint", "KeyMap", "Match", "key_mapper", "local_index", "open_checkpoint"]
