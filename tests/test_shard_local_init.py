"""StreamInit: shard-local initialization whose full weights do not depend on the world size."""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdp_builder import CPUDevice, FSDPBuilder, FullyShardBuilder
from fsdp_builder.materializers import streams
from fsdp_builder.materializers.streams import (
    StreamInit,
    _draw_flat,
    _Streams,
    global_indices,
    streamed_init,
)

SEED = 11
# Every unit filled shard by shard (the default fills small units whole, then shards them).
SHARDWISE = StreamInit(seed=SEED, whole_below=0)


class TruncNormal(nn.Module):
    """Initialized the way transformers' models are: truncated normal, Kaiming/Xavier normal."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(dim * 2, dim))
        self.b = nn.Parameter(torch.empty(dim, dim * 3))
        self.c = nn.Parameter(torch.empty(dim + 3, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.a, std=0.02)
        nn.init.kaiming_normal_(self.b, nonlinearity="relu")
        nn.init.xavier_normal_(self.c)


class TensorMethods(nn.Module):
    """Initialized the way no shard can be by itself: tensor methods drawing from torch's
    generator, a row view, ``orthogonal_``, a copy from a tensor drawn in full."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.drawn = nn.Parameter(torch.empty(dim * 2 + 1, dim))
        self.ortho = nn.Parameter(torch.empty(dim, dim))
        self.copied = nn.Parameter(torch.empty(dim + 1, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.drawn.data.normal_(0.0, 0.02)
        self.drawn.data[0].zero_()
        nn.init.orthogonal_(self.ortho)
        with torch.no_grad():
            self.copied.copy_(torch.rand(self.copied.shape))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim * 2)
        self.attn = nn.MultiheadAttention(dim * 2, 2, batch_first=True)
        self.conv = nn.Conv1d(dim * 2, dim, 3)
        self.extra = TruncNormal(dim)
        self.methods = TensorMethods(dim)


PADDING = 3


class Model(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        # Rows that split unevenly across 2, 4 and 8 ranks; the padding row is zeroed through
        # a row view of the (sharded) weight.
        self.embed = nn.Embedding(37, dim, padding_idx=PADDING)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 37)


def _build(backend: str) -> tuple[dict[str, torch.Tensor], int]:
    """The gathered full weights, and how many parameter elements this rank holds."""
    with torch.device("meta"):
        model = Model()
    builder = FullyShardBuilder() if backend == "fsdp2" else FSDPBuilder()
    builder.device(CPUDevice()).wrap(Block).materialize(SHARDWISE)
    sharded = builder.build(model)
    held = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in sharded.parameters()
    )
    return {k: v.clone() for k, v in full_state_dict(sharded).items()}, held


def _both_backends() -> dict[str, Any]:
    # Blocks far smaller than the parameters: shard edges cut blocks at every world size, and
    # FSDP2 (shards) and FSDP1 (whole units) draw them differently, for the same values.
    streams.BLOCK = 40
    fsdp2, held = _build("fsdp2")
    return {"fsdp2": fsdp2, "fsdp1": _build("fsdp1")[0], "local_numel": held}


WORLDS = (1, 2, 4, 8)


def _mixed() -> dict[str, Any]:
    """The default decision per unit: the root unit (about 5 KB) is filled whole, then sharded;
    each Block (about 70 KB) is sharded first."""
    streams.BLOCK = 40
    with torch.device("meta"):
        model = Model()
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    sharded = builder.materialize(StreamInit(seed=SEED, whole_below=20_000)).build(model)
    order: dict[str, list[str]] = {}
    for record in builder.report.records:
        order.setdefault(record.unit, []).append(record.stage)
    return {"state": {k: v.clone() for k, v in full_state_dict(sharded).items()}, "order": order}


def _columns(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.ndim >= 2 else None


def _by_columns() -> dict[str, Any]:
    """FSDP2 with every matrix split along dim 1: each rank draws a strided part."""
    streams.BLOCK = 40
    with torch.device("meta"):
        model = Model()
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).shard_placement_fn(_columns)
    sharded = builder.materialize(SHARDWISE).build(model)
    local = {
        n: tuple(p.to_local().shape)
        for n, p in sharded.named_parameters()
        if isinstance(p, DTensor)
    }
    return {"state": {k: v.clone() for k, v in full_state_dict(sharded).items()}, "local": local}


def _scenarios() -> Results:
    return run_each([("builds", _both_backends), ("mixed", _mixed), ("columns", _by_columns)])


# 15 ranks in all. Generous bounds: a machine that may be busy.
SPAWNS = Spawns(_scenarios, timeout=500)


