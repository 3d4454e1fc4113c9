"""What every loader shares: the key map, opening a source and matching it against the unit
plan (one prepare path), the tail of each unit's load, and the rank-0 load (``FromStateDict``,
and ``FromCheckpoint`` without a shared filesystem), where rank 0 alone reads."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from attrs import define, frozen
from torch import nn
from typing_extensions import override

from fsdp_builder.common.describe import describe as describe_value
from fsdp_builder.errors import ConfigurationError, MaterializationError, config_error
from fsdp_builder.materializers.buffers import Computed, fill_buffers
from fsdp_builder.materializers.ignored import give_storage_in_place, meta_ignored, move_in_place
from fsdp_builder.materializers.initializers import (
    BaseMaterializer,
    MaterializerRun,
    buffers_to_compute,
    placed_states,
)
from fsdp_builder.materializers.nonfinite import (
    check_nonfinite_mode,
    nonfinite_names,
    nonfinite_verdict,
)
from fsdp_builder.planning.context import ConfigureContext
from fsdp_builder.planning.ignored import clean_name
from fsdp_builder.planning.plan import Unit
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
from fsdp_builder.runtime.tree import allocate_empty
from fsdp_builder.sources import CheckpointSource, MissingPath, SourceError, TensorMeta, open_source
from fsdp_builder.sources.base import listed, reader
from fsdp_builder.sources.derived import derive
from fsdp_builder.sources.model_rules import checkpoint_rules

Mapper = Callable[[str], "str | None"]
KeyMap = Mapping[str, str] | Sequence[tuple[str, str]] | Mapper | None

_FIX_SOURCE = (
    "Pass the model's full state dict (`model.state_dict()` of the unwrapped model) on rank 0, "
    "or the path of a file saved from it with torch.save or safetensors.torch.save_file"
)


def check_key_map(owner: str, value: Any) -> None:
    """Refuse, in ``owner``'s words, a ``key_map`` that is not None, a dict, a callable or
    (regex, replacement) pairs."""
    if value is None or callable(value) or isinstance(value, Mapping):
        return
    error = partial(config_error, owner, "key_map")
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise error(
            "expected a dict, (regex, replacement) pairs, a callable or None, got "
            f"{type(value).__name__} {value!r:.80}",
            "Pass e.g. {'lm_head.weight': 'output.weight'} or [(r'^model\\.', '')]",
        )
    for pair in value:
        strings = isinstance(pair, tuple | list) and all(isinstance(x, str) for x in pair)
        if not strings or len(pair) != 2:
            raise error(
                f"expected (regex, replacement) pairs of strings, got {pair!r}",
                "Pass e.g. [(r'^model\\.', '')]",
            )
        try:
            re.compile(pair[0])
        except re.error as exc:
            raise error(f"{pair[0]!r} is not a regex ({exc})", "Fix it") from exc


def _identity(name: str) -> str:
    return name


def key_mapper(key_map: KeyMap) -> Mapper:
    """``key_map`` as a function (None: leave the entry out): a dict renames the names it
    holds, (regex, replacement) pairs apply in order with ``re.sub``, a callable is itself."""
    if key_map is None:
        return _identity
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


def describe_key_map(key_map: KeyMap) -> str:
    """``key_map`` as ranks compare it: a dict by its sorted items, a callable by its name."""
    return describe_value(
        dict(sorted(key_map.items())) if isinstance(key_map, Mapping) else key_map
    )


def map_name(mapper: Mapper, name: str, owner: str, given: str, wanted: str) -> str | None:
    """``mapper(name)``; one that raises or returns neither a str nor None is refused as
    ``owner``'s ``key_map`` (``given``: what ``name`` is; ``wanted``: what it should return)."""
    error = partial(config_error, owner, "key_map")
    try:
        mapped = mapper(name)
    except Exception as exc:
        raise error(
            f"raised {type(exc).__name__}: {exc} for the {given} '{name}'",
            f"Make it return {wanted} for every {given} (or None to leave the entry out)",
        ) from exc
    if mapped is not None and not isinstance(mapped, str):
        raise error(
            f"returned {mapped!r} ({type(mapped).__name__}) for the {given} '{name}'",
            f"Make it return {wanted} as a string, or None to leave the entry out",
        )
    return mapped


