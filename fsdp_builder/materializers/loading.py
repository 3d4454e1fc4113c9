"""Loading real weights: a full state dict held by rank 0 (in memory or in a file), streamed to
every rank one unit at a time.

Only rank 0 reads the source. Before any weight is written, rank 0 checks the source's keys and
shapes against the unit plan and sends its verdict to every rank, so a bad checkpoint raises the
same error everywhere instead of failing half-way through a broadcast. Then, per unit, rank 0
copies the unit's tensors out of the source and broadcasts them; the other ranks only ever hold
storage for the unit being built, never the full state dict.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from attrs import define, frozen
from typing_extensions import override

from fsdp_builder.errors import ConfigurationError, MaterializationError, config_error
from fsdp_builder.materializers.buffers import Computed, fill_buffers
from fsdp_builder.materializers.initializers import (
    BaseMaterializer,
    MaterializerRun,
    buffers_to_compute,
)
from fsdp_builder.materializers.nonfinite import (
    check_nonfinite_mode,
    nonfinite_names,
    nonfinite_verdict,
)
from fsdp_builder.planning.ignored import IgnoredStates, clean_name
from fsdp_builder.planning.plan import Unit, UnitPlan
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.runtime.collectives import (
    DEFAULT_BUCKET_BYTES,
    broadcast_tensors,
    check_bucket_bytes,
    collective_device,
    scatter_unit_state,
    sync_stages,
)
from fsdp_builder.runtime.environment import Environment
from fsdp_builder.runtime.tree import allocate_empty, module_names, qualified, unit_modules

_FIX_SOURCE = (
    "Pass the model's full state dict (`model.state_dict()` of the unwrapped model) on rank 0, "
    "or the path of a file saved from it with torch.save or safetensors.torch.save_file"
)


class _Reader:
    """Read access to the source on rank 0: names, shapes, and one tensor at a time."""

    def __init__(self, tensors: Mapping[str, Any], describe: str) -> None:
        self._tensors = tensors
        self.describe = describe

    def keys(self) -> list[str]:
        return list(self._tensors.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def get(self, key: str) -> torch.Tensor:
        value = self._tensors[key]
        return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)

    def close(self) -> None:
        """Drop the source (a file's mapping goes with its last tensor)."""
        self._tensors = {}


class _SafetensorsReader(_Reader):
    """Reads one tensor at a time from a .safetensors file (nothing else is loaded)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt", device="cpu")
        super().__init__({}, f"'{path}'")

    @override
    def keys(self) -> list[str]:
        return list(self._file.keys())

    @override
    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(key).get_shape())

    @override
    def get(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._file.get_tensor(key)
        return tensor

    @override
    def close(self) -> None:
        self._file.__exit__(None, None, None)
        super().close()


def _not_a_state_dict(what: str, why: str) -> ConfigurationError:
    return config_error(
        "FromStateDict", "source", f"{what} is not a state dict ({why})", _FIX_SOURCE
    )


def _check_mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _not_a_state_dict(what, f"it holds a {type(value).__name__}")
    bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        shown = ", ".join(repr(k) for k in bad[:5])
        raise _not_a_state_dict(
            what,
            f"entries {shown}{' ...' if len(bad) > 5 else ''} are not tensors named by strings; "
            "if it is a checkpoint holding a state dict, pass that inner dict",
        )
    _check_values(value, what)
    return value


def _check_values(value: Mapping[str, torch.Tensor], what: str) -> None:
    """Tensors that hold no values this loader can read: on meta, or sharded (DTensor)."""
    from torch.distributed.tensor import DTensor

    sharded = [k for k, v in value.items() if isinstance(v, DTensor)]
    if sharded:
        raise config_error(
            "FromStateDict",
            "source",
            f"{what} holds DTensors ({_names(sharded)}): it is the state dict of a sharded "
            "model, each rank holding a part",
            "Pass the full state dict: torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) on the "
            "sharded model, or model.state_dict() of the unwrapped one",
        )
    empty = [k for k, v in value.items() if v.is_meta]
    if empty:
        raise config_error(
            "FromStateDict",
            "source",
            f"{what} holds tensors on the meta device, which have no values ({_names(empty)})",
            "Pass the state dict of a model with real weights (not one built under "
            "torch.device('meta'))",
        )


def _names(keys: list[str]) -> str:
    more = f" ... ({len(keys)} in all)" if len(keys) > 5 else ""
    return ", ".join(f"'{k}'" for k in keys[:5]) + more


def _open(source: Any) -> _Reader:
    """Open the source on rank 0; raises a ConfigurationError that says what to pass."""
    if source is None:
        raise config_error(
            "FromStateDict",
            "source",
            "rank 0 was given None",
            "Rank 0 holds the weights: pass it the state dict or a file path (other ranks may "
            "pass None)",
        )
    if isinstance(source, Mapping):
        return _Reader(_check_mapping(source, "the mapping given"), "the state dict given")
    path = Path(os.fspath(source))
    if not path.exists():
        raise config_error(
            "FromStateDict",
            "source",
            f"the path '{path}' does not exist on rank 0",
            "Pass the path of a torch.save or .safetensors file that rank 0 can read",
        )
    if not path.is_file():
        raise _not_a_state_dict(f"'{path}'", "it is not a file")
    if path.suffix == ".safetensors":
        try:
            return _SafetensorsReader(path)
        except Exception as exc:
            raise _not_a_state_dict(f"'{path}'", f"safetensors could not read it: {exc}") from exc
    try:
        try:
            # mmap keeps rank 0 from reading the whole file up front (zip-format files only).
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _not_a_state_dict(f"'{path}'", f"torch.load failed: {first[:200]}") from exc
    return _Reader(_check_mapping(loaded, f"'{path}'"), f"'{path}'")


@frozen
class _Entry:
    """One storage of a unit with every name it goes by (tied parameters have several)."""

    names: tuple[str, ...]
    tensor: torch.Tensor = attrs.field(eq=False)


def _unit_entries(
    unit: Unit, ignored: IgnoredStates, plan: UnitPlan | None = None
) -> Iterator[_Entry]:
    modules = unit_modules(unit.module, _stops(unit, ignored, plan))
    rel = module_names(unit.module)
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for m in modules:
        prefix = qualified(unit.fqn, rel.get(id(m), ""))
        skip: set[str] = getattr(m, "_non_persistent_buffers_set", set())
        named: list[tuple[str, torch.Tensor]] = [
            (n, p)
            for n, p in m.named_parameters(recurse=False, remove_duplicate=False)
            if p is not None and p not in ignored.params
        ]
        named += [
            (n, b)
            for n, b in m.named_buffers(recurse=False, remove_duplicate=False)
            if b is not None and n not in skip
        ]
        for name, t in named:
            full = clean_name(f"{prefix}.{name}" if prefix else name)
            by_id.setdefault(id(t), ([], t))[0].append(full)
    for names, t in by_id.values():
        yield _Entry(tuple(dict.fromkeys(names)), t)


def _stops(unit: Unit, ignored: IgnoredStates, plan: UnitPlan | None) -> set[Any]:
    """Where a walk of ``unit`` stops: ignored modules, and (before the build wrapped them) the
    modules of the other units."""
    others = {u.module for u in plan} - {unit.module} if plan is not None else set()
    return set(ignored.modules) | others


def _shape(shape: tuple[int, ...]) -> str:
    return str(list(shape))


def validate_source(reader: _Reader, plan: UnitPlan, ignored: IgnoredStates) -> str | None:
    """Compare the source with the model's unit plan; None when it fits, else the message."""
    keys = set(reader.keys())
    root = plan.root.module
    known = {clean_name(k) for k in root.state_dict(keep_vars=True)}
    missing: list[str] = []
    shapes: list[str] = []
    for unit in plan:
        for entry in _unit_entries(unit, ignored, plan):
            present = [n for n in entry.names if n in keys]
            if not present:
                missing.append(" / ".join(entry.names))
                continue
            got = reader.shape(present[0])
            if got != tuple(entry.tensor.shape):
                shapes.append(
                    f"'{present[0]}' is {_shape(got)} in the source but "
                    f"{_shape(tuple(entry.tensor.shape))} in the model"
                )
    unexpected = sorted(keys - known)
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} missing key(s): {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected key(s): {', '.join(unexpected[:8])}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    if shapes:
        problems.append(
            f"{len(shapes)} wrong shape(s): {'; '.join(shapes[:8])}"
            f"{' ...' if len(shapes) > 8 else ''}"
        )
    if not problems:
        return None
    hint = ""
    if unexpected and any(k.startswith(("module.", "_orig_mod.")) for k in unexpected):
        hint = " (keys start with a wrapper prefix: strip 'module.' / '_orig_mod.')"
    return (
        f"`FromStateDict` got an invalid `source`: {reader.describe} does not match the model: "
        f"{'; '.join(problems)}{hint}. {_FIX_SOURCE}, with the same architecture and config."
    )


def _check_source_type(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None or isinstance(value, Mapping | str | os.PathLike):
        return
    raise config_error(
        "FromStateDict",
        attribute.name,
        f"expected a state dict, a path or None, got {type(value).__name__}",
        _FIX_SOURCE + " (ranks other than 0 may pass None)",
    )


@frozen
class FromStateDict(BaseMaterializer):
    """Materializes from a full state dict held by global rank 0: a mapping of names to tensors,
    or a path to a ``torch.save`` or ``.safetensors`` file that rank 0 reads. Other ranks pass
    None (or anything; only rank 0's source is used) and may hold the model on meta.

    Keys and shapes are checked in ``prepare`` against every unit, on rank 0, and the verdict
    reaches every rank before any weight is written. Each unit is then copied out of the source on
    rank 0 and broadcast in buckets of ``bucket_bytes`` to every rank (every replica too under
    hybrid sharding); with a backend that shards first (FSDP2) rank 0 scatters only each rank's
    slices instead. Dtypes follow the model. The source is closed when the build ends, however
    it ends.

    Raises:
        ConfigurationError: on every rank before any weight is written: rank 0 has no source, a
            path that does not exist or is not a state dict, missing or unexpected keys, wrong
            shapes, meta tensors or DTensors in the source.
        MaterializationError: ``nonfinite="error"`` and NaN/inf found (named).

    Example:
        ```python
        source = "model.pt" if dist.get_rank() == 0 else None
        FullyShardBuilder().wrap(Block).materialize(FromStateDict(source)).build(meta_model)
        ```
    """

    # Compared by identity: a state dict of tensors has no single truth value.
    source: Any = attrs.field(
        validator=_check_source_type, eq=attrs.cmp_using(eq=lambda a, b: a is b)
    )
    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=check_bucket_bytes)
    # NaN / inf in the loaded weights: "warn" (a UserWarning naming the tensors), "error"
    # (MaterializationError on every rank) or "ignore".
    nonfinite: str = attrs.field(default="warn", validator=check_nonfinite_mode)
    # Honoured by backends that shard on meta (FSDP2): rank 0 then scatters only the slices.
    shard_first: ClassVar[bool] = True

    def describe(self) -> str:
        """What ranks compare: only rank 0's source is used, so it is left out."""
        return f"FromStateDict(bucket_bytes={self.bucket_bytes}, nonfinite={self.nonfinite!r})"

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Open and validate the source on rank 0; every rank raises the same error if it does
        not fit (collective over the build's ranks)."""
        verdict: str | None = None
        reader: _Reader | None = None
        if dist.get_rank() == 0:
            try:
                reader = _open(self.source)
                verdict = validate_source(reader, env.plan, env.ignored)
            except ConfigurationError as exc:
                verdict = str(exc)
            except Exception as exc:  # whatever a reader raises, the other ranks must hear it
                verdict = str(_not_a_state_dict("the source", f"{type(exc).__name__}: {exc}"))
        return start_rank0_load(
            env, verdict, _LoadRun(env, reader, self.bucket_bytes, nonfinite=self.nonfinite)
        )

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        raise MaterializationError(
            "`FromStateDict` loads through the run its prepare(env) returns; build through a "
            "builder, which calls prepare(env) first."
        )


def start_rank0_load(env: Environment, verdict: str | None, run: _LoadRun) -> _LoadRun:
    """Rank 0's ``verdict`` on its source (None: it fits) reaches every rank, which raises it
    alike; then the run gets the non-persistent buffers the model computes (no source holds
    them; the same on every rank, so a failure there is every rank's). Collective. The run is
    closed if the load does not start."""
    box: list[Any] = [verdict]
    dist.broadcast_object_list(box, src=0, group=env.agreement_group)
    try:
        if box[0] is not None:
            raise ConfigurationError(box[0])
        run.computed = buffers_to_compute(env.plan.root.module, env.ignored, initialized=False)
    except BaseException:
        run.close()
        raise
    return run


@define
class _LoadRun:
    """One build's load: the open source (rank 0 only), streamed unit by unit."""

    env: Environment
    reader: _Reader | None
    bucket_bytes: int
    computed: Computed = attrs.field(factory=dict)
    nonfinite: str = "warn"
    loader: str = "FromStateDict"

    def close(self) -> None:
        self.computed = {}
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def materialize(self, unit: Unit) -> int:
        env = self.env
        if env.shards_first:
            return self._scatter(unit)
        reader = self.reader
        modules = unit_modules(unit.module, env.ignored.modules)
        device = collective_device(env.agreement_group)
        allocate_empty(modules, device)
        entries = list(_unit_entries(unit, env.ignored))
        error: BaseException | None = None
        if reader is not None:
            keys = set(reader.keys())
            try:
                with torch.no_grad():
                    for entry in entries:
                        name = next(n for n in entry.names if n in keys)
                        entry.tensor.detach().copy_(reader.get(name))
            except Exception as exc:  # the other ranks are about to wait for this unit
                error = MaterializationError(
                    f"`FromStateDict` could not copy unit '{unit.label}' out of "
                    f"{reader.describe}: {type(exc).__name__}: {exc}. {_FIX_SOURCE}."
                )
        agree("materialize (load)", error, unit=unit.label, group=env.agreement_group)
        written = 0
        tensors = [e.tensor.detach() for e in entries]
        for group, src in sync_stages(env):
            written += broadcast_tensors(tensors, src, group, self.bucket_bytes)
        # Every rank now holds the same values: each decides alone, and all alike.
        verdict = nonfinite_verdict(
            self.nonfinite,
            nonfinite_names((e.names[0], e.tensor.detach()) for e in entries),
            loader=self.loader,
            unit=unit.label,
            source="rank 0's source" if reader is None else reader.describe,
            alike=True,
        )
        if verdict is not None:
            raise verdict
        fill_buffers(modules, self.computed, device)
        env.logger.debug("loaded_unit", unit=unit.label, tensors=len(tensors), bytes=written)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _scatter(self, unit: Unit) -> int:
        """The unit is already sharded (on meta): rank 0 reads this unit's tensors, once per
        storage (tied names share it), and sends each rank only its slices. The source was
        validated in prepare; should reading still fail, rank 0 sends zeros in place of what it
        could not read and raises only after the unit's last collective, so no rank is left
        waiting (the builder then raises on every rank)."""
        reader = self.reader
        state: dict[str, torch.Tensor] | None = None
        error: MaterializationError | None = None
        if reader is not None:
            state = {}
            keys = set(reader.keys())
            try:
                for entry in _unit_entries(unit, self.env.ignored):
                    present = [n for n in entry.names if n in keys]
                    if present:
                        tensor = reader.get(present[0])
                        state.update(dict.fromkeys(present, tensor))
            except Exception as exc:
                error = MaterializationError(
                    f"`FromStateDict` could not read unit '{unit.label}' out of "
                    f"{reader.describe}: {type(exc).__name__}: {exc}. {_FIX_SOURCE}."
                )
        scatter_error: MaterializationError | None = None
        try:
            received = scatter_unit_state(unit, self.env, state)
        except MaterializationError as exc:
            scatter_error = exc
            received = 0  # a read error says more than the entries it left out
        # Ranks hold different slices: with nonfinite="error" every rank takes part in the
        # verdict (also one whose read failed), so that all raise alike.
        names = []
        if error is None and scatter_error is None:
            names = nonfinite_names(
                (e.names[0], e.tensor) for e in _unit_entries(unit, self.env.ignored)
            )
        verdict = nonfinite_verdict(
            self.nonfinite,
            names,
            loader=self.loader,
            unit=unit.label,
            source="rank 0's source" if reader is None else reader.describe,
            alike=False,
            group=self.env.agreement_group,
        )
        if error is not None:
            raise error
        if scatter_error is not None:
            raise scatter_error
        if verdict is not None:
            raise verdict
        modules = unit_modules(unit.module, self.env.ignored.modules)
        fill_buffers(modules, self.computed, self.env.device)
        return received