@pytest.fixture(scope="module")
def builds() -> dict[int, list[dict[str, Any]]]:
    return {w: values(SPAWNS(w), "builds") for w in WORLDS}


@pytest.mark.timeout(2000)
def test_full_weights_bit_identical_at_every_world_size(
    builds: dict[int, list[dict[str, Any]]],
) -> None:
    reference = builds[1][0]["fsdp2"]
    assert len(reference) > 20
    for world, ranks in builds.items():
        for backend in ("fsdp2", "fsdp1"):
            got = ranks[0][backend]
            assert got.keys() == reference.keys(), (world, backend)
            for name, value in reference.items():
                assert torch.equal(got[name], value), (world, backend, name)


@pytest.mark.timeout(2000)
def test_small_units_filled_whole_have_the_same_weights(
    builds: dict[int, list[dict[str, Any]]],
) -> None:
    reference = builds[1][0]["fsdp2"]
    for world in WORLDS:
        mixed = values(SPAWNS(world), "mixed")[0]
        orders = {tuple(o) for o in mixed["order"].values()}
        if world > 1:  # the root unit first filled whole, the blocks first sharded
            assert mixed["order"]["<root>"][:2] == ["materialize", "move"], world
            assert mixed["order"]["blocks.0"][:2] == ["shard", "materialize"], world
            assert len(orders) == 2, (world, orders)
        assert mixed["state"].keys() == reference.keys(), world
        for name, value in reference.items():
            assert torch.equal(mixed["state"][name], value), (world, name)


@pytest.mark.timeout(2000)
def test_shards_along_dim_1_have_the_same_weights(
    builds: dict[int, list[dict[str, Any]]],
) -> None:
    reference = builds[1][0]["fsdp2"]
    shapes = {n: p.shape for n, p in Model().named_parameters()}
    for world in WORLDS:
        ranks = values(SPAWNS(world), "columns")
        for rank, got in enumerate(ranks):
            for name, shape in shapes.items():
                dim = 1 if len(shape) >= 2 else 0
                chunks = torch.chunk(torch.empty(shape, device="meta"), world, dim=dim)
                expected = chunks[rank].shape if rank < len(chunks) else None
                if expected is not None:
                    assert got["local"][name] == tuple(expected), (world, rank, name)
        state = ranks[0]["state"]
        assert state.keys() == reference.keys(), world
        for name, value in reference.items():
            assert torch.equal(state[name], value), (world, name)


@pytest.mark.timeout(2000)
def test_ranks_hold_only_their_shards(builds: dict[int, list[dict[str, Any]]]) -> None:
    full = builds[1][0]["local_numel"]
    for world in WORLDS[1:]:
        held = sum(r["local_numel"] for r in builds[world])
        # Every element held once across the ranks, and each rank holds about 1/W of it.
        assert held == full, world
        assert max(r["local_numel"] for r in builds[world]) < full / world * 1.5, world


@pytest.mark.timeout(2000)
def test_weights_differ_between_parameters_and_rows(
    builds: dict[int, list[dict[str, Any]]],
) -> None:
    sd = builds[1][0]["fsdp2"]
    a, b = sd["blocks.0.linear.weight"], sd["blocks.1.linear.weight"]
    assert not torch.equal(a, b)
    # Not one shard repeated: the two halves of a sharded weight differ.
    rows = a.shape[0] // 2
    assert not torch.equal(a[:rows], a[rows : 2 * rows])
    # What was initialized on whole tensors is what the module's own code gives them.
    assert not sd["embed.weight"][PADDING].any()
    assert sd["embed.weight"].std() > 0.5
    drawn = sd["blocks.0.methods.drawn"]
    assert not drawn[0].any() and abs(float(drawn[1:].std()) - 0.02) < 0.004
    assert not torch.equal(drawn, sd["blocks.1.methods.drawn"])
    ortho = sd["blocks.0.methods.ortho"]
    assert torch.allclose(ortho @ ortho.T, torch.eye(ortho.shape[0]), atol=1e-5)
    copied = sd["blocks.0.methods.copied"]
    assert 0 <= float(copied.min()) and float(copied.max()) < 1
    assert not torch.equal(copied[:8], copied[8:16])


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _stats_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "linear": nn.Linear(256, 512),
            "conv": nn.Conv2d(32, 64, 3),
            "embed": nn.Embedding(1000, 64),
            "attn": nn.MultiheadAttention(128, 4),
            "extra": TruncNormal(128),
        }
    )


