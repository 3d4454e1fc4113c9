"""PyTorch's own FSDP init patterns, each run with plain torch and with the builder side by side.

Ported from PyTorch's tests (``test_fsdp_ignored_modules.py``, ``test_hsdp_sync_module_states``
in ``test_fsdp_hybrid_shard.py``, ``test_fsdp_meta.py``, the sync cases of ``test_fsdp_misc.py``,
``test_fully_shard_init.py``): every program here is correct, so the builder must give what
plain PyTorch gives, never a refusal; the few true positives must be refused on every rank with
an error that says why. One spawn of 2 ranks runs every scenario (see ``isolated``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_builder import (
    BroadcastFromRank0,
    CPUDevice,
    FSDPBuilder,
    FullyShardBuilder,
    InitFn,
    NoSync,
    ResetParameters,
)

CPU = torch.device("cpu")
REPEATS = 20


class Model(nn.Module):
    """The model of PyTorch's ``test_fsdp_ignored_modules.py``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(3, 5)
        self.layer1 = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        self.layer2 = nn.Linear(4, 2)
        self.layer3 = nn.Linear(2, 2)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.relu(self.layer0(x))
        z = self.relu(self.layer1(z))
        z = self.relu(self.layer2(z))
        return self.relu(self.layer3(z))


class IgnoredModule(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn((in_dim, out_dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class ModelWithIgnoredModules(Model):
    """``num_ignored`` extra modules in ``layer1``: upstream gives each rank a different number."""

    def __init__(self, num_ignored: int) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Linear(5, 4),
            nn.Linear(4, 4),
            *[IgnoredModule(4, 4) for _ in range(num_ignored)],
            nn.Linear(4, 4),
        )


def train(model: nn.Module, steps: int = 3) -> list[float]:
    """Losses of a few SGD steps on inputs every rank draws alike."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 3, generator=gen)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def ours(use_orig_params: bool = False) -> FSDPBuilder:
    return FSDPBuilder().device(CPUDevice()).use_orig_params(use_orig_params)


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """The value, or the error's type and message (what a refusal test reads)."""
    try:
        return {"value": fn()}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}


# -- test_fsdp_ignored_modules.py -----------------------------------------------------------------


def _ignored(model: Model, kind: str) -> dict[str, Any]:
    if kind == "modules":
        return {"modules": [model.layer1]}
    params = list(model.layer1.parameters())
    # A set iterates in id order, which differs across ranks: the build must not care.
    return {"states": set(params) if kind == "states_set" else params}


def ignored_nested(use_orig_params: bool, kind: str) -> dict[str, Any]:
    """``layer1[1]`` sharded on its own, then the root with ``layer1`` ignored; with
    ``use_orig_params=True`` the ignored parameters of ``layer1[1]`` are views of each rank's
    own shard, so their sizes differ across ranks."""
    torch.manual_seed(0)
    plain = Model()
    plain.layer1[1] = FSDP(plain.layer1[1], use_orig_params=use_orig_params, device_id=CPU)
    torch_kw = _ignored(plain, kind)
    plain_kw = (
        {"ignored_modules": torch_kw["modules"]}
        if kind == "modules"
        else {"ignored_states": torch_kw["states"]}
    )
    plain_root = FSDP(plain, use_orig_params=use_orig_params, device_id=CPU, **plain_kw)

    torch.manual_seed(0)
    model = Model()
    model.layer1[1] = ours(use_orig_params=use_orig_params).build(model.layer1[1])
    root = ours(use_orig_params=use_orig_params).ignore(**_ignored(model, kind)).build(model)
    return {"plain": train(plain_root), "ours": train(root)}


def diff_ignored_across_ranks(kind: str) -> dict[str, Any]:
    """Upstream ``test_diff_ignored_modules_across_ranks``: rank r ignores r + 1 modules, so the
    last layer is ``layer1.3`` on rank 0 and ``layer1.4`` on rank 1. Plain FSDP1 only needs the
    shapes to line up; the builder refuses, before anything changes, because the same state has
    a different name on each rank: a sharded checkpoint would store its shards under two keys."""

    def make() -> ModelWithIgnoredModules:
        torch.manual_seed(0)
        return ModelWithIgnoredModules(num_ignored=dist.get_rank() + 1)

    def extra(model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, IgnoredModule)]

    def plain_kw(mods: list[nn.Module]) -> dict[str, Any]:
        if kind == "modules":
            return {"ignored_modules": mods}
        return {"ignored_states": [p for m in mods for p in m.parameters()]}

    def our_kw(mods: list[nn.Module]) -> dict[str, Any]:
        if kind == "modules":
            return {"modules": mods}
        return {"states": [p for m in mods for p in m.parameters()]}

    plain: Any = make()
    plain.layer1 = FSDP(plain.layer1, device_id=CPU, **plain_kw(extra(plain.layer1)))
    plain.layer3 = FSDP(plain.layer3, device_id=CPU)
    plain_root = FSDP(plain, device_id=CPU, **plain_kw(extra(plain)))

    model = make()
    refused = outcome(lambda: ours().ignore(**our_kw(extra(model.layer1))).build(model.layer1))
    return {
        "plain": train(plain_root),
        "ours": refused,
        "untouched": not any(isinstance(m, FSDP) for m in model.modules()),
    }


