"""Every dtype safetensors stores loads, bit-equal to ``safetensors.torch.load_file``.

FP8 (``F8_E4M3``, ``F8_E5M2``), unsigned (``U16``/``U32``/``U64``), bf16, bool and int8 states
saved with ``safetensors.torch.save_file`` are loaded by ``FromCheckpoint`` on both backends at
1 and 2 ranks (one spawn per world size), each rank reading only its rows (FSDP2) or its units'
whole tensors (FSDP1), with no weight bytes between ranks. The values are compared on each rank
with its rows of ``load_file``'s tensors (gloo gathers none of FP8 or the unsigned dtypes).
FSDP1's FlatParameter holds floating dtypes only, so there the other dtypes load as buffers and
as parameters are refused with the library's error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from isolated import Results, Spawns, run_each, values
from models import counting_collectives
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    MaterializationError,
)

FLOATS = {
    "f8_e4m3": torch.float8_e4m3fn,
    "f8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
}
OTHERS = {
    "u16": torch.uint16,
    "u32": torch.uint32,
    "u64": torch.uint64,
    "bool": torch.bool,
    "i8": torch.int8,
}
DTYPES = {**FLOATS, **OTHERS}
# 41 rows: uneven shards at 2 ranks (21/20); a rank's rows outweigh the agreements' bytes.
SHAPE = (41, 24)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (torch.equal takes neither FP8 nor the unsigned dtypes everywhere)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def stored(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Finite floats; random bytes for the integers (their high bits set too)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(SHAPE, generator=gen) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, SHAPE, generator=gen).bool()
    raw = torch.randint(0, 256, (SHAPE[0], SHAPE[1] * dtype.itemsize), generator=gen)
    return raw.to(torch.uint8).view(dtype)


class Holder(nn.Module):
    """One dtype's unit: its tensor as a frozen parameter, or as a buffer."""

    def __init__(self, dtype: torch.dtype, buffer: bool = False) -> None:
        super().__init__()
        if buffer:
            self.register_buffer("weight", torch.empty(SHAPE, dtype=dtype))
        else:
            self.weight = nn.Parameter(torch.empty(SHAPE, dtype=dtype), requires_grad=False)


class Model(nn.Module):
    def __init__(self, params: dict[str, torch.dtype], buffers: dict[str, torch.dtype]) -> None:
        super().__init__()
        holders = {n: Holder(d) for n, d in params.items()}
        holders.update({n: Holder(d, buffer=True) for n, d in buffers.items()})
        self.parts = nn.ModuleDict(holders)


# -- inside the ranks ------------------------------------------------------------------------



def counted_build(build: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, set[int]], int]:
    """``build()`` with the checkpoint's reads recorded (the rows read of each key) and every
    collective's tensors measured: the model, the rows read per key, the largest tensor sent."""

    from fsdp_builder.sources.hf_safetensors import SafetensorsSource

    rows: dict[str, set[int]] = {}
    sent: list[int] = []

    def note(source: Any, key: str, index: Any) -> None:
        count = source.tensors()[key].shape[0]
        taken = range(count) if not index else range(*index[0].indices(count))
        rows.setdefault(key, set())
        assert not rows[key] & set(taken), f"rows of '{key}' read twice"
        rows[key] |= set(taken)

    read, read_into = SafetensorsSource.read, SafetensorsSource.read_into

    def reading(self: Any, key: str, index: Any = None) -> torch.Tensor:
        note(self, key, index)
        return read(self, key, index)

    def reading_into(self: Any, key: str, index: Any, out: torch.Tensor) -> None:
        note(self, key, index)
        read_into(self, key, index, out)

    SafetensorsSource.read = reading  # type: ignore[method-assign]
    SafetensorsSource.read_into = reading_into  # type: ignore[method-assign]
    try:
        with counting_collectives(sent):
            model = build()
    finally:
        SafetensorsSource.read = read  # type: ignore[method-assign]
        SafetensorsSource.read_into = read_into  # type: ignore[method-assign]
    return model, rows, max(sent, default=0)


def load_case(backend: str, path: str) -> dict[str, Any]:
    """Build from ``path``; per state, this rank's bytes and the rows it read, and its first
    row and count of rows (FSDP2: its shard's; FSDP1: the flat shard's elements)."""
    params = FLOATS if backend == "fsdp1" else DTYPES
    buffers = OTHERS if backend == "fsdp1" else {}
    with torch.device("meta"):
        model = Model(params, buffers)
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    builder = kind().device(CPUDevice()).wrap(Holder).materialize(FromCheckpoint(path))
    built, rows, largest = counted_build(lambda: builder.build(model))
    held: dict[str, Any] = {}
    for name, module in built.named_modules():
        if not isinstance(module, Holder):
            continue
        key = ".".join(p for p in name.split(".") if p != "_fsdp_wrapped_module") + ".weight"
        buffer = dict(module.named_buffers(recurse=False)).get("weight")
        if buffer is not None:
            held[key] = ("whole", as_bytes(buffer), buffer.dtype)
        elif backend == "fsdp2":
            weight = module.weight
            assert isinstance(weight, DTensor)
            local = weight.to_local()
            held[key] = ("rows", as_bytes(local), local.dtype)
        else:  # FSDP1: the unit's FlatParameter, this rank's shard of it
            (flat,) = (p for n, p in built.named_parameters() if n.startswith(name + "."))
            held[key] = ("flat", as_bytes(flat), flat.dtype, flat.numel())
    return {"held": held, "rows": rows, "largest": largest}