@pytest.mark.timeout(60)
def test_statistics_match_eager_reset_parameters() -> None:
    eager = _named(_stats_model())
    streamed_model = _stats_model()
    streams = _Streams(SEED)
    streams.names.update({id(p): n for n, p in streamed_model.named_parameters()})
    with torch.no_grad(), streamed_init(streams):
        for module in reversed(list(streamed_model.modules())):  # children first, as eager
            if isinstance(module, nn.MultiheadAttention):
                module._reset_parameters()
            elif hasattr(module, "reset_parameters") and module is not streamed_model:
                module.reset_parameters()  # type: ignore[operator]
    streamed = _named(streamed_model)
    for name, value in eager.items():
        got = streamed[name]
        if value.std() == 0:
            assert torch.equal(got, value), name  # constants stay constants
            continue
        assert not torch.equal(got, value), name  # drawn from the streams, not torch's RNG
        got, value = got.detach(), value.detach()
        assert float(got.abs().max()) <= float(value.abs().max()) * 1.2, name
        if value.numel() < 1000:
            continue  # too few draws for the standard deviation to be within 10 %
        assert math.isclose(float(got.std()), float(value.std()), rel_tol=0.10), name
        # Four standard errors of the mean apart at most.
        assert abs(float(got.mean())) < 4 * float(value.std()) / math.sqrt(value.numel()), name


def test_global_indices_of_a_plain_tensor_are_row_major() -> None:
    t = torch.empty(3, 4, 5)
    assert torch.equal(global_indices(t), torch.arange(60).view(3, 4, 5))


@pytest.mark.parametrize("block", [7, 64, 1 << 16])
def test_any_run_of_elements_draws_what_the_whole_tensor_draws(
    monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(streams, "BLOCK", block)

    def draw(out: torch.Tensor, g: torch.Generator) -> None:
        out.uniform_(-1.0, 1.0, generator=g)

    whole = torch.empty(1000)
    _draw_flat(5, whole, 0, 1000, draw)
    for start, stop in [(0, 1000), (3, 500), (500, 1000), (63, 64), (999, 1000)]:
        part = torch.empty(stop - start)
        _draw_flat(5, part, start, 1000, draw)
        assert torch.equal(part, whole[start:stop]), (start, stop)
    other = torch.empty(1000)
    _draw_flat(6, other, 0, 1000, draw)
    assert not torch.equal(other, whole)
    assert -1.0 <= float(whole.min()) and float(whole.max()) < 1.0
    assert abs(float(whole.mean())) < 0.1


def test_other_tensors_use_torch_own_initializers() -> None:
    streams = _Streams(SEED)
    t = torch.empty(100)
    torch.manual_seed(3)
    expected = torch.empty(100).uniform_(-1, 1)
    torch.manual_seed(3)
    with streamed_init(streams):
        nn.init.uniform_(t, -1, 1)
    assert torch.equal(t, expected)
    assert nn.init.uniform_.__module__ == "torch.nn.init"  # restored


def test_seed_is_validated() -> None:
    from fsdp_builder.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        StreamInit(seed=-1)
    for bad in (-1, True, 1.5, "256K"):
        with pytest.raises(ConfigurationError, match=r"StreamInit.*whole_below.*whole_below=0"):
            StreamInit(whole_below=bad)  # type: ignore[arg-type]


# torch's own functions, as imported before any build.
TORCH_NORMAL = nn.init.normal_
TORCH_XAVIER_UNIFORM = nn.init.xavier_uniform_


def _torch_normal(n: int) -> torch.Tensor:
    return torch.empty(n).normal_(generator=torch.Generator().manual_seed(5))


def _in_thread(fn: Callable[[], None]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_a_named_tensor_draws_from_its_stream_on_this_thread_only() -> None:
    t = torch.empty(1000)
    streams = _Streams(SEED)
    streams.names[id(t)] = "t"
    seen: dict[str, torch.Tensor] = {}

    def other_thread() -> None:
        nn.init.normal_(t, generator=torch.Generator().manual_seed(5))
        seen["other"] = t.clone()

    with torch.no_grad(), streamed_init(streams):
        _in_thread(other_thread)
        nn.init.normal_(t, generator=torch.Generator().manual_seed(5))
    # The other thread got torch's draw though the tensor is named; this one the stream's.
    assert torch.equal(seen["other"], _torch_normal(1000))
    assert not torch.equal(t, _torch_normal(1000))
    assert abs(float(t.std()) - 1.0) < 0.1


class _Probe(nn.Module):
    """Records, from inside its initializer during a build, torch's and transformers'
    initializers and another thread's ``nn.init.normal_``."""

    seen: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4))
        self.attn = nn.MultiheadAttention(4, 2)

    def reset_parameters(self) -> None:
        from transformers.initialization import TORCH_INIT_FUNCTIONS as table

        seen = _Probe.seen
        seen["nn.init"] = nn.init.normal_, nn.init.xavier_uniform_
        seen["transformers"] = table["normal_"], table["trunc_normal_"]
        seen["activation"] = sys.modules["torch.nn.modules.activation"].xavier_uniform_

        def other_thread() -> None:
            seen["drawn"] = nn.init.normal_(
                torch.empty(100), generator=torch.Generator().manual_seed(5)
            )

        _in_thread(other_thread)
        nn.init.normal_(self.weight)