@frozen
class LoaderSpec:
    """How a loader words its errors: its name, the argument holding the source, the word for
    the source, its fixes, and whether integer/float mismatches are refused."""

    name: str
    argument: str
    word: str
    fix: str
    check_kinds: bool
    missing_fix: str
    mismatch_fix: str  # the fix when the source does not fit the model

    def error(self, problem: str, fix: str | None = None) -> ConfigurationError:
        return config_error(self.name, self.argument, problem, fix or self.fix)


STATE_DICT_SPEC = LoaderSpec(
    name="FromStateDict",
    argument="source",
    word="source",
    fix=_FIX_SOURCE,
    check_kinds=False,
    missing_fix="Pass the path of a torch.save or .safetensors file that rank 0 can read",
    mismatch_fix=f"{_FIX_SOURCE}, with the same architecture and config",
)


@frozen
class Entry:
    """One storage of a unit with every name it goes by (tied parameters have several)."""

    names: tuple[str, ...]
    tensor: torch.Tensor = attrs.field(eq=False)


def unit_entries(unit: Unit) -> list[Entry]:
    """The persistent states ``unit`` owns, with the ignored ones below its modules (loaded
    whole, on every rank): its state records grouped by the tensor each slot holds now."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for state in unit.states:
        if state.persistent:
            t = state.tensor
            by_id.setdefault(id(t), ([], t))[0].append(state.name)
    return [Entry(tuple(dict.fromkeys(names)), t) for names, t in by_id.values()]


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
    # Checkpoint key → the model name it maps to (None: left out), for ranks to compare.
    mapped: dict[str, str | None] = attrs.field(factory=dict)


def match_source(
    tensors: Mapping[str, TensorMeta],
    mapper: Mapper,
    entries: list[Entry],
    model: nn.Module,
    *,
    spec: LoaderSpec,
    describe: str,
    strict: bool = True,
    every_state: bool = True,
) -> Match:
    """Map the source's names and compare them with every unit's ``entries``; a
    ConfigurationError in ``spec``'s words names every problem. ``every_state``: missing keys
    are errors even when not ``strict``."""
    found = Match()
    by_name: dict[str, str] = {}
    collisions: list[str] = []
    for key in sorted(tensors):
        name = map_name(mapper, key, spec.name, "checkpoint key", "the model's name")
        found.mapped[key] = name = None if name is None else clean_name(name)
        if name is None:
            continue
        if name in by_name:
            collisions.append(f"'{by_name[name]}' and '{key}' both map to '{name}'")
        by_name[name] = key
    shapes: list[str] = []
    dtypes: list[str] = []
    unfillable: list[str] = []
    for entry in entries:
        present = [n for n in entry.names if n in by_name]
        if not present:
            found.missing.append(" / ".join(entry.names))
            if entry.tensor.is_meta:
                unfillable.append(entry.names[0])
            continue
        key = by_name[present[0]]
        got, want = tensors[key], entry.tensor
        if got.shape != tuple(want.shape):
            shapes.append(
                f"'{key}' is {list(got.shape)} in the {spec.word} but "
                f"{list(want.shape)} in the model"
            )
        elif spec.check_kinds and _kind(got.dtype) != _kind(want.dtype):
            dtypes.append(
                f"'{key}' is {got.dtype} in the {spec.word} but {want.dtype} in the model"
            )
        elif got.dtype != want.dtype:
            pair = "->".join(str(d).removeprefix("torch.") for d in (got.dtype, want.dtype))
            found.converted[pair] = found.converted.get(pair, 0) + 1
        for n in entry.names:
            found.keys[n] = key
    known = {clean_name(k) for k in model.state_dict(keep_vars=True)}
    found.unexpected = sorted(by_name[n] for n in set(by_name) - known)
    # Not strict (and every rank reading): only states left on meta are missing.
    meta_only = not (strict or every_state)
    problems = [
        f"{len(items)} {what}: {listed(items, sep=sep)}"
        for items, what, sep in (
            (collisions, "name collision(s) after key_map", ", "),
            (unfillable if meta_only else found.missing, "missing key(s)", ", "),
            (found.unexpected if strict else [], "unexpected key(s)", ", "),
            (shapes, "wrong shape(s)", "; "),
            (dtypes, "integer/float mismatch(es)", "; "),
        )
        if items
    ]
    if not problems:
        return found
    raise config_error(
        spec.name,
        spec.argument,
        f"{describe} does not match the model: {'; '.join(problems)}"
        f"{_hint(found, shapes, tensors, entries, meta_only and bool(unfillable))}",
        spec.mismatch_fix,
    )


def _hint(
    found: Match,
    shapes: list[str],
    tensors: Mapping[str, TensorMeta],
    entries: list[Entry],
    meta_only: bool,
) -> str:
    if found.unexpected and any(k.startswith(("module.", "_orig_mod.")) for k in found.unexpected):
        return " (keys start with a wrapper prefix: strip 'module.' / '_orig_mod.')"
    total = len(entries)
    matched = total - len(found.missing)
    if matched * 2 < total:
        names = [n for e in entries for n in e.names]
        return (
            f". Only {matched} of the model's {total} states are in it: a checkpoint of another "
            "model, or a key_map that misses a rule? Checkpoint keys start "
            f"{listed(sorted(tensors)[:3])}; model names start {listed(names[:3])}"
        )
    if shapes and len(shapes) * 2 > matched:
        return (
            f". {len(shapes)} of the {matched} states it shares with the model differ in shape: "
            "a checkpoint of another config of this model?"
        )
    if meta_only:
        return " (strict=False leaves out only states that are already real, not on meta)"
    return ""


def open_as(
    source: Mapping[str, Any] | str | os.PathLike[str], spec: LoaderSpec
) -> CheckpointSource:
    """``open_source(source)``, its errors in ``spec``'s words."""
    try:
        return open_source(source)
    except MissingPath as exc:
        raise spec.error(exc.problem, spec.missing_fix) from exc
    except SourceError as exc:
        raise spec.error(exc.problem, exc.fix) from exc
    except ConfigurationError:
        raise
    except Exception as exc:  # a reader's own error: the loader's words, the cause kept
        what = f"'{os.fspath(source)}'" if not isinstance(source, Mapping) else "the state dict"
        raise spec.error(f"{what} could not be read ({type(exc).__name__}: {exc})") from exc


