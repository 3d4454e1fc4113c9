"""Materializers and synchronizers on 1, 2 and 4 gloo ranks with the FSDP1 backend.

One spawn per world size runs every scenario, each on its own (see ``isolated``; one rank runs in
this process); the tests below only read their scenario's results and compare them with
plain-PyTorch references computed here.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from models import (
    TiedDemo,
    assert_drawn_like_eager,
    demo_units,
    eager_draws,
    eager_init_by_unit,
    meta_demo,
    one_thread,
    reset_module,
    seeded_demo,
)
from structlog.testing import capture_logs
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_builder import (
    BroadcastFromRank0,
    CPUDevice,
    DeterministicInit,
    FromStateDict,
    FSDPBuilder,
    FullyShardBuilder,
    InitFn,
    KeepAsIs,
    ResetParameters,
    ShardingBuilder,
    VerifyReplicas,
)
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, batch, loss_fn, train

# Whichever test first reads a world size's results starts its spawn (deadline 240 s).
pytestmark = pytest.mark.timeout(300)

CFG = DemoConfig(vocab=64, dim=32, heads=2, layers=2, seq=8)
STEPS = 2
SEED = 7
STRATEGIES = {1: ["full", "grad_op", "none"], 2: ["full", "grad_op", "none"]}
STRATEGIES[4] = [*STRATEGIES[2], "hybrid"]
MATERIALIZERS = ["reset", "init_fn", "deterministic", "load"]
BACKENDS = ["fsdp1", "fsdp2"]
MATRIX = {
    w: [(b, s, m) for b in BACKENDS for s in STRATEGIES[w] for m in MATERIALIZERS]
    for w in STRATEGIES
}
# The source format FromStateDict reads, per strategy: each format is covered by some build.
LOAD_FORMAT = {"full": "torch", "grad_op": "safetensors", "none": "mapping", "hybrid": "torch"}


def init_fn(module: nn.Module) -> None:
    """A user initializer: the module's own reset, with a twist to tell it from ResetParameters."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is not None:
        reset()
    for p in module.parameters(recurse=False):
        p.mul_(0.5)


def source_state(seed: int = 123) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in seeded_demo(CFG, seed).state_dict().items()}


def builder(strategy: str, backend: str = "fsdp1") -> ShardingBuilder:
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    b = kind().device(CPUDevice()).wrap(Block).sharding(strategy)
    if strategy == "hybrid":
        b.groups(init_device_mesh("cpu", (2, 2)))
    return b


def materializer(name: str, strategy: str, paths: dict[str, str]) -> Any:
    if name == "reset":
        return ResetParameters()
    if name == "init_fn":
        return InitFn(init_fn, allocate=True)
    if name == "deterministic":
        return DeterministicInit(SEED)
    fmt = LOAD_FORMAT[strategy]
    if dist.get_rank() != 0:
        return FromStateDict(None)
    return FromStateDict(source_state() if fmt == "mapping" else paths[fmt])


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    """What this rank keeps: FSDP1's flat-parameter shards, or FSDP2's local DTensor shards."""
    flat = [
        m._handle.flat_param.detach().clone()
        for m in model.modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None
    ]
    return flat or [cast(DTensor, p).to_local().detach().clone() for p in model.parameters()]


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def matrix_case(backend: str, strategy: str, name: str, paths: dict[str, str]) -> dict[str, Any]:
    """Build with one materializer, train, gather: the initial and final full states and losses
    (and, for deterministic init with full sharding, the build's stage events and local shards)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # RNG-based materializers draw the same numbers on every rank
    b = builder(strategy, backend).materialize(materializer(name, strategy, paths))
    out: dict[str, Any] = {}
    if name == "deterministic" and strategy == "full":
        with capture_logs() as events:
            sharded = b.build(meta_demo(CFG))
        out["events"] = [e for e in events if e.get("event") == "build_stage"]
        out["shards"] = local_shards(sharded)
    else:
        sharded = b.build(meta_demo(CFG))
    initial = full_state_dict(sharded)
    losses = train(sharded, CFG, STEPS, rank, world)
    final = full_state_dict(sharded)  # collective: every rank gathers
    out.update(
        initial=initial if rank == 0 else None, final=final if rank == 0 else None, losses=losses
    )
    return out


def mixed_case(strategy: str) -> dict[str, torch.Tensor]:
    """pytorch issue 105840: only rank 0 holds real weights, the others are on meta."""
    model = seeded_demo(CFG, 5) if dist.get_rank() == 0 else meta_demo(CFG)
    b = builder(strategy).materialize(ResetParameters()).synchronize(BroadcastFromRank0())
    return full_state_dict(b.build(model))


def verify_case(strategy: str) -> dict[str, Any]:
    """A divergence planted on the last rank: caught, then fixed by the broadcast."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def planted() -> DemoTransformer:
        model = seeded_demo(CFG, 0)
        if rank == world - 1:
            with torch.no_grad():
                first = cast(Block, model.blocks[1]).mlp[0]
                cast(nn.Linear, first).weight[0, 0] += 1.0
        return model

    caught: tuple[str, str] | None = None
    try:
        builder(strategy).materialize(KeepAsIs()).synchronize(VerifyReplicas()).build(planted())
    except Exception as exc:
        caught = _error(exc)
    fixed = (
        builder(strategy)
        .materialize(KeepAsIs())
        .synchronize(BroadcastFromRank0(bucket_bytes=4096), VerifyReplicas())
        .build(planted())
    )
    return {"caught": caught, "fixed": full_state_dict(fixed)}


