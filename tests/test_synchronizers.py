"""Synchronizers and FromStateDict: configuration (no group) and one-rank gloo builds in-process."""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from models import (
    assert_drawn_like_eager,
    demo_units,
    eager_draws,
    eager_init_by_unit,
    meta_demo,
)
from safetensors.torch import save_file
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from fsdp_builder import (
    BroadcastFromRank0,
    ConfigurationError,
    CPUDevice,
    DeterministicInit,
    FromStateDict,
    FSDPBuilder,
    KeepAsIs,
    ResetParameters,
    VerifyReplicas,
)
from fsdp_builder.synchronizers import _flatten, checksum
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer

CFG = DemoConfig(vocab=64, dim=32, heads=2, layers=2, seq=8)


def source() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {k: v.detach().clone() for k, v in DemoTransformer(CFG).state_dict().items()}


def load(src: object) -> nn.Module:
    return (
        FSDPBuilder()
        .device(CPUDevice())
        .wrap(Block)
        .materialize(FromStateDict(src))
        .build(meta_demo(CFG))
    )


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bucket_bytes_must_be_positive(size: object) -> None:
    with pytest.raises(
        ConfigurationError, match=r"`BroadcastFromRank0` got an invalid `bucket_bytes`"
    ):
        BroadcastFromRank0(bucket_bytes=size)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"`FromStateDict` got an invalid `bucket_bytes`"):
        FromStateDict(None, bucket_bytes=size)  # type: ignore[arg-type]


def test_from_state_dict_source_type_is_checked() -> None:
    with pytest.raises(ConfigurationError, match=r"`FromStateDict` got an invalid `source`"):
        FromStateDict(42)


def test_checksum_is_bit_exact() -> None:
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert checksum(a) == checksum(a.clone())
    assert checksum(a) != checksum(torch.tensor([-0.0, 1.0, float("nan")]))
    assert checksum(torch.zeros(4)) != checksum(torch.zeros(2, 2))
    assert checksum(torch.ones(2, dtype=torch.bfloat16)) != checksum(torch.ones(2))


def test_tensor_subclasses_travel_as_their_inner_tensors() -> None:
    t = TwoTensor(torch.ones(3), torch.zeros(3))
    flat = list(_flatten("w", t, ()))
    assert [s.name for s in flat] == ["w.a", "w.b"]
    assert all(type(s.tensor) is torch.Tensor for s in flat)


# -- one rank, in-process ---------------------------------------------------------------------


class Inner(nn.Module):
    table: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(100, dtype=torch.float32))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", self.inner.table)  # the same tensor, in the outer unit


def test_a_buffer_shared_by_nested_units_is_sent_once(world1: None) -> None:
    b = FSDPBuilder().device(CPUDevice()).wrap(Inner).synchronize(BroadcastFromRank0(64))
    b.build(Outer())
    sent = {r.unit: r.comm_bytes for r in b.report.records if r.stage == "synchronize"}
    linear = (4 * 4 + 4) * 4
    assert sent == {"inner": linear + 100 * 4, "<root>": linear}


@pytest.mark.parametrize("materializer", ["reset", "deterministic"])
def test_broadcast_and_verify_on_one_rank(world1: None, materializer: str) -> None:
    b = (
        FSDPBuilder()
        .device(CPUDevice())
        .wrap(Block)
        .materialize(ResetParameters() if materializer == "reset" else DeterministicInit(1))
        .synchronize(BroadcastFromRank0(bucket_bytes=1000), VerifyReplicas())
    )
    torch.manual_seed(1)
    got = full_state_dict(b.build(meta_demo(CFG)))
    if materializer == "reset":
        # Plain PyTorch from the same seed: the synchronizers change no value, draw no number.
        want = meta_demo(CFG)
        torch.manual_seed(1)
        eager_init_by_unit(demo_units(want))
        assert got.keys() == want.state_dict().keys()
        assert all(torch.equal(got[k], v) for k, v in want.state_dict().items())
    else:
        # Seeds derived by the library have no plain value: the constructor's constants exact,
        # the random states drawn like the eager model's.
        assert_drawn_like_eager(got, eager_draws(lambda: DemoTransformer(CFG)))
    assert all(r.comm_bytes > 0 for r in b.report.records if r.stage == "synchronize")


@pytest.mark.parametrize("fmt", ["mapping", "torch", "safetensors"])
def test_from_state_dict_loads_every_format(world1: None, tmp_path: Path, fmt: str) -> None:
    state = source()
    src: object = state
    if fmt == "torch":
        src = tmp_path / "w.pt"
        torch.save(state, src)
    elif fmt == "safetensors":
        src = str(tmp_path / "w.safetensors")
        save_file(state, src)
    got = full_state_dict(load(src))
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_from_state_dict_needs_the_source_on_rank_0(world1: None) -> None:
    with pytest.raises(ConfigurationError, match=r"rank 0 was given None"):
        load(None)


def test_from_state_dict_reports_missing_keys(world1: None) -> None:
    state = source()
    del state["blocks.1.attn.in_proj_weight"], state["norm.bias"]
    with pytest.raises(
        ConfigurationError,
        match=r"2 missing key\(s\): blocks\.1\.attn\.in_proj_weight, norm\.bias",
    ):
        load(state)