def open_matched(
    source: Mapping[str, Any] | str | os.PathLike[str],
    env: Environment,
    spec: LoaderSpec,
    mapper: Mapper = _identity,
    *,
    strict: bool = True,
    every_state: bool = True,
) -> tuple[CheckpointSource, Match]:
    """The prepare step of every load, on one rank: open ``source``, apply the model's
    checkpoint rules and match it against the plan. Errors in ``spec``'s words; nothing stays
    open then."""
    opened = open_as(source, spec)
    model = env.plan.root.module
    try:
        # Each unit's states by name, read once for both the layout rules and the match.
        entries = [e for unit in env.plan for e in unit_entries(unit)]
        held = opened.tensors()
        complete = all(any(n in held for n in e.names) for e in entries)
        try:
            opened = derive(opened, checkpoint_rules(model, complete=complete))
        except SourceError as exc:
            raise spec.error(f"{opened.describe} {exc.problem}", exc.fix) from exc
        found = match_source(
            opened.tensors(),
            mapper,
            entries,
            model,
            spec=spec,
            describe=opened.describe,
            strict=strict,
            every_state=every_state,
        )
    except BaseException:
        opened.close()
        raise
    return opened, found


def report_match(env: Environment, found: Match) -> None:
    """Log the dtype conversions and, for partial loads, what was left out."""
    if found.converted:
        env.logger.info("converted_dtypes", conversions=dict(found.converted))
    if found.missing or found.unexpected:
        env.logger.warning(
            "checkpoint_partial",
            missing=found.missing[:8],
            missing_count=len(found.missing),
            unexpected=found.unexpected[:8],
            unexpected_count=len(found.unexpected),
        )