@pytest.mark.timeout(60)
def test_a_build_replaces_no_function_of_torch_or_transformers(world1: None) -> None:
    pytest.importorskip("transformers")
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    table = dict(TORCH_INIT_FUNCTIONS)
    with torch.device("meta"):
        model = _Probe()
    builder = FullyShardBuilder().device(CPUDevice()).materialize(SHARDWISE)
    with pytest.warns(UserWarning):  # NO_SHARD on one rank
        sharded = builder.build(model)
    seen = _Probe.seen
    assert seen["nn.init"] == (TORCH_NORMAL, TORCH_XAVIER_UNIFORM)
    assert seen["transformers"] == (table["normal_"], table["trunc_normal_"])
    assert seen["transformers"][0] is TORCH_NORMAL
    assert seen["activation"] is TORCH_XAVIER_UNIFORM
    assert torch.equal(seen["drawn"], _torch_normal(100))
    assert TORCH_INIT_FUNCTIONS == table
    weight = full_state_dict(sharded)["weight"]
    assert weight.std() > 0.5  # drawn during the build


class _Truncated(nn.Module):
    def __init__(self, via_data: bool) -> None:
        super().__init__()
        self.via_data = via_data
        self.torch_init = nn.Parameter(torch.empty(64, 8))
        self.transformers_init = nn.Parameter(torch.empty(64, 8))

    def reset_parameters(self) -> None:
        from transformers import initialization

        if self.via_data:  # a draw on an alias: answered on whole tensors
            self.torch_init.data.normal_()
        else:
            nn.init.trunc_normal_(self.torch_init, std=1.0, a=-1.5, b=2.0)
        initialization.trunc_normal_(self.transformers_init, std=1.0)  # in [-2, 2]


@pytest.mark.timeout(60)
def test_trunc_normal_is_drawn_on_the_shard(world1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    on_whole: list[str] = []
    original = streams._StreamedInit._on_whole_tensors

    def spy(self: Any, entry: Any, why: str) -> None:
        on_whole.append(why)
        original(self, entry, why)

    monkeypatch.setattr(streams._StreamedInit, "_on_whole_tensors", spy)
    for via_data in (False, True):
        with torch.device("meta"):
            model = nn.Sequential(_Truncated(via_data))
        builder = FullyShardBuilder().device(CPUDevice()).materialize(SHARDWISE)
        with pytest.warns(UserWarning):  # NO_SHARD on one rank
            state = full_state_dict(builder.build(model))
        assert len(on_whole) == via_data, via_data
        if not via_data:
            drawn = state["0.torch_init"]
            assert -1.5 <= float(drawn.min()) and float(drawn.max()) <= 2.0
            assert float(drawn.min()) < -1.0 and float(drawn.max()) > 1.5
        assert 1.5 < float(state["0.transformers_init"].abs().max()) <= 2.0


@pytest.mark.parametrize(("fan", "a"), [(6, math.sqrt(5)), (3, 0.0), (129, 0.01)])
def test_kaiming_draw_is_torchs_own_in_float64(fan: int, a: float) -> None:
    """A tensor that is one block draws from its block's generator as torch's own
    ``kaiming_uniform_`` draws from a generator seeded alike: the bound is computed in torch's
    order, so even float64 values are bit-equal (a reordered product differs in the last bit)."""
    weight = torch.empty(7, fan, dtype=torch.float64)
    state = _Streams(SEED)
    state.names[id(weight)] = "w"
    with streamed_init(state):
        nn.init.kaiming_uniform_(weight, a=a, nonlinearity="leaky_relu")
    # The stream's seeds for this draw: key of ("w", first draw), block 0 (tensor inputs only).
    key = streams.digest63(f"{SEED}/w/0")
    generator = torch.Generator().manual_seed(streams.digest63(f"{key}/0"))
    expected = torch.empty(7, fan, dtype=torch.float64)
    nn.init.kaiming_uniform_(expected, a=a, nonlinearity="leaky_relu", generator=generator)
    assert torch.equal(weight, expected)