def test_from_state_dict_reports_unexpected_keys_and_wrapper_prefixes(world1: None) -> None:
    state = {f"module.{k}": v for k, v in source().items()}
    with pytest.raises(ConfigurationError, match=r"unexpected key\(s\).*strip 'module\.'"):
        load(state)


def test_from_state_dict_reports_wrong_shapes(world1: None) -> None:
    state = source()
    state["embed.weight"] = torch.zeros(10, 32)
    with pytest.raises(
        ConfigurationError, match=r"'embed\.weight' is \[10, 32\] in the source but \[64, 32\]"
    ):
        load(state)


def test_from_state_dict_reports_a_missing_path(world1: None, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"the path '.*nope\.pt' does not exist on rank 0"):
        load(tmp_path / "nope.pt")


@pytest.mark.parametrize("content", ["text", "checkpoint", "safetensors"])
def test_from_state_dict_reports_a_file_that_is_not_a_state_dict(
    world1: None, tmp_path: Path, content: str
) -> None:
    path = tmp_path / ("x.safetensors" if content == "safetensors" else "x.pt")
    if content == "checkpoint":
        torch.save({"model": source(), "step": 3}, path)
        why = r"entries 'model', 'step' are not tensors.*pass that inner dict"
    else:
        path.write_bytes(pickle.dumps("hello") if content == "text" else b"garbage")
        why = r"torch\.load failed|safetensors could not read it"
    with pytest.raises(ConfigurationError, match=rf"'.*x\.\w+' is not a state dict \(({why})"):
        load(path)


def test_keep_as_is_with_verify_replicas_on_real_weights(world1: None) -> None:
    torch.manual_seed(0)
    b = FSDPBuilder().device(CPUDevice()).materialize(KeepAsIs()).synchronize(VerifyReplicas())
    b.build(DemoTransformer(CFG))
    assert [r.stage for r in b.report.records].count("synchronize") == 1


def test_chain_passes_prepare_on_to_its_steps_and_closes_their_runs() -> None:
    from fsdp_builder.synchronizers import BaseSynchronizer, Chain, NoSync, SyncRun

    seen: list[str] = []

    class Run:
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self, unit: object) -> int:
            seen.append(f"sync {self.name}")
            return 1

        def close(self) -> None:
            seen.append(f"close {self.name}")

    class Prepared(BaseSynchronizer):
        def __init__(self, name: str) -> None:
            self.name = name

        def prepare(self, env: object) -> SyncRun:
            seen.append(f"prepare {self.name}")
            return Run(self.name)

    run = Chain((Prepared("a"), NoSync(), Prepared("b"))).prepare(None)  # type: ignore[arg-type]
    assert run.synchronize(None) == 2  # type: ignore[arg-type]
    run.close()
    assert seen == ["prepare a", "prepare b", "sync a", "sync b", "close a", "close b"]


# -- two ranks ----------------------------------------------------------------------------------


def _mixed_tensors(rank: int) -> list[torch.Tensor]:
    """Rank 0 holds values, the others zeros; sizes on both sides of the coalescing threshold,
    several dtypes, an empty tensor, and layouts that differ between ranks."""
    g = torch.Generator().manual_seed(5)

    def make(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.randn(*shape, generator=g).to(dtype)
        return t if rank == 0 else torch.zeros_like(t)

    big = make(640, 512)  # 1.25 MiB: travels alone, in place
    wide = make(512, 640)
    small = [make(7), make(3, 5), make(33, dtype=torch.float16), make(0), make(4, 4)]
    ints = (torch.arange(50) if rank == 0 else torch.zeros(50, dtype=torch.int64)).clone()
    # Non-contiguous on rank 0 only (large) and on every rank (small): staged, then copied back.
    odd_big = wide.t() if rank == 0 else wide.t().contiguous()
    odd_small = small[4].t()
    return [big, *small[:4], odd_big, ints, odd_small, make(300, 300)]


def _broadcast_mixed(bucket_bytes: int) -> tuple[int, list[torch.Tensor]]:
    from fsdp_builder.synchronizers import broadcast_tensors

    tensors = _mixed_tensors(dist.get_rank())
    ptrs = [t.data_ptr() for t in tensors]
    sent = broadcast_tensors(tensors, 0, None, bucket_bytes)
    # Every tensor was written in place (none replaced), whatever way it travelled.
    assert [t.data_ptr() for t in tensors] == ptrs
    return sent, [t.contiguous() for t in tensors]


BUCKETS = (64, 1000, 250 * 1024 * 1024)


def broadcasts() -> Results:
    """Every bucket size in one spawn, each on its own (see ``isolated``)."""
    return run_each((size, partial(_broadcast_mixed, size)) for size in BUCKETS)


SPAWNS = Spawns(broadcasts, timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_broadcast_tensors_on_two_ranks(bucket_bytes: int) -> None:
    ranks = values(SPAWNS(2), bucket_bytes)
    want = [t.contiguous() for t in _mixed_tensors(0)]
    total = sum(t.numel() * t.element_size() for t in want)
    for sent, got in ranks:
        assert sent == total
        assert len(got) == len(want)
        assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
