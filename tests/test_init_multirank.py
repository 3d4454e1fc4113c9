"""Materializers and synchronizers on 1, 2 and 4 gloo ranks with the FSDP1 backend.

One spawn per world size runs every scenario; the tests below only read its results and compare
them with single-process references computed here.
"""

from __future__ import annotations

import re
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
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
from fsdp_builder.demo import Block, DemoConfig, DemoTransformer, full_state_dict, reference, train
from fsdp_builder.launch import run_ranks

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


class TiedDemo(DemoTransformer):
    """The demo model with its output projection tied to the embedding."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__(cfg)
        self.head.weight = self.embed.weight


def meta_model(cls: type[DemoTransformer] = DemoTransformer) -> DemoTransformer:
    with torch.device("meta"):
        return cls(CFG)


def real_model(seed: int) -> DemoTransformer:
    torch.manual_seed(seed)
    return DemoTransformer(CFG)


def source_state(seed: int = 123) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in real_model(seed).state_dict().items()}


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
        return InitFn(init_fn)
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


def scenarios(paths: dict[str, str]) -> dict[str, Any]:
    """Everything one rank does; returns what the tests compare."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[Any, Any] = {"matrix": {}, "mixed": {}, "verify": {}, "bad": {}}

    for backend, strategy, name in MATRIX[world]:
        torch.manual_seed(0)  # RNG-based materializers draw the same numbers on every rank
        b = builder(strategy, backend).materialize(materializer(name, strategy, paths))
        if name == "deterministic" and strategy == "full":
            with capture_logs() as events:
                sharded = b.build(meta_model())
            out["events", backend] = [e for e in events if e.get("event") == "build_stage"]
            out["shards", backend] = local_shards(sharded)
        else:
            sharded = b.build(meta_model())
        initial = full_state_dict(sharded)
        losses = train(sharded, CFG, STEPS, rank, world)
        final = full_state_dict(sharded)  # collective: every rank gathers
        out["matrix"][name, strategy, backend] = {
            "initial": initial if rank == 0 else None,
            "final": final if rank == 0 else None,
            "losses": losses,
        }

    if world > 1:
        for strategy in ("full", "hybrid") if world == 4 else ("full",):
            # pytorch issue 105840: only rank 0 holds real weights, the others are on meta.
            model = real_model(5) if rank == 0 else meta_model()
            b = builder(strategy).materialize(ResetParameters()).synchronize(BroadcastFromRank0())
            out["mixed"][strategy] = full_state_dict(b.build(model))

            # A divergence planted on the last rank: caught, then fixed by the broadcast.
            def planted() -> DemoTransformer:
                model = real_model(0)
                if rank == world - 1:
                    with torch.no_grad():
                        first = cast(Block, model.blocks[1]).mlp[0]
                        cast(nn.Linear, first).weight[0, 0] += 1.0
                return model

            caught: tuple[str, str] | None = None
            try:
                builder(strategy).materialize(KeepAsIs()).synchronize(VerifyReplicas()).build(
                    planted()
                )
            except Exception as exc:
                caught = _error(exc)
            fixed = (
                builder(strategy)
                .materialize(KeepAsIs())
                .synchronize(BroadcastFromRank0(bucket_bytes=4096), VerifyReplicas())
                .build(planted())
            )
            out["verify"][strategy] = {"caught": caught, "fixed": full_state_dict(fixed)}

        tied = builder("full").materialize(DeterministicInit(SEED)).build(meta_model(TiedDemo))
        tied_initial = full_state_dict(tied)
        train(tied, CFG, 1, rank, world)
        out["tied"] = (tied_initial, full_state_dict(tied))

        for case, source in bad_sources(paths).items():
            model = meta_model()
            try:
                builder("full").materialize(FromStateDict(source if rank == 0 else None)).build(
                    model
                )
                out["bad"][case] = None
            except Exception as exc:
                out["bad"][case] = (*_error(exc), all(p.is_meta for p in model.parameters()))
    return out


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


_RUNS: dict[int, list[dict[str, Any]]] = {}


