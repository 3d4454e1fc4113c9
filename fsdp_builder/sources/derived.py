"""Derived tensors: model tensors built from several checkpoint tensors, read lazily, e.g. a
transformers mixture-of-experts model's fused ``mlp.experts.gate_up_proj`` from per-expert
``w1``/``w3`` checkpoint tensors. A read of a slice reads only the parts it needs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from attrs import Attribute, field, frozen

from fsdp_builder.errors import ConfigurationError
from fsdp_builder.sources.base import (
    CheckpointSource,
    Index,
    SourceError,
    TensorMeta,
    listed,
    reader,
)


def _check_regex(instance: object, attribute: Attribute[Any], value: Any) -> None:
    try:
        re.compile(str(value))
    except re.error as exc:
        raise ConfigurationError(
            f"`Rename` got an invalid `pattern`: {value!r} is not a regex ({exc}). Pass a "
            "pattern re.compile accepts, e.g. r'\\.block_sparse_moe\\.'"
        ) from exc


@frozen
class Rename:
    """Checkpoint names matching ``pattern`` (a regex) get ``re.sub(pattern, replacement)``."""

    pattern: str = field(validator=_check_regex)
    replacement: str

    def apply(self, name: str) -> str:
        return re.sub(self.pattern, self.replacement, name)


def _check_sources(instance: object, attribute: Attribute[Any], value: Any) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(s, str) and s.count("*") == 1 for s in value)
    ):
        raise ConfigurationError(
            f"`MergeExperts` got an invalid `sources`: {value!r}. Pass a tuple of one or more "
            "patterns, each with one '*' where the expert's number stands, e.g. "
            "('.experts.*.w1.weight', '.experts.*.w3.weight')"
        )


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _check_dim(instance: object, attribute: Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(
            f"`MergeExperts` got an invalid `dim`: {value!r}. Pass the dim of the merged "
            "tensor (1 or more; dim 0 is the experts) along which the sources are concatenated"
        )


@frozen
class MergeExperts:
    """Per-expert tensors merged into one: for each checkpoint name that matches one of
    ``sources`` (``*`` stands for the expert's number), the matched part of the name is
    replaced by ``target``; the tensors of one target are stacked by expert along a new dim 0,
    and those of several sources concatenated along ``dim`` of the result, in the order of
    ``sources``. A pattern matches anywhere in a name, up to a name boundary at its end."""

    sources: tuple[str, ...] = field(converter=_as_tuple, validator=_check_sources)
    target: str
    dim: int = field(default=1, validator=_check_dim)

    def compiled(self) -> list[re.Pattern[str]]:
        out = []
        for source in self.sources:
            before, after = (re.escape(part) for part in source.split("*"))
            boundary = r"(?!\w)" if re.search(r"\w$", source) else ""
            out.append(re.compile(f"{before}(\\d+){after}{boundary}"))
        return out


Rule: TypeAlias = Rename | MergeExperts


@frozen
class _Merged:
    """One derived tensor: ``parts[s][e]`` is the checkpoint key of source ``s``, expert ``e``."""

    parts: tuple[tuple[str, ...], ...]
    metas: tuple[TensorMeta, ...]  # each source's per-expert tensor
    dim: int  # of the merged tensor
    meta: TensorMeta


def _merged_meta(
    target: str, rule: MergeExperts, metas: Sequence[TensorMeta], count: int
) -> TensorMeta:
    first = metas[0]
    part_dim = rule.dim - 1
    if len(metas) > 1 and part_dim >= len(first.shape):
        raise SourceError(
            f"cannot build '{target}': its per-expert tensors have {len(first.shape)} dim(s), "
            f"too few to concatenate along dim {rule.dim} of the merged tensor",
            fix="Give the MergeExperts rule a dim the tensors have",
        )
    shape = list(first.shape)
    for meta, source in zip(metas[1:], rule.sources[1:], strict=True):
        other = list(meta.shape)
        if len(other) != len(shape) or any(
            a != b for d, (a, b) in enumerate(zip(other, shape, strict=True)) if d != part_dim
        ):
            raise SourceError(
                f"cannot build '{target}': '{source}' tensors are {other} but "
                f"'{rule.sources[0]}' ones {list(first.shape)}; they differ outside dim "
                f"{rule.dim} of the merged tensor"
            )
        shape[part_dim] += other[part_dim]
    return TensorMeta((count, *shape), first.dtype)


def _plan(
    tensors: Mapping[str, TensorMeta], rules: Sequence[Rule]
) -> tuple[dict[str, str], dict[str, _Merged]]:
    """Which name each kept checkpoint key goes by, and the derived tensors."""
    renames = [r for r in rules if isinstance(r, Rename)]
    merges = [(r, r.compiled()) for r in rules if isinstance(r, MergeExperts)]
    plain: dict[str, str] = {}
    # target name → (rule, source number → expert → checkpoint key)
    groups: dict[str, tuple[MergeExperts, dict[int, dict[int, str]]]] = {}
    for key in sorted(tensors):
        name = key
        for rename in renames:
            name = rename.apply(name)
        for rule, patterns in merges:
            hits = [(s, m) for s, p in enumerate(patterns) if (m := p.search(name))]
            if not hits:
                continue
            s, m = hits[0]
            target = name[: m.start()] + rule.target + name[m.end() :]
            known, by_source = groups.setdefault(target, (rule, {}))
            if known is not rule:
                raise SourceError(
                    f"two MergeExperts rules build '{target}' (targets '{known.target}' and "
                    f"'{rule.target}')",
                    fix="Make the rules' targets distinct",
                )
            by_source.setdefault(s, {})[int(m.group(1))] = key
            break
        else:
            if name in plain:
                raise SourceError(
                    f"holds both '{plain[name]}' and '{key}', which the rules for this model "
                    f"both name '{name}'"
                )
            plain[name] = key
    merged: dict[str, _Merged] = {}
    for target, (rule, by_source) in sorted(groups.items()):
        if target in plain:
            raise SourceError(
                f"holds '{plain[target]}' and also per-expert tensors that merge into "
                f"'{target}' (e.g. '{next(iter(next(iter(by_source.values())).values()))}')",
                fix="Save the checkpoint with one layout of the experts, fused or per expert",
            )
        absent = [rule.sources[s] for s in range(len(rule.sources)) if s not in by_source]
        if absent:
            raise SourceError(
                f"holds '{rule.sources[next(iter(by_source))]}' tensors for '{target}' but no "
                f"{listed([repr(a) for a in absent])} ones to merge with them"
            )
        count = max(max(experts) for experts in by_source.values()) + 1
        for s, experts in sorted(by_source.items()):
            lacking = sorted(set(range(count)) - set(experts))
            if lacking:
                raise SourceError(
                    f"holds experts up to {count - 1} of '{target}' but lacks the "
                    f"'{rule.sources[s]}' tensors of expert(s) {listed([str(e) for e in lacking])}"
                )
        parts = tuple(tuple(by_source[s][e] for e in range(count)) for s in sorted(by_source))
        metas = []
        for keys in parts:
            first = tensors[keys[0]]
            odd = [k for k in keys if tensors[k] != first]
            if odd:
                raise SourceError(
                    f"cannot build '{target}': '{keys[0]}' is {list(first.shape)} "
                    f"{first.dtype} but '{odd[0]}' is {list(tensors[odd[0]].shape)} "
                    f"{tensors[odd[0]].dtype}; every expert's tensor must be alike"
                )
            metas.append(first)
        dtypes = {m.dtype for m in metas}
        if len(dtypes) > 1:
            raise SourceError(
                f"cannot build '{target}': its sources have different dtypes "
                f"({', '.join(sorted(str(d) for d in dtypes))})"
            )
        merged[target] = _Merged(
            parts, tuple(metas), rule.dim, _merged_meta(target, rule, metas, count)
        )
    return plain, merged


class DerivedSource:
    """A source seen through rules: renamed keys read from the source as they are, merged ones
    built from the parts a read asks for. Closing it closes the source."""

    def __init__(
        self, source: CheckpointSource, plain: dict[str, str], merged: dict[str, _Merged]
    ) -> None:
        self.describe = source.describe
        self.source = source
        self._plain = plain
        self._merged = merged
        inner = source.tensors()
        listing = {name: inner[key] for name, key in plain.items()}
        listing.update({name: m.meta for name, m in merged.items()})
        self._tensors = dict(sorted(listing.items()))

    def tensors(self) -> Mapping[str, TensorMeta]:
        return self._tensors

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        merged = self._merged.get(key)
        if merged is None:
            return self.source.read(self._plain[key], index)
        full = merged.meta.shape
        wanted = [_bounds(s, n) for s, n in zip(index or (), full, strict=False)]
        wanted += [(0, n) for n in full[len(wanted) :]]
        experts = range(*wanted[0])
        if not experts or any(start >= stop for start, stop in wanted[1:]):
            return torch.empty([stop - start for start, stop in wanted], dtype=merged.meta.dtype)
        within = [slice(start, stop) for start, stop in wanted[1:]]
        if len(merged.parts) == 1:
            keys = merged.parts[0]
            return torch.stack([self.source.read(keys[e], tuple(within)) for e in experts])
        # Several sources: each covers a range of the concatenated dim; read the overlap only.
        part_dim = merged.dim - 1
        lo, hi = wanted[merged.dim]
        reads: list[tuple[tuple[str, ...], tuple[slice, ...]]] = []
        offset = 0
        for keys, meta in zip(merged.parts, merged.metas, strict=True):
            length = meta.shape[part_dim]
            start, stop = max(lo - offset, 0), min(hi - offset, length)
            offset += length
            if start < stop:
                part_index = list(within)
                part_index[part_dim] = slice(start, stop)
                reads.append((keys, tuple(part_index)))
        return torch.stack(
            [
                torch.cat([self.source.read(keys[e], idx) for keys, idx in reads], dim=part_dim)
                for e in experts
            ]
        )

    def read_into(self, key: str, index: Index | None, out: torch.Tensor) -> None:
        """A renamed key is read into ``out`` by the source itself where it can."""
        if key in self._merged:
            out.copy_(self.read(key, index))
        else:
            reader(self.source)(self._plain[key], index, out)

    def close(self) -> None:
        self.source.close()


def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError(f"a derived tensor is read by contiguous slices, got step {step}")
    return start, max(start, stop)


def derive(source: CheckpointSource, rules: Sequence[Rule]) -> CheckpointSource:
    """``source`` seen through ``rules`` (itself when no rule changes a name); a SourceError
    names keys the rules make one, a merge's missing parts or parts that differ."""
    if not rules:
        return source
    plain, merged = _plan(source.tensors(), rules)
    if not merged and all(name == key for name, key in plain.items()):
        return source
    return DerivedSource(source, plain, merged)


__all__ = ["DerivedSource", "MergeExperts", "Rename", "Rule", "derive"]