# -- test_hsdp_sync_module_states: to_empty on ranks != 0, values from rank 0 ---------------------


def _rank0_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Model().state_dict().items()}


def _to_empty(module: nn.Module) -> None:
    module.to_empty(device=CPU, recurse=False)


def _rank0_real_others_meta() -> Model:
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        return Model()
    with torch.device("meta"):
        return Model()


def sync_from_rank0(deterministic: bool) -> dict[str, Any]:
    """FSDP1's ``param_init_fn`` = ``to_empty`` on ranks other than 0 (fresh memory that may
    hold NaN, always does under deterministic algorithms), values from rank 0 by
    ``sync_module_states``; built ``REPEATS`` times. Plain FSDP1 refuses
    ``sync_module_states`` on CPU; what it gives on GPU is rank 0's model everywhere."""
    want = _rank0_reference()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        plain = outcome(
            lambda: FSDP(
                _rank0_real_others_meta(),
                param_init_fn=_to_empty,
                sync_module_states=True,
                device_id=CPU,
            )
        )
        refusals: list[str] = []
        same = 0
        for _ in range(REPEATS):
            builder = ours().materialize(InitFn(_to_empty)).synchronize(BroadcastFromRank0())
            try:
                got = full_state_dict(builder.build(_rank0_real_others_meta()))
            except Exception as exc:
                refusals.append(f"{type(exc).__name__}: {exc}")
                continue
            same += got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        torch.use_deterministic_algorithms(before)
    return {"plain": plain.get("type"), "refusals": refusals, "same": same}


def forgotten(allocate: bool, synchronizer: str) -> dict[str, Any]:
    """The true positive: ``fn`` gives storage but never writes it (every rank, no synchronizer),
    or only rank 0 forgets while rank 0's values are broadcast to all."""
    with torch.device("meta"):
        model = Model()

    def fn(module: nn.Module) -> None:
        if not allocate:
            module.to_empty(device=CPU, recurse=False)

    sync = BroadcastFromRank0() if synchronizer == "broadcast" else NoSync()
    if synchronizer == "broadcast" and dist.get_rank() != 0:
        torch.manual_seed(0)
        model = Model()  # real everywhere but on rank 0
    builder = ours().materialize(InitFn(fn, allocate=allocate)).synchronize(sync)
    return outcome(lambda: builder.build(model))


# -- test_fsdp_meta.py ----------------------------------------------------------------------------


def _init_fn(module: nn.Module) -> None:
    """The ``param_init_fn`` of upstream's meta tests."""
    if any(t.is_meta for t in module.parameters(recurse=False)):
        module.to_empty(device=CPU, recurse=False)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def meta_init(how: str, wrap: bool) -> dict[str, Any]:
    """A model built on meta, materialized by ``param_init_fn`` (``how="init_fn"``) or by each
    module's ``reset_parameters`` (FSDP1's default for meta modules), with and without nested
    units; every rank seeds alike."""

    def meta() -> Model:
        with torch.device("meta"):
            return Model()

    policy = ModuleWrapPolicy({nn.Linear}) if wrap else None
    torch.manual_seed(42)
    fn = _init_fn if how == "init_fn" else None
    plain = FSDP(meta(), param_init_fn=fn, auto_wrap_policy=policy, device_id=CPU)
    plain_sd = full_state_dict(plain)
    torch.manual_seed(42)
    builder = ours().materialize(InitFn(_init_fn) if how == "init_fn" else ResetParameters())
    if wrap:
        builder = builder.wrap(nn.Linear)
    mine = builder.build(meta())
    mine_sd = full_state_dict(mine)
    return {
        "same": plain_sd.keys() == mine_sd.keys()
        and all(torch.equal(plain_sd[k], mine_sd[k]) for k in plain_sd),
        "plain": train(plain),
        "ours": train(mine),
    }