@define
class LoadRun:
    """One build's load: the open source (None on ranks that do not read), the source key of
    each model name and the non-persistent buffers the model computes."""

    env: Environment
    spec: LoaderSpec
    nonfinite: str = "warn"
    source: CheckpointSource | None = None
    keys: dict[str, str] = attrs.field(factory=dict)
    computed: Computed = attrs.field(factory=dict)

    def close(self) -> None:
        self.computed = {}
        if self.source is not None:
            self.source.close()
            self.source = None

    def open(
        self, opener: Callable[[], tuple[CheckpointSource, Match]], what: str
    ) -> tuple[Match, ConfigurationError | None]:
        """Open and match the source on this rank; what that raises is returned, in the spec's
        words, for every rank to hear."""
        try:
            self.source, found = opener()
        except ConfigurationError as exc:
            return Match(), exc
        except Exception as exc:  # whatever a reader raises, the other ranks must hear it
            error = self.spec.error(f"{what} could not be read ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
            return Match(), error
        self.keys = found.keys
        return found, None

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around every rank's agreement on the sources: then the buffers the model computes (a
        failure there is not the source's); the run is closed if either fails."""
        try:
            yield
            env = self.env
            self.computed = buffers_to_compute(env.plan.root.module, env.ignored, initialized=False)
        except BaseException:
            self.close()
            raise

    def unreadable(self, unit: Unit, exc: Exception, verb: str = "read") -> MaterializationError:
        assert self.source is not None
        error = MaterializationError(
            f"`{self.spec.name}` could not {verb} unit '{unit.label}' out of "
            f"{self.source.describe}: {type(exc).__name__}: {exc}. {self.spec.fix}."
        )
        error.__cause__ = exc
        return error

    def finish(
        self,
        unit: Unit,
        modules: list[nn.Module],
        device: torch.device,
        bad: Callable[[], list[str]],
        *errors: BaseException | None,
        alike: bool,
    ) -> None:
        """The tail of a unit's load: the NaN/inf verdict over ``bad()`` (agreed unless every
        rank holds the same values, every rank taking part, also one whose read failed), the
        first error, then the computed buffers."""
        verdict = nonfinite_verdict(
            self.nonfinite,
            [] if any(e is not None for e in errors) else bad(),
            loader=self.spec.name,
            unit=unit.label,
            source="rank 0's source" if self.source is None else self.source.describe,
            alike=alike,
            group=self.env.agreement_group,
        )
        for error in (*errors, verdict):
            if error is not None:
                raise error
        fill_buffers(modules, self.computed, device)


def prepare_rank0(
    env: Environment, run: Rank0Run, open_on_rank0: Callable[[], tuple[CheckpointSource, Match]]
) -> Rank0Run:
    """Rank 0 opens and matches its source; its verdict reaches every rank, which raises it
    alike. Collective."""
    error: ConfigurationError | None = None
    if dist.get_rank() == 0:
        found, error = run.open(open_on_rank0, "the source")
        if error is None:
            report_match(env, found)
    with run.starting():
        agree("materialize (open)", error, group=env.agreement_group, shared=ConfigurationError)
    return run


@define
class Rank0Run(LoadRun):
    """The rank-0 load: rank 0 reads each unit and broadcasts it (FSDP1) or scatters each
    rank's slices (FSDP2)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def materialize(self, unit: Unit) -> int:
        env = self.env
        if env.shard_first:
            return self._scatter(unit)
        read = None if self.source is None else reader(self.source)
        modules = list(unit.modules)
        device = collective_device(env.agreement_group)
        fresh = meta_ignored(modules, env.ignored)
        give_storage_in_place(fresh, device)
        allocate_empty(modules, device)
        entries = unit_entries(unit)
        error: BaseException | None = None
        if read is not None:
            try:
                with torch.no_grad():
                    for entry in entries:
                        name = next(n for n in entry.names if n in self.keys)
                        read(self.keys[name], None, entry.tensor.detach())
            except Exception as exc:  # the other ranks are about to wait for this unit
                error = self.unreadable(unit, exc, "copy")
        agree("materialize (load)", error, unit=unit.label, group=env.agreement_group)
        # Ignored states stay where they are (another device than the group's, perhaps).
        written = self._broadcast(entries, device)
        move_in_place(fresh, env.device)
        # Every rank now holds the same values: each decides alone, and all alike.
        named = [(e.names[0], e.tensor.detach()) for e in entries]
        self.finish(unit, modules, device, partial(nonfinite_names, named), alike=True)
        env.logger.debug("loaded_unit", unit=unit.label, tensors=len(entries), bytes=written)
        return sum(e.tensor.numel() * e.tensor.element_size() for e in entries)

    def _scatter(self, unit: Unit) -> int:
        """The unit is already sharded (on meta): rank 0 reads its tensors, once per storage,
        and sends each rank its slices. A failed read is raised after the unit's last
        collective (rank 0 sends zeros in its place), so no rank is left waiting."""
        source = self.source
        state: dict[str, torch.Tensor] | None = None
        error: MaterializationError | None = None
        if source is not None:
            state = {}
            try:
                for entry in unit_entries(unit):
                    present = [n for n in entry.names if n in self.keys]
                    if present:
                        state.update(dict.fromkeys(present, source.read(self.keys[present[0]])))
            except Exception as exc:
                error = self.unreadable(unit, exc)
        scatter_error: MaterializationError | None = None
        modules = list(unit.modules)
        # In place, so that the ignored parameter stays the one fully_shard ignores.
        give_storage_in_place(meta_ignored(modules, self.env.ignored), self.env.device)
        try:
            received = scatter_unit_state(unit, self.env, state)
        except MaterializationError as exc:
            scatter_error = exc
            received = 0  # a read error says more than the entries it left out
        received += self._broadcast_ignored(unit, state)

        def bad() -> list[str]:
            entries = unit_entries(unit)
            return nonfinite_names((e.names[0], e.tensor) for e in entries)

        self.finish(unit, modules, self.env.device, bad, error, scatter_error, alike=False)
        return received

    def _broadcast(self, entries: list[Entry], device: torch.device) -> int:
        """Every stage's source rank's values of ``entries``, through copies on ``device``
        where they live elsewhere; returns the bytes received."""
        staged = [e.tensor.detach().to(device) for e in entries]
        received = 0
        for group, src in sync_stages(self.env):
            received += broadcast_tensors(staged, src, group, self.bucket_bytes)
        with torch.no_grad():
            for entry, sent in zip(entries, staged, strict=True):
                if sent.data_ptr() != entry.tensor.data_ptr():
                    entry.tensor.detach().copy_(sent)
        return received

    def _broadcast_ignored(self, unit: Unit, state: dict[str, torch.Tensor] | None) -> int:
        """The unit's ignored states, whole on every rank: rank 0's values (``state``, None
        elsewhere) broadcast; every rank joins, also when rank 0's read failed."""
        env = self.env
        wanted = {id(s.tensor) for s in unit.states if s.ignored}
        entries = [e for e in unit_entries(unit) if id(e.tensor) in wanted]
        if not entries:
            return 0
        if state is not None:
            for entry in entries:
                value = next((state[n] for n in entry.names if n in state), None)
                if value is not None:
                    entry.tensor.detach().copy_(value)
        return self._broadcast(entries, collective_device(env.agreement_group))


class Loader(BaseMaterializer):
    """A materializer that loads through the run its ``prepare`` returns."""

    __slots__ = ()
    # Honoured by backends that shard on meta (FSDP2): each rank gets only its slices.
    shard_first: ClassVar[bool] = True

    def fills_placed(self) -> bool:
        """Whether it fills tensor-parallel states (DTensors placed before the build) on a real
        device, each rank reading its own part; one that sends whole units from one rank
        cannot."""
        return False

    @override
    def check_context(self, context: ConfigureContext) -> None:
        """Refuse tensor-parallel states this loader cannot fill, before any collective."""
        placed = placed_states(context)
        refused = [n for n, t in placed if t.is_meta or not self.fills_placed()]
        if not refused:
            return
        shown = listed([repr(n) for n in refused])
        if self.fills_placed():
            problem = f"these tensor-parallel states are on the meta device: {shown}"
            fix = (
                "Give the placed model storage and values first, as torchtitan does "
                "(`model.to_empty(device=...)` after parallelize_module, then its "
                "`init_weights()`), then load: each rank reads its own part"
            )
        else:
            problem = (
                f"these states are DTensors placed before the build (tensor parallelism): "
                f"{shown}; rank 0 sends whole units, which it cannot cut into their shards"
            )
            fix = (
                "Use FromCheckpoint(path), where each rank reads its own part, on the model "
                "placed on a real device"
            )
        raise config_error(type(self).__name__, "model", problem, fix)

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        raise MaterializationError(
            f"`{type(self).__name__}` loads through the run its prepare(env) returns; build "
            "through a builder, which calls prepare(env) first."
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
class FromStateDict(Loader):
    """Materializes from a full state dict held by global rank 0: a mapping of names to tensors,
    or a path rank 0 reads, in any format ``fsdp_builder.sources`` knows. Other ranks pass None
    and may hold the model on meta.

    Rank 0 checks keys and shapes in ``prepare``, its verdict reaching every rank before any
    weight is written; then rank 0 broadcasts each unit in buckets of ``bucket_bytes`` (with
    FSDP2, scatters each rank's slices). Dtypes follow the model; ignored states go whole.

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

    def describe(self) -> str:
        """What ranks compare: only rank 0's source is used, so it is left out."""
        return f"FromStateDict(bucket_bytes={self.bucket_bytes}, nonfinite={self.nonfinite!r})"

    @override
    def prepare(self, env: Environment) -> MaterializerRun:
        """Open and validate the source on rank 0; every rank raises alike if it does not fit."""
        run = Rank0Run(env, STATE_DICT_SPEC, self.nonfinite, bucket_bytes=self.bucket_bytes)
        return prepare_rank0(env, run, partial(self._open, env))

    def _open(self, env: Environment) -> tuple[CheckpointSource, Match]:
        if self.source is None:
            raise config_error(
                "FromStateDict",
                "source",
                "rank 0 was given None",
                "Rank 0 holds the weights: pass it the state dict or a file path (other ranks "
                "may pass None)",
            )
        return open_matched(self.source, env, STATE_DICT_SPEC)


__all__ = [
    "STATE_DICT_SPEC",
    "Entry",
    "FromStateDict",
    "KeyMap",
    "LoadRun",
    "Loader",
    "LoaderSpec",
    "Match",
    "Rank0Run",
    "check_key_map",
    "describe_key_map",
    "key_mapper",
    "map_name",
    "match_source",
    "open_as",
    "open_matched",
    "prepare_rank0",
    "report_match",
    "unit_entries",
]