def refused_case(path: str) -> tuple[str, str, bool]:
    """FSDP1 given the non-floating dtypes as parameters."""
    with torch.device("meta"):
        model = Model(OTHERS, {})
    try:
        FSDPBuilder().device(CPUDevice()).wrap(Holder).materialize(FromCheckpoint(path)).build(
            model
        )
    except Exception as exc:
        return type(exc).__name__, str(exc), all(p.is_meta for p in model.parameters())
    raise AssertionError("FSDP1 built non-floating parameters")


def nonfinite_case(backend: str, path: str, holder: str) -> tuple[str, str]:
    """FP8 values holding NaN (E4M3) or inf (E5M2) with nonfinite='error'."""
    with torch.device("meta"):
        model = Model({holder: FLOATS[holder]}, {})
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    loader = FromCheckpoint(path, nonfinite="error", strict=False)
    try:
        kind().device(CPUDevice()).wrap(Holder).materialize(loader).build(model)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("non-finite FP8 values were loaded without an error")


def cases(paths: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for backend in ("fsdp1", "fsdp2"):
        yield ("load", backend), partial(load_case, backend, paths["all"])
        for holder in ("f8_e4m3", "f8_e5m2"):
            yield (
                ("nonfinite", backend, holder),
                partial(nonfinite_case, backend, paths["nonfinite"], holder),
            )
    yield "refused", partial(refused_case, paths["all"])


def scenarios(paths: dict[str, str]) -> Results:
    return run_each(cases(paths))


# -- the test process -------------------------------------------------------------------------

SPAWNS = Spawns(scenarios, timeout=240)
WORLDS = [1, 2]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("dtypes")
    state = {f"parts.{n}.weight": stored(d, seed) for seed, (n, d) in enumerate(DTYPES.items())}
    save_file(state, str(root / "all.safetensors"))
    bad = {k: v for k, v in state.items() if k.startswith("parts.f8_")}
    bad["parts.f8_e4m3.weight"][-1, 3] = float("nan")
    bad["parts.f8_e5m2.weight"][0, 5] = float("inf")
    save_file(bad, str(root / "nonfinite.safetensors"))
    return {"all": str(root / "all.safetensors"), "nonfinite": str(root / "nonfinite.safetensors")}


def scenario(world: int, paths: dict[str, str], key: Hashable) -> list[Any]:
    return values(SPAWNS(world, paths), key)


def own_rows(count: int, world: int, rank: int) -> range:
    """The rows ``fully_shard`` gives ``rank``: torch.chunk's split of dim 0."""
    chunks = torch.arange(count).chunk(world)
    if rank >= len(chunks):
        return range(0)
    return range(int(chunks[rank][0]), int(chunks[rank][-1]) + 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_fully_shard_loads_every_dtype_rank_local_and_bit_equal(
    paths: dict[str, str], world: int
) -> None:
    from safetensors.torch import load_file

    want = load_file(paths["all"])
    ranks = scenario(world, paths, ("load", "fsdp2"))
    assert sorted(ranks[0]["held"]) == sorted(want)
    for rank, got in enumerate(ranks):
        assert 0 < got["largest"] <= 64, got["largest"]  # the agreements only
        for key, full in want.items():
            kind, data, dtype = got["held"][key]
            mine = own_rows(full.shape[0], world, rank)
            assert (kind, dtype) == ("rows", full.dtype), key
            assert torch.equal(data, as_bytes(full[mine.start : mine.stop])), (rank, key)
            assert got["rows"][key] == set(mine), (rank, key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp1_loads_every_dtype_bit_equal(paths: dict[str, str], world: int) -> None:
    """FP8 and bf16 parameters in FlatParameters; the other dtypes as buffers, whole on every
    rank; every rank reads its units' whole tensors."""
    from safetensors.torch import load_file

    want = load_file(paths["all"])
    ranks = scenario(world, paths, ("load", "fsdp1"))
    assert sorted(ranks[0]["held"]) == sorted(want)
    for rank, got in enumerate(ranks):
        assert 0 < got["largest"] <= 64, got["largest"]
        for key, full in want.items():
            held = got["held"][key]
            assert held[2] == full.dtype, key
            assert got["rows"][key] == set(range(full.shape[0])), (rank, key)
            if held[0] == "whole":
                assert key.split(".")[1] in OTHERS
                assert torch.equal(held[1], as_bytes(full)), (rank, key)
                continue
            # The flat shard: the unit's one tensor flattened, padded to world * per-rank.
            per_rank = math.ceil(full.numel() / world)
            assert held[3] == per_rank, key
            first = rank * per_rank
            valid = max(0, min(full.numel() - first, per_rank)) * full.element_size()
            expected = as_bytes(full.reshape(-1)[first : first + per_rank])
            assert torch.equal(held[1][:valid], expected), (rank, key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp1_refuses_non_floating_parameters_by_name(paths: dict[str, str], world: int) -> None:
    for name, message, untouched in scenario(world, paths, "refused"):
        assert name == ConfigurationError.__name__, message
        assert "cannot shard non-floating parameters" in message
        for dtype_name in OTHERS:
            assert f"'parts.{dtype_name}.weight'" in message
        assert "register_buffer" in message and untouched


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("holder", ["f8_e4m3", "f8_e5m2"])
def test_nan_and_inf_in_fp8_values_are_found(
    paths: dict[str, str], world: int, backend: str, holder: str
) -> None:
    """A NaN in E4M3 values (in the last row: rank 1's at 2 ranks), an inf in E5M2 values (in
    the first row: rank 0's); every rank raises."""
    for name, message in scenario(world, paths, ("nonfinite", backend, holder)):
        assert name == MaterializationError.__name__, message
        assert f"NaN or inf values in {paths['nonfinite']!r}" in message
        assert f"'parts.{holder}.weight'" in message


# -- the source on its own ---------------------------------------------------------------------


def every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of each dtype this torch and safetensors store, a scalar and empty ones."""
    names = [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "uint16",
        "uint32",
        "uint64",
        "complex64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ]
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(7)
    for name in names:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        raw = torch.randint(0, 256, (9, 6 * dtype.itemsize), generator=gen).to(torch.uint8)
        if dtype == torch.bool:
            tensors[name] = raw[:, :6] % 2 == 1
        else:
            tensors[name] = raw.view(dtype)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.empty(0, 3, dtype=torch.float8_e4m3fn)
    return tensors


def test_the_source_reads_every_dtype_bit_equal_to_load_file(tmp_path: Path) -> None:
    """Whole, by rows (empty and strided too) and into a destination, for every dtype."""
    from safetensors.torch import load_file, save_file

    from fsdp_builder.sources import TensorMeta
    from fsdp_builder.sources.hf_safetensors import open_file

    file = tmp_path / "every.safetensors"
    save_file(every_dtype(), str(file))
    want = load_file(str(file))
    source = open_file(file)
    try:
        assert source.tensors() == {k: TensorMeta(tuple(t.shape), t.dtype) for k, t in want.items()}
        for key, full in want.items():
            indexes: list[Any] = [None]
            if full.dim():
                indexes += [(slice(2, 7),), (slice(4, 4),), (slice(1, None, 3),)]
            for index in indexes:
                expected = full[index] if index else full
                got = source.read(key, index)
                assert got.dtype == expected.dtype and got.shape == expected.shape, (key, index)
                assert torch.equal(as_bytes(got), as_bytes(expected)), (key, index)
                into = torch.empty(expected.shape, dtype=expected.dtype)
                source.read_into(key, index, into)
                assert torch.equal(as_bytes(into), as_bytes(expected)), (key, index)
    finally:
        source.close()


def test_a_read_into_a_destination_of_another_shape_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from fsdp_builder.sources.hf_safetensors import open_file

    file = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(4, 3, dtype=torch.float8_e5m2)}, str(file))
    source = open_file(file)
    try:
        with pytest.raises(ValueError, match=r"'w'\[1:3\] is \[2, 3\], the destination \[3, 3\]"):
            source.read_into("w", (slice(1, 3),), torch.empty(3, 3))
    finally:
        source.close()


def _rss_file() -> int:
    """This process's resident file-backed bytes (mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_the_mapped_pages_of_a_load_stay_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source reading 32 MiB of rows holds a few MiB of the file mapped at any time, not
    32 MiB: safe_open maps the file, and the source unmaps it every 1 MiB here."""
    from safetensors.torch import save_file

    import fsdp_builder.sources.hf_safetensors as hf

    file = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.full((512, 1024), float(i)) for i in range(16)}, str(file))
    monkeypatch.setattr(hf, "_MAPPED_BYTES", 1 << 20)
    outs = {f"w{i}": torch.zeros(512, 1024) for i in range(16)}
    for _ in range(2):  # the first pass pages in the code a read runs
        source = hf.open_file(file)
        before, most = _rss_file(), 0
        try:
            for key, out in outs.items():
                for first in range(0, 512, 64):  # 256 KiB runs, as a loader reads
                    source.read_into(key, (slice(first, first + 64),), out[first : first + 64])
                    most = max(most, _rss_file() - before)
        finally:
            source.close()
    assert all(torch.equal(out, torch.full_like(out, i)) for i, out in enumerate(outs.values()))
    assert most < 8 << 20, f"{most / 2**20:.1f} MiB of the file mapped at once"