# -- test_fsdp_misc.py: sync_module_states --------------------------------------------------------


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def sync_buffers() -> dict[str, Any]:
    """Every rank built different values, buffers included; ``sync_module_states`` (plain FSDP1
    on GPU; refused on CPU) gives every rank rank 0's."""
    torch.manual_seed(0)
    want = {k: v.clone() for k, v in WithBuffers().state_dict().items()}

    def make() -> WithBuffers:
        torch.manual_seed(dist.get_rank())
        model = WithBuffers()
        nn.init.constant_(model.norm.running_mean, float(dist.get_rank()))  # type: ignore[arg-type]
        return model

    plain = outcome(lambda: FSDP(make(), sync_module_states=True, device_id=CPU))
    got = full_state_dict(ours().synchronize(BroadcastFromRank0()).build(make()))
    return {
        "plain": plain.get("type"),
        "same": got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want),
    }


def different_models() -> dict[str, Any]:
    """Ranks built models of different shapes: plain FSDP1's sync would fail in a collective
    (or hang); the builder refuses before any collective, naming the state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4 + dist.get_rank()))
    return outcome(lambda: ours().synchronize(BroadcastFromRank0()).build(model))


# -- test_fully_shard_init.py ---------------------------------------------------------------------


def fully_shard_real() -> dict[str, Any]:
    """``fully_shard`` on each ``nn.Linear`` then the root, from a model every rank builds alike."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain = Model()
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(plain)
    plain_sd = full_state_dict(plain)
    torch.manual_seed(0)
    mine = FullyShardBuilder().device(CPUDevice()).wrap(nn.Linear).build(Model())
    mine_sd = full_state_dict(mine)
    return {
        "same": plain_sd.keys() == mine_sd.keys()
        and all(torch.equal(plain_sd[k], mine_sd[k]) for k in plain_sd),
        "plain": train(plain),
        "ours": train(mine),
    }


def fully_shard_meta() -> dict[str, Any]:
    """Upstream's meta-device init: ``fully_shard`` on meta, ``to_empty``, then each module's
    ``reset_parameters()`` on its local shard. The builder must give the same layout (global
    shapes, placements, local shapes, devices); its values are those of the unsharded model
    initialized with the same seed, where plain torch on CPU draws each rank's shard from the
    same random stream."""
    from torch.distributed.fsdp import fully_shard

    def meta() -> Model:
        with torch.device("meta"):
            return Model()

    def layout(model: nn.Module) -> dict[str, Any]:
        params: dict[str, Any] = dict(model.named_parameters())  # DTensors
        return {
            n: (tuple(p.shape), str(p.placements), tuple(p.to_local().shape), p.device.type)
            for n, p in params.items()
        }

    plain = meta()
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(plain)
    plain.to_empty(device=CPU)
    torch.manual_seed(0)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    torch.manual_seed(0)
    builder = FullyShardBuilder().device(CPUDevice()).wrap(nn.Linear)
    mine = builder.materialize(ResetParameters()).build(meta())
    # The unsharded model in plain PyTorch: to_empty, then each Linear's reset_parameters() in
    # module order (each Linear is a unit, the units bottom-up) from the same seed.
    unsharded = meta()
    unsharded.to_empty(device=CPU)
    torch.manual_seed(0)
    for m in unsharded.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    reference = unsharded.state_dict()
    got = full_state_dict(mine)
    return {
        "same_layout": layout(plain) == layout(mine),
        "like_unsharded": got.keys() == reference.keys()
        and all(torch.equal(got[k], reference[k]) for k in reference),
        "losses": train(mine),
    }


# -- one spawn ------------------------------------------------------------------------------------

# Without nested units FSDP1 resets a unit's modules parents first, ResetParameters children
# first (so that a parent's initializer wins, as at construction): their RNG draws differ, and
# FSDP1's order is InitFn's (the "init_fn" cases).
META = [("init_fn", False), ("init_fn", True), ("reset", True)]
NESTED = [(u, k) for u in (False, True) for k in ("states_list", "states_set", "modules")]


def cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for use_orig_params, kind in NESTED:
        yield (
            ("nested", use_orig_params, kind),
            functools.partial(ignored_nested, use_orig_params, kind),
        )
    for kind in ("modules", "states"):
        yield ("diff_ignored", kind), functools.partial(diff_ignored_across_ranks, kind)
    for deterministic in (False, True):
        yield ("sync", deterministic), functools.partial(sync_from_rank0, deterministic)
    for allocate in (False, True):
        for synchronizer in ("none", "broadcast"):
            yield (
                ("forgotten", allocate, synchronizer),
                functools.partial(forgotten, allocate, synchronizer),
            )
    for how, wrap in META:
        yield ("meta", how, wrap), functools.partial(meta_init, how, wrap)
    yield "sync_buffers", sync_buffers
    yield "different_models", different_models
    yield "fully_shard_real", fully_shard_real
    yield "fully_shard_meta", fully_shard_meta


def scenarios() -> Results:
    return run_each(cases())


SPAWNS = Spawns(scenarios, timeout=300)


def scenario(key: Hashable) -> list[Any]:
    return values(SPAWNS(2), key)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("use_orig_params", "kind"), NESTED)
def test_nested_wrapper_under_ignored_states_builds_as_plain_fsdp(
    use_orig_params: bool, kind: str
) -> None:
    for rank in scenario(("nested", use_orig_params, kind)):
        assert rank["ours"] == rank["plain"], rank


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["modules", "states"])
def test_ranks_that_name_a_state_differently_are_refused(kind: str) -> None:
    for rank in scenario(("diff_ignored", kind)):
        assert len(rank["plain"]) == 3  # plain FSDP1 trains
        assert rank["ours"]["type"] == "RankDisagreementError", rank
        assert (
            "rank 0 has 3.weight, 3.bias that rank 1 does not and rank 1 has 4.weight, 4.bias "
            "that rank 0 does not" in rank["ours"]["message"]
        ), rank
        assert rank["untouched"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("deterministic", [False, True])
def test_to_empty_then_sync_from_rank0_is_never_refused(deterministic: bool) -> None:
    for rank in scenario(("sync", deterministic)):
        assert rank["refusals"] == [], rank["refusals"][:1]
        assert rank["same"] == REPEATS
        # What plain FSDP1 says on CPU; on GPU it gives rank 0's model, as the builder does.
        assert rank["plain"] == "ValueError"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("allocate", [False, True])
def test_storage_never_written_is_refused_on_every_rank(allocate: bool) -> None:
    ranks = scenario(("forgotten", allocate, "none"))
    for rank in ranks:
        assert rank["type"] == "MaterializationError", rank
        assert "given storage but never written: layer0.weight" in rank["message"]
    # Only rank 0's values survive a broadcast from rank 0: its forgotten states are refused,
    # on every rank.
    ranks = scenario(("forgotten", allocate, "broadcast"))
    for rank in ranks:
        assert rank["type"] == "RankDisagreementError", rank
        assert "rank 0: MaterializationError" in rank["message"]
        assert "never written: layer0.weight" in rank["message"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("how", "wrap"), META)
def test_meta_init_gives_plain_fsdp_weights(how: str, wrap: bool) -> None:
    for rank in scenario(("meta", how, wrap)):
        assert rank["same"] and rank["ours"] == rank["plain"], rank


@pytest.mark.timeout(400)
def test_sync_covers_buffers() -> None:
    for rank in scenario("sync_buffers"):
        assert rank == {"plain": "ValueError", "same": True}


@pytest.mark.timeout(400)
def test_different_models_are_refused_before_any_collective() -> None:
    for rank in scenario("different_models"):
        assert rank["type"] == "RankDisagreementError", rank
        assert "0.weight [5, 3]" in rank["message"] and "0.weight [4, 3]" in rank["message"]


@pytest.mark.timeout(400)
def test_fully_shard_from_a_real_model_matches_plain() -> None:
    for rank in scenario("fully_shard_real"):
        assert rank["same"] and rank["ours"] == rank["plain"], rank


@pytest.mark.timeout(400)
def test_fully_shard_on_meta_gives_the_plain_layout_and_unsharded_values() -> None:
    for rank in scenario("fully_shard_meta"):
        assert rank["same_layout"] and rank["like_unsharded"], rank
        assert len(rank["losses"]) == 3