def tied_case() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    tied = builder("full").materialize(DeterministicInit(SEED)).build(meta_demo(CFG, TiedDemo))
    tied_initial = full_state_dict(tied)
    train(tied, CFG, 1, rank, world)
    return tied_initial, full_state_dict(tied)


def bad_case(case: str, paths: dict[str, str]) -> tuple[str, str, bool] | None:
    """A bad FromStateDict source: the error, and whether the model was left all on meta."""
    source = bad_sources(paths)[case]
    model = meta_demo(CFG)
    try:
        b = builder("full").materialize(FromStateDict(source if dist.get_rank() == 0 else None))
        b.build(model)
    except Exception as exc:
        return (*_error(exc), all(p.is_meta for p in model.parameters()))
    return None


def multi_strategies(world: int) -> tuple[str, ...]:
    """The strategies of the mixed-device and verify scenarios on ``world`` ranks."""
    return ("full", "hybrid") if world == 4 else ("full",)


BAD_CASES = ["missing", "unexpected", "shape", "no_path", "not_state_dict"]


def cases(paths: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    """Every scenario of one world size, keyed as the tests read them."""
    world = dist.get_world_size()
    for backend, strategy, name in MATRIX[world]:
        yield (
            ("matrix", name, strategy, backend),
            partial(matrix_case, backend, strategy, name, paths),
        )
    if world > 1:
        for strategy in multi_strategies(world):
            yield ("mixed", strategy), partial(mixed_case, strategy)
            yield ("verify", strategy), partial(verify_case, strategy)
        yield "tied", tied_case
        for case in BAD_CASES:
            yield ("bad", case), partial(bad_case, case, paths)


def scenarios(paths: dict[str, str]) -> Results:
    """Everything one rank does; each scenario's result or error, for the tests to compare."""
    return run_each(cases(paths))


def bad_sources(paths: dict[str, str]) -> dict[str, Any]:
    good = source_state()
    missing = dict(good)
    missing.pop("blocks.0.mlp.0.weight")
    unexpected = {**good, "blocks.9.extra": torch.zeros(1)}
    shape = {**good, "head.bias": torch.zeros(3)}
    return {
        "missing": missing,
        "unexpected": unexpected,
        "shape": shape,
        "no_path": paths["missing"],
        "not_state_dict": paths["not_sd"],
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("weights")
    state = source_state()
    torch.save(state, root / "model.pt")
    save_file(state, str(root / "model.safetensors"))
    (root / "notes.txt").write_text("not a checkpoint")
    return {
        "torch": str(root / "model.pt"),
        "safetensors": str(root / "model.safetensors"),
        "missing": str(root / "absent.pt"),
        "not_sd": str(root / "notes.txt"),
    }


SPAWNS = Spawns(scenarios, timeout=240)
_ONE_RANK: list[Results] = []


def one_rank(files: dict[str, str]) -> list[Results]:
    """World size 1 in this process: a one-rank gloo group needs no spawn."""
    if not _ONE_RANK:
        # What a spawned rank would print to its stderr (FSDP's notes on NO_SHARD state dicts
        # and on views) is not the tests' business here either.
        with one_thread(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                _ONE_RANK.append(scenarios(files))
            finally:
                dist.destroy_process_group()
    return _ONE_RANK


def scenario(world: int, files: dict[str, str], key: Hashable) -> list[Any]:
    """Scenario ``key`` on ``world`` ranks, per rank; each world size runs once per module,
    whichever test asks first."""
    return values(one_rank(files) if world == 1 else SPAWNS(world, files), key)


MULTI = [2, 4]  # the world sizes of the checks that need several ranks


@functools.cache
def expected_initial(name: str) -> dict[str, torch.Tensor]:
    """What plain PyTorch gives the same meta model under the seed every rank uses: per unit
    (bottom-up) ``to_empty``, then each module's initializer (``ResetParameters``) or
    ``init_fn`` (``InitFn(init_fn, allocate=True)``), children first; for the loaders, the
    source. ``DeterministicInit`` has no such value: see ``assert_deterministic``."""
    if name == "load":
        return source_state()
    assert name in ("reset", "init_fn"), name
    model = meta_demo(CFG)
    torch.manual_seed(0)
    eager_init_by_unit(demo_units(model), reset_module if name == "reset" else init_fn)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def eager_pools(tied: bool = False) -> dict[str, list[torch.Tensor]]:
    return eager_draws(lambda: TiedDemo(CFG) if tied else DemoTransformer(CFG))


def assert_deterministic(state: dict[str, torch.Tensor], tied: bool = False) -> None:
    """DeterministicInit seeds each module from SEED and its name by a digest of the library's
    own, so no plain-PyTorch run gives its values. What can be checked from outside: the
    constructor's constant states exactly, the random ones as draws of the eager constructor's
    distributions, distinct between modules (see ``assert_drawn_like_eager``). That the values
    are the same at every world size, strategy and backend is
    ``test_deterministic_init_is_identical_across_world_sizes``."""
    assert_drawn_like_eager(state, eager_pools(tied))


def train_reference(initial: dict[str, torch.Tensor], world: int) -> dict[str, Any]:
    """Plain PyTorch on one process from ``initial``: SGD on each whole global batch, with the
    loss of each rank's slice before each step (what that rank must see) and the final state."""
    model = DemoTransformer(CFG)
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # demo.train's rate
    per_rank = 2  # demo.train's slice
    losses: list[list[float]] = [[] for _ in range(world)]
    with one_thread():
        for step in range(STEPS):
            tokens = batch(CFG, step, per_rank * world)
            with torch.no_grad():
                for r in range(world):
                    part = tokens[r * per_rank : (r + 1) * per_rank]
                    losses[r].append(float(loss_fn(model, part, CFG.vocab)))
            opt.zero_grad()
            loss_fn(model, tokens, CFG.vocab).backward()
            opt.step()
    return {"losses": losses, "state_dict": dict(model.state_dict())}


@functools.cache
def _reference(name: str, world: int) -> dict[str, Any]:
    return train_reference(expected_initial(name), world)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.equal(got[k], want[k]), (what, k)


CELLS = [(w, *cell) for w in MATRIX for cell in MATRIX[w]]
CELL_IDS = [f"w{w}-{b}-{s}-{m}" for w, b, s, m in CELLS]


@pytest.mark.parametrize(("world", "backend", "strategy", "name"), CELLS, ids=CELL_IDS)
def test_gathered_initial_state_equals_plain_pytorch(
    files: dict[str, str], world: int, backend: str, strategy: str, name: str
) -> None:
    got = scenario(world, files, ("matrix", name, strategy, backend))[0]["initial"]
    if name == "deterministic":
        assert_deterministic(got)
    else:
        assert_same(got, expected_initial(name), (name, strategy, backend))


@pytest.mark.parametrize(("world", "backend", "strategy", "name"), CELLS, ids=CELL_IDS)
def test_training_matches_single_process_reference(
    files: dict[str, str], world: int, backend: str, strategy: str, name: str
) -> None:
    ranks = scenario(world, files, ("matrix", name, strategy, backend))
    # DeterministicInit's start is checked on its own (test above); training starts from it.
    initial = ranks[0]["initial"]
    ref = train_reference(initial, world) if name == "deterministic" else _reference(name, world)
    case = (name, strategy, backend)
    for rank in range(world):
        got = torch.tensor(ranks[rank]["losses"])
        want = torch.tensor(ref["losses"][rank])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (case, rank)
    final = ranks[0]["final"]
    for k, v in ref["state_dict"].items():
        assert torch.allclose(final[k], v, atol=1e-5, rtol=0), (case, k)


def test_deterministic_init_is_identical_across_world_sizes(files: dict[str, str]) -> None:
    seen = [
        scenario(w, files, ("matrix", name, strategy, backend))[0]["initial"]
        for w in (1, 2, 4)
        for backend, strategy, name in MATRIX[w]
        if name == "deterministic"
    ]
    assert len(seen) >= 3
    # Equal to each other, and each a draw of the eager constructor (no plain value exists).
    assert_deterministic(seen[0])
    for other in seen[1:]:
        assert_same(other, seen[0], "world-size invariance")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", MULTI)
def test_ranks_never_hold_identical_random_shards(
    files: dict[str, str], world: int, backend: str
) -> None:
    ranks = scenario(world, files, ("matrix", "deterministic", "full", backend))
    # The local shards of each parameter (or flat parameter) differ between every pair of
    # ranks wherever they hold random values.
    per_rank = [r["shards"] for r in ranks]
    for i in range(len(per_rank[0])):
        if not per_rank[0][i].std() > 0:
            continue  # zeros and ones are the same everywhere by design
        for a in range(world):
            for b in range(a + 1, world):
                assert not torch.equal(per_rank[a][i], per_rank[b][i]), (backend, i, a, b)
    # And no gathered random weight is one slice repeated (what FSDP2 + meta on CPU gives).
    initial = ranks[0]["initial"]
    for name, weight in initial.items():
        if weight.dim() < 2 or not weight.any():
            continue
        chunks = weight.reshape(-1).chunk(world)
        assert all(not torch.equal(chunks[0], c) for c in chunks[1:]), (backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_per_unit_order_materialize_move_sync_shard(
    files: dict[str, str], world: int, backend: str
) -> None:
    ranks = scenario(world, files, ("matrix", "deterministic", "full", backend))
    units = ["blocks.0", "blocks.1", "<root>"]
    for rank in range(world):
        events = ranks[rank]["events"]
        assert all(e["rank"] == rank and e["world_size"] == world for e in events)
        got = [(e["unit"], e["stage"]) for e in events]
        assert got == [
            (u, s) for u in units for s in ("materialize", "move", "synchronize", "shard")
        ], backend


MULTI_STRATEGIES = [(w, s) for w in MULTI for s in multi_strategies(w)]


@pytest.mark.parametrize(("world", "strategy"), MULTI_STRATEGIES)
def test_rank0_real_others_meta_is_filled_by_broadcast(
    files: dict[str, str], world: int, strategy: str
) -> None:
    want = seeded_demo(CFG, 5).state_dict()
    for rank, state in enumerate(scenario(world, files, ("mixed", strategy))):
        assert_same(state, dict(want), (rank, strategy))


@pytest.mark.parametrize(("world", "strategy"), MULTI_STRATEGIES)
def test_verify_replicas_catches_a_planted_divergence_and_broadcast_fixes_it(
    files: dict[str, str], world: int, strategy: str
) -> None:
    ranks = scenario(world, files, ("verify", strategy))
    want = dict(seeded_demo(CFG, 0).state_dict())
    messages = {ranks[r]["caught"] for r in range(world)}
    assert len(messages) == 1, messages  # the same error on every rank
    caught = messages.pop()
    assert caught is not None, "VerifyReplicas let the planted divergence through"
    kind, message = caught
    assert kind == "StateMismatchError"
    assert "'blocks.1.mlp.0.weight'" in message
    assert re.search(rf"rank\(s\) {world - 1} differ from rank\(s\) 0", message)
    for rank in range(world):
        assert_same(ranks[rank]["fixed"], want, (rank, strategy))


@pytest.mark.parametrize("world", MULTI)
def test_tied_weights_stay_tied(files: dict[str, str], world: int) -> None:
    ranks = scenario(world, files, "tied")
    initial, trained = ranks[0]
    # The tied weight is a draw of the embedding's initializer (N(0, 1)), not the head's
    # (uniform, 1/sqrt(dim)): the embedding's wins, as when TiedDemo(cfg) is constructed.
    assert_deterministic(initial, tied=True)
    assert torch.equal(initial["embed.weight"], initial["head.weight"])
    assert torch.equal(trained["embed.weight"], trained["head.weight"])
    assert not torch.equal(trained["embed.weight"], initial["embed.weight"])


BAD = {
    "missing": r"1 missing key\(s\): blocks\.0\.mlp\.0\.weight",
    "unexpected": r"1 unexpected key\(s\): blocks\.9\.extra",
    "shape": r"'head\.bias' is \[3\] in the source but \[64\] in the model",
    "no_path": r"absent\.pt' does not exist on rank 0",
    "not_state_dict": r"notes\.txt' is not a state dict",
}
assert list(BAD) == BAD_CASES


@pytest.mark.parametrize("case", BAD_CASES)
@pytest.mark.parametrize("world", MULTI)
def test_bad_sources_raise_the_same_clear_error_on_every_rank_before_writing(
    files: dict[str, str], world: int, case: str
) -> None:
    pattern = BAD[case]
    seen = set(scenario(world, files, ("bad", case)))
    assert len(seen) == 1, (case, seen)
    outcome = seen.pop()
    assert outcome is not None, case
    kind, message, untouched = outcome
    assert kind == "ConfigurationError", (case, message)
    assert message.startswith("`FromStateDict` got an invalid `source`"), message
    assert re.search(pattern, message), (case, message)
    assert untouched, case  # no weight was written anywhere