def _ranks(world: int, files: dict[str, str]) -> list[dict[str, Any]]:
    """The scenarios on ``world`` ranks, run once per module whichever test asks first."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(scenarios, world, files, timeout=240)
    return _RUNS[world]


@pytest.fixture(scope="module", params=[1, 2, 4])
def run(request: pytest.FixtureRequest, files: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    return request.param, _ranks(request.param, files)


@pytest.fixture(scope="module", params=[2, 4])
def multi(
    request: pytest.FixtureRequest, files: dict[str, str]
) -> tuple[int, list[dict[str, Any]]]:
    """Like ``run``, for the checks that need several ranks."""
    return request.param, _ranks(request.param, files)


def expected_initial(name: str) -> dict[str, torch.Tensor]:
    """The single-process result of the same materializer on the same meta model."""
    model = meta_model()
    torch.manual_seed(0)
    if name == "reset":
        ResetParameters().materialize_model(model, wrap=Block)
    elif name == "init_fn":
        InitFn(init_fn).materialize_model(model, wrap=Block)
    elif name == "deterministic":
        DeterministicInit(SEED).materialize_model(model)
    else:
        return source_state()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.equal(got[k], want[k]), (what, k)


def test_gathered_initial_state_equals_single_process_materialization(run: Any) -> None:
    world, ranks = run
    wants = {name: expected_initial(name) for name in MATERIALIZERS}
    for backend, strategy, name in MATRIX[world]:
        got = ranks[0]["matrix"][name, strategy, backend]["initial"]
        assert_same(got, wants[name], (name, strategy, backend))


def test_training_matches_single_process_reference(run: Any) -> None:
    world, ranks = run
    for name in MATERIALIZERS:
        model = DemoTransformer(CFG)
        model.load_state_dict(expected_initial(name))
        ref = reference(model, CFG, STEPS, world)
        for backend in BACKENDS:
            for strategy in STRATEGIES[world]:
                case = (name, strategy, backend)
                for rank in range(world):
                    got = torch.tensor(ranks[rank]["matrix"][case]["losses"])
                    want = torch.tensor(ref["losses"][rank])
                    assert torch.allclose(got, want, atol=1e-5, rtol=0), (case, rank)
                final = ranks[0]["matrix"][case]["final"]
                for k, v in ref["state_dict"].items():
                    assert torch.allclose(final[k], v, atol=1e-5, rtol=0), (case, k)


def test_deterministic_init_is_identical_across_world_sizes(files: dict[str, str]) -> None:
    runs = {w: _ranks(w, files) for w in (1, 2, 4)}
    seen = [
        r[0]["matrix"][name, strategy, backend]["initial"]
        for w, r in runs.items()
        for backend, strategy, name in MATRIX[w]
        if name == "deterministic"
    ]
    assert len(seen) >= 3
    for other in seen[1:]:
        assert_same(other, seen[0], "world-size invariance")


def test_ranks_never_hold_identical_random_shards(multi: Any) -> None:
    world, ranks = multi
    for backend in BACKENDS:
        # The local shards of each parameter (or flat parameter) differ between every pair of
        # ranks wherever they hold random values.
        per_rank = [r["shards", backend] for r in ranks]
        for i in range(len(per_rank[0])):
            if not per_rank[0][i].std() > 0:
                continue  # zeros and ones are the same everywhere by design
            for a in range(world):
                for b in range(a + 1, world):
                    assert not torch.equal(per_rank[a][i], per_rank[b][i]), (backend, i, a, b)
        # And no gathered random weight is one slice repeated (what FSDP2 + meta on CPU gives).
        initial = ranks[0]["matrix"]["deterministic", "full", backend]["initial"]
        for name, weight in initial.items():
            if weight.dim() < 2 or not weight.any():
                continue
            chunks = weight.reshape(-1).chunk(world)
            assert all(not torch.equal(chunks[0], c) for c in chunks[1:]), (backend, name)


def test_per_unit_order_materialize_move_sync_shard(run: Any) -> None:
    world, ranks = run
    units = ["blocks.0", "blocks.1", "<root>"]
    for backend in BACKENDS:
        for rank in range(world):
            events = ranks[rank]["events", backend]
            assert all(e["rank"] == rank and e["world_size"] == world for e in events)
            got = [(e["unit"], e["stage"]) for e in events]
            assert got == [
                (u, s) for u in units for s in ("materialize", "move", "synchronize", "shard")
            ], backend


def test_rank0_real_others_meta_is_filled_by_broadcast(multi: Any) -> None:
    world, ranks = multi
    want = real_model(5).state_dict()
    for rank in range(world):
        for strategy, state in ranks[rank]["mixed"].items():
            assert_same(state, dict(want), (rank, strategy))


def test_verify_replicas_catches_a_planted_divergence_and_broadcast_fixes_it(multi: Any) -> None:
    world, ranks = multi
    want = dict(real_model(0).state_dict())
    strategies = ("full", "hybrid") if world == 4 else ("full",)
    for strategy in strategies:
        messages = {ranks[r]["verify"][strategy]["caught"] for r in range(world)}
        assert len(messages) == 1, messages  # the same error on every rank
        kind, message = messages.pop()
        assert kind == "StateMismatchError"
        assert "'blocks.1.mlp.0.weight'" in message
        assert re.search(rf"rank\(s\) {world - 1} differ from rank\(s\) 0", message)
        for rank in range(world):
            assert_same(ranks[rank]["verify"][strategy]["fixed"], want, (rank, strategy))


def test_tied_weights_stay_tied(multi: Any) -> None:
    _, ranks = multi
    model = meta_model(TiedDemo)
    DeterministicInit(SEED).materialize_model(model)
    initial, trained = ranks[0]["tied"]
    assert torch.equal(initial["head.weight"], model.embed.weight.detach())
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


def test_bad_sources_raise_the_same_clear_error_on_every_rank_before_writing(multi: Any) -> None:
    world, ranks = multi
    for case, pattern in BAD.items():
        seen = {ranks[r]["bad"][case] for r in range(world)}
        assert len(seen) == 1, (case, seen)
        outcome = seen.pop()
        assert outcome is not None, case
        kind, message, untouched = outcome
        assert kind == "ConfigurationError", (case, message)
        assert message.startswith("`FromStateDict` got an invalid `source`"), message
        assert re.search(pattern, message), (case, message)
        assert untouched, case  # no weight was written anywhere
