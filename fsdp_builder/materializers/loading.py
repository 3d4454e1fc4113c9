"""What every loader shares: opening a checkpoint source and matching it against the model (one
prepare path), and the rank-0 load, where rank 0 alone reads and the weights travel. Here too is
``FromStateDict``, the loader of a state dict (or file) that rank 0 holds.

A load opens its source through ``fsdp_builder.sources`` (any registered format, or a state
dict in memory), maps the source's names to the model's and checks names, shapes and dtypes
against the unit plan before any weight is written. Where only rank 0 reads, its verdict reaches
every rank, so a bad source raises the same error everywhere instead of failing half-way through
a broadcast. Per unit, rank 0 copies the unit's tensors out of the source and broadcasts them
(or, with a backend that shards first, scatters each rank's slices); the other ranks only ever
hold storage for the unit being built, never the full state dict.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from attrs import define, frozen
from typing_extensions import override

from fsdp_builder.common.logs import get_logger
from fsdp_builder.errors import ConfigurationError, MaterializationError, config_error
from fsdp_builder.materializers.buffers import Computed, fill_buffers
from fsdp_builder.materializers.ignored import give_storage_in_place, meta_ignored, move_in_place
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
from fsdp_builder.sources import CheckpointSource, MissingPath, SourceError, TensorMeta, open_source
from fsdp_builder.sources.base import listed, read_into
from fsdp_builder.sources.derived import derive
from fsdp_builder.sources.model_rules import checkpoint_rules

log = get_logger(__name__)

Mapper = Callable[[str], "str | None"]

_FIX_SOURCE = (
    "Pass the model's full state dict (`model.state_dict()` of the unwrapped model) on rank 0, "
    "or the path of a file saved from it with torch.save or safetensors.torch.save_file"
)


def _identity(name: str) -> str:
    return name


@frozen
class LoaderSpec:
    """How a loader words its errors: its name, the argument that holds the source, the word
    for the source in shape messages, its general fix, and whether integer/float mismatches
    are refused (else every dtype converts to the model's)."""

    name: str
    argument: str
    word: str
    fix: str
    check_kinds: bool
    missing_fix: str
    # The fix when the source does not fit the model (its names, shapes or dtypes).
    mismatch_fix: str

    def error(self, problem: str, fix: str | None = None) -> ConfigurationError:
        return config_error(self.name, self.argument, problem, fix or self.fix)

    def missing(self, error: MissingPath) -> ConfigurationError:
        return config_error(self.name, self.argument, error.problem, self.missing_fix)


STATE_DICT_SPEC = LoaderSpec(
    name="FromStateDict",
    argument="source",
    word="source",
    fix=_FIX_SOURCE,
    check_kinds=False,
    missing_fix="Pass the path of a torch.save or .safetensors file that rank 0 can read",
    mismatch_fix=f"{_FIX_SOURCE}, with the same architecture and config",
)


# -- a unit's states, by every name they go by -----------------------------------------------


@frozen
class Entry:
    """One storage of a unit with every name it goes by (tied parameters have several)."""

    names: tuple[str, ...]
    tensor: torch.Tensor = attrs.field(eq=False)


def unit_entries(
    unit: Unit, ignored: IgnoredStates, plan: UnitPlan | None = None
) -> Iterator[Entry]:
    """The persistent states ``unit`` owns, and the ignored ones below its own modules (ignored
    parameters, ignored modules' states): a load writes those whole, on every rank, as
    ``from_pretrained`` would, never leaves them out. ``plan``: stop at the other units' modules
    (before the build wrapped them)."""
    others = {u.module for u in plan} - {unit.module} if plan is not None else set()
    # No unit lies inside an ignored module: walking into them reaches only ignored states.
    modules = unit_modules(unit.module, others)
    rel = module_names(unit.module)
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for m in modules:
        prefix = qualified(unit.fqn, rel.get(id(m), ""))
        skip: set[str] = getattr(m, "_non_persistent_buffers_set", set())
        named: list[tuple[str, torch.Tensor]] = [
            (n, p)
            for n, p in m.named_parameters(recurse=False, remove_duplicate=False)
            if p is not None
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
        yield Entry(tuple(dict.fromkeys(names)), t)


# -- matching a source against the model ------------------------------------------------------


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


def map_keys(keys: list[str], mapper: Mapper, spec: LoaderSpec) -> dict[str, str | None]:
    """Each checkpoint key → its model name under ``mapper``; a mapper that raises or returns
    something other than a string or None is a problem of ``key_map``, named as such."""
    mapped: dict[str, str | None] = {}
    for key in keys:
        try:
            name = mapper(key)
        except Exception as exc:
            raise config_error(
                spec.name,
                "key_map",
                f"raised {type(exc).__name__}: {exc} for the checkpoint key '{key}'",
                "Make it return the model's name for every checkpoint key (or None to leave "
                "the entry out)",
            ) from exc
        if name is not None and not isinstance(name, str):
            raise config_error(
                spec.name,
                "key_map",
                f"returned {name!r} ({type(name).__name__}) for the checkpoint key '{key}'",
                "Make it return the model's name as a string, or None to leave the entry out",
            )
        mapped[key] = None if name is None else clean_name(name)
    return mapped


def match_source(
    tensors: Mapping[str, TensorMeta],
    mapper: Mapper,
    plan: UnitPlan,
    ignored: IgnoredStates,
    *,
    spec: LoaderSpec,
    describe: str,
    strict: bool = True,
    every_state: bool = True,
    entries: Mapping[Unit, list[Entry]] | None = None,
) -> Match:
    """Map the source's names and compare them with the plan; raises a ConfigurationError in
    ``spec``'s words naming every problem, capped per kind. ``every_state``: missing keys are
    errors even when not ``strict``. ``entries``: each unit's ``unit_entries`` (found here
    when not given)."""
    found = Match(mapped=map_keys(sorted(tensors), mapper, spec))
    by_name: dict[str, str] = {}
    collisions: list[str] = []
    for key, name in found.mapped.items():
        if name is None:
            continue
        if name in by_name:
            collisions.append(f"'{by_name[name]}' and '{key}' both map to '{name}'")
        by_name[name] = key
    shapes: list[str] = []
    dtypes: list[str] = []
    unfillable: list[str] = []
    matched = 0
    for unit in plan:
        for entry in entries[unit] if entries is not None else unit_entries(unit, ignored, plan):
            present = [n for n in entry.names if n in by_name]
            if not present:
                found.missing.append(" / ".join(entry.names))
                if entry.tensor.is_meta:
                    unfillable.append(entry.names[0])
                continue
            matched += 1
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
    known = {clean_name(k) for k in plan.root.module.state_dict(keep_vars=True)}
    found.unexpected = sorted(by_name[n] for n in set(by_name) - known)
    problems: list[str] = []
    if collisions:
        problems.append(f"{len(collisions)} name collision(s) after key_map: {listed(collisions)}")
    if found.missing and (strict or every_state or unfillable):
        shown = found.missing if strict or every_state else unfillable
        problems.append(f"{len(shown)} missing key(s): {listed(shown)}")
    if found.unexpected and strict:
        problems.append(f"{len(found.unexpected)} unexpected key(s): {listed(found.unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} wrong shape(s): {listed(shapes, sep='; ')}")
    if dtypes:
        problems.append(f"{len(dtypes)} integer/float mismatch(es): {listed(dtypes, sep='; ')}")
    if not problems:
        return found
    raise config_error(
        spec.name,
        spec.argument,
        f"{describe} does not match the model: {'; '.join(problems)}"
        f"{_hint(found, matched, shapes, tensors, plan, ignored, strict, unfillable, every_state)}",
        spec.mismatch_fix,
    )


def _hint(
    found: Match,
    matched: int,
    shapes: list[str],
    tensors: Mapping[str, TensorMeta],
    plan: UnitPlan,
    ignored: IgnoredStates,
    strict: bool,
    unfillable: list[str],
    every_state: bool,
) -> str:
    if found.unexpected and any(k.startswith(("module.", "_orig_mod.")) for k in found.unexpected):
        return " (keys start with a wrapper prefix: strip 'module.' / '_orig_mod.')"
    total = matched + len(found.missing)
    if matched * 2 < total:
        names = [n for u in plan for e in unit_entries(u, ignored, plan) for n in e.names]
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
    if not strict and unfillable and not every_state:
        return " (strict=False leaves out only states that are already real, not on meta)"
    return ""


def _derived(
    opened: CheckpointSource,
    env: Environment,
    spec: LoaderSpec,
    entries: Mapping[Unit, list[Entry]],
) -> CheckpointSource:
    """``opened`` seen through the rules of the model's checkpoint layout (e.g. per-expert
    tensors merged into a mixture-of-experts model's fused ones); see
    ``fsdp_builder.sources.derived``."""
    held = opened.tensors()
    complete = all(
        any(n in held for n in entry.names) for found in entries.values() for entry in found
    )
    try:
        return derive(opened, checkpoint_rules(env.plan.root.module, complete=complete))
    except SourceError as exc:
        raise spec.error(f"{opened.describe} {exc.problem}", exc.fix) from exc


def open_matched(
    source: Mapping[str, Any] | str | os.PathLike[str],
    env: Environment,
    spec: LoaderSpec,
    mapper: Mapper = _identity,
    *,
    strict: bool = True,
    every_state: bool = True,
) -> tuple[CheckpointSource, Match]:
    """The prepare step of every load, on one rank: open ``source`` and match it against the
    plan. The model's checkpoint rules apply between the two (``sources.model_rules``: a
    transformers mixture-of-experts model reads its per-expert checkpoint tensors as its fused
    ones). Raises a ConfigurationError in ``spec``'s words; nothing stays open if it does."""
    try:
        opened = open_source(source)
    except MissingPath as exc:
        raise spec.missing(exc) from exc
    except SourceError as exc:
        raise spec.error(exc.problem, exc.fix) from exc
    except ConfigurationError:
        raise
    except Exception as exc:  # a reader's own error: the loader's words, the cause kept
        what = f"'{os.fspath(source)}'" if not isinstance(source, Mapping) else "the state dict"
        raise spec.error(f"{what} could not be read ({type(exc).__name__}: {exc})") from exc
    try:
        # Each unit's states by name, walked once for both the layout rules and the match.
        entries = {unit: list(unit_entries(unit, env.ignored, env.plan)) for unit in env.plan}
        opened = _derived(opened, env, spec, entries)
        found = match_source(
            opened.tensors(),
            mapper,
            env.plan,
            env.ignored,
            spec=spec,
            describe=opened.describe,
            strict=strict,
            every_state=every_state,
            entries=entries,
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


# -- the rank-0 load ---------------------------------------------------------------------------


def prepare_rank0(
    env: Environment,
    run: Rank0Run,
    open_on_rank0: Callable[[], tuple[CheckpointSource, Match]],
) -> Rank0Run:
    """Rank 0 opens and matches its source (``open_on_rank0``); its verdict (None: it fits)
    reaches every rank, which raises it alike; then the run gets the non-persistent buffers the
    model computes (no source holds them; the same on every rank, so a failure there is every
    rank's, and it is reported as what it is, not as a bad source). Collective. The run is
    closed if the load does not start."""
    verdict: str | None = None
    if dist.get_rank() == 0:
        try:
            run.source, found = open_on_rank0()
            run.keys = found.keys
            report_match(env, found)
        except ConfigurationError as exc:
            verdict = str(exc)
        except Exception as exc:  # whatever a reader raises, the other ranks must hear it
            verdict = str(
                run.spec.error(f"the source could not be read ({type(exc).__name__}: {exc})")
            )
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
class Rank0Run:
    """One build's rank-0 load: the open source (rank 0 only) and the source key of each model
    name, streamed unit by unit."""

    env: Environment
    spec: LoaderSpec
    bucket_bytes: int
    nonfinite: str = "warn"
    source: CheckpointSource | None = None
    keys: dict[str, str] = attrs.field(factory=dict)
    computed: Computed = attrs.field(factory=dict)

    def close(self) -> None:
        self.computed = {}
        if self.source is not None:
            self.source.close()
            self.source = None

    def materialize(self, unit: Unit) -> int:
        env = self.env
        if env.shards_first:
            return self._scatter(unit)
        source = self.source
        modules = unit_modules(unit.module, env.ignored.modules)
        device = collective_device(env.agreement_group)
        fresh = meta_ignored(modules, env.ignored)
        give_storage_in_place(fresh, device)
        allocate_empty(modules, device)
        entries = list(unit_entries(unit, env.ignored))
        error: BaseException | None = None
        if source is not None:
            try:
                with torch.no_grad():
                    for entry in entries:
                        name = next(n for n in entry.names if n in self.keys)
                        read_into(source, self.keys[name], None, entry.tensor.detach())
            except Exception as exc:  # the other ranks are about to wait for this unit
                error = MaterializationError(
                    f"`{self.spec.name}` could not copy unit '{unit.label}' out of "
                    f"{source.describe}: {type(exc).__name__}: {exc}. {self.spec.fix}."
                )
        agree("materialize (load)", error, unit=unit.label, group=env.agreement_group)
        written = 0
        # Ignored states stay where they are (another device than the group's, perhaps):
        # they travel through a copy on the group's device.
        tensors = [e.tensor.detach().to(device) for e in entries]
        for group, src in sync_stages(env):
            written += broadcast_tensors(tensors, src, group, self.bucket_bytes)
        with torch.no_grad():
            for entry, sent in zip(entries, tensors, strict=True):
                if sent.data_ptr() != entry.tensor.data_ptr():
                    entry.tensor.detach().copy_(sent)
        move_in_place(fresh, env.device)
        # Every rank now holds the same values: each decides alone, and all alike.
        verdict = nonfinite_verdict(
            self.nonfinite,
            nonfinite_names((e.names[0], e.tensor.detach()) for e in entries),
            loader=self.spec.name,
            unit=unit.label,
            source="rank 0's source" if source is None else source.describe,
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
        validated in prepare; should reading still fail, rank 0 sends zeros in place of what
        it could not read and raises only after the unit's last collective, so no rank is left
        waiting (the builder then raises on every rank)."""
        source = self.source
        state: dict[str, torch.Tensor] | None = None
        error: MaterializationError | None = None
        if source is not None:
            state = {}
            try:
                for entry in unit_entries(unit, self.env.ignored):
                    present = [n for n in entry.names if n in self.keys]
                    if present:
                        tensor = source.read(self.keys[present[0]])
                        state.update(dict.fromkeys(present, tensor))
            except Exception as exc:
                error = MaterializationError(
                    f"`{self.spec.name}` could not read unit '{unit.label}' out of "
                    f"{source.describe}: {type(exc).__name__}: {exc}. {self.spec.fix}."
                )
        scatter_error: MaterializationError | None = None
        modules = unit_modules(unit.module, self.env.ignored.modules)
        # In place, so that the ignored parameter stays the one fully_shard ignores.
        give_storage_in_place(meta_ignored(modules, self.env.ignored), self.env.device)
        try:
            received = scatter_unit_state(unit, self.env, state)
        except MaterializationError as exc:
            scatter_error = exc
            received = 0  # a read error says more than the entries it left out
        received += self._broadcast_ignored(unit, state)
        # Ranks hold different slices: with nonfinite="error" every rank takes part in the
        # verdict (also one whose read failed), so that all raise alike.
        names = []
        if error is None and scatter_error is None:
            names = nonfinite_names(
                (e.names[0], e.tensor) for e in unit_entries(unit, self.env.ignored)
            )
        verdict = nonfinite_verdict(
            self.nonfinite,
            names,
            loader=self.spec.name,
            unit=unit.label,
            source="rank 0's source" if source is None else source.describe,
            alike=False,
            group=self.env.agreement_group,
        )
        if error is not None:
            raise error
        if scatter_error is not None:
            raise scatter_error
        if verdict is not None:
            raise verdict
        fill_buffers(modules, self.computed, self.env.device)
        return received

    def _broadcast_ignored(self, unit: Unit, state: dict[str, torch.Tensor] | None) -> int:
        """The unit's ignored states are whole on every rank: rank 0's values (``state``, None
        elsewhere), broadcast through a copy on the group's device. Every rank joins, also
        when rank 0's read failed. Returns the bytes received."""
        env = self.env
        wanted = {id(p) for p in env.ignored.params} | {id(b) for b in env.ignored.buffers}
        entries = [e for e in unit_entries(unit, env.ignored) if id(e.tensor) in wanted]
        if not entries:
            return 0
        device = collective_device(env.agreement_group)
        received = 0
        with torch.no_grad():
            for entry in entries:
                value = (
                    None
                    if state is None
                    else next((state[n] for n in entry.names if n in state), None)
                )
                if value is not None:
                    entry.tensor.detach().copy_(value)
            staged = [e.tensor.detach().to(device) for e in entries]
            for group, src in sync_stages(env):
                received += broadcast_tensors(staged, src, group, self.bucket_bytes)
            for entry, sent in zip(entries, staged, strict=True):
                if sent.data_ptr() != entry.tensor.data_ptr():
                    entry.tensor.detach().copy_(sent)
        return received


# -- FromStateDict ------------------------------------------------------------------------------


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
    or a path that rank 0 reads, in any format ``fsdp_builder.sources`` knows (a ``torch.save``
    or ``.safetensors`` file, a Hugging Face folder, a DCP folder, or one you registered). Other
    ranks pass None (or anything; only rank 0's source is used) and may hold the model on meta.

    Keys and shapes are checked in ``prepare`` against every unit, on rank 0, and the verdict
    reaches every rank before any weight is written. Each unit is then copied out of the source on
    rank 0 and broadcast in buckets of ``bucket_bytes`` to every rank (every replica too under
    hybrid sharding); with a backend that shards first (FSDP2) rank 0 scatters only each rank's
    slices instead. Dtypes follow the model. Ignored states (``ignore(...)``) are broadcast
    whole into the tensors the user passed. The source is closed when the build ends, however
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
        run = Rank0Run(env, STATE_DICT_SPEC, self.bucket_bytes, self.nonfinite)
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

    @override
    def materialize(self, unit: Unit, env: Environment) -> int:
        raise MaterializationError(
            "`FromStateDict` loads through the run its prepare(env) returns; build through a "
            "builder, which calls prepare(env) first."
        )


__all__ = [
    "STATE_DICT_SPEC",
    "Entry",
    "FromStateDict",
    "LoaderSpec",
    "Match",
    "Rank0Run",
    "map_keys",
    "match_source",
    "open_matched",
    "prepare_rank0",
    "report_match",
    "unit_entries",
]
