"""DeferredInit through a build, with a stand-in for torchdistX (which does not install here).

The stand-in keeps torchdistX's contract as DeferredInit uses it: ``deferred_init(fn, *args)``
returns a module whose parameters and buffers are fake (right shape, dtype and device, no
meaningful values: here NaN-filled, so a fake that survives shows up); ``fake.is_fake(t)`` says
which; ``deferred_init.materialize_module(module, check_fn=...)`` walks children first and
replaces the fakes of every module ``check_fn`` accepts by their recorded values, the same tensor
for a fake shared by several modules. torchdistX replays the recorded construction; the stand-in
records the values that construction gave, so the reference is an eager construction under the
same seed.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch
from helpers import full_state_dict, reference
from models import TiedDemo
from torch import nn

from fsdp_builder import (
    CPUDevice,
    DeferredInit,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingBuilder,
)
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer, train

CFG = DemoConfig(vocab=64, dim=32, heads=2, layers=2, seq=8)
STEPS = 2
M = TypeVar("M", bound=nn.Module)


class FakeTorchDistX:
    """The parts of torchdistX that DeferredInit calls, and a log of those calls."""

    def __init__(self) -> None:
        # id(fake) -> (fake, recorded value, materialized tensor once asked for)
        self.recorded: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        # Per materialize_module call: the root it was given and the modules check_fn accepted.
        self.calls: list[tuple[nn.Module, list[nn.Module]]] = []

    # -- torchdistx.deferred_init --------------------------------------------------------------

    def deferred_init(self, module_fn: Callable[..., M], *args: Any, **kwargs: Any) -> M:
        module = module_fn(*args, **kwargs)
        fakes: dict[int, torch.Tensor] = {}
        for m in module.modules():
            owned: list[dict[str, Any]] = [m._parameters, m._buffers]
            for slots in owned:
                for name, real in slots.items():
                    if real is None:
                        continue
                    if id(real) not in fakes:
                        fakes[id(real)] = self._fake_of(real)
                    slots[name] = fakes[id(real)]
        return module

    def _fake_of(self, real: torch.Tensor) -> torch.Tensor:
        filler = float("nan") if real.is_floating_point() else -1
        data = torch.full_like(real, filler)
        fake = nn.Parameter(data, real.requires_grad) if isinstance(real, nn.Parameter) else data
        self.recorded[id(fake)] = (fake, real.detach().clone(), None)
        return fake

    def materialize_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        entry = self.recorded.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return tensor  # real tensors are returned as they are
        fake, value, done = entry
        if done is None:
            done = value.clone()
            if isinstance(fake, nn.Parameter):
                done = nn.Parameter(done, fake.requires_grad)
            self.recorded[id(tensor)] = (fake, value, done)
        return done

    def materialize_module(
        self,
        module: nn.Module,
        buffers_only: bool = False,
        check_fn: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        accepted: list[nn.Module] = []
        self._materialize(module, buffers_only, check_fn, accepted)
        self.calls.append((module, accepted))

    def _materialize(
        self,
        module: nn.Module,
        buffers_only: bool,
        check_fn: Callable[[nn.Module], bool] | None,
        accepted: list[nn.Module],
    ) -> None:
        for child in module.children():
            self._materialize(child, buffers_only, check_fn, accepted)
        if check_fn is None or check_fn(module):
            accepted.append(module)
            slots: list[dict[str, Any]] = [module._buffers]
            if not buffers_only:
                slots.insert(0, module._parameters)
            for tensors in slots:
                for key, tensor in tensors.items():
                    if tensor is not None:
                        tensors[key] = self.materialize_tensor(tensor)

    # -- torchdistx.fake -----------------------------------------------------------------------

    def is_fake(self, tensor: torch.Tensor) -> bool:
        entry = self.recorded.get(id(tensor))
        return entry is not None and entry[0] is tensor

    def pending(self) -> int:
        """Fakes recorded but never materialized."""
        return sum(done is None for _, _, done in self.recorded.values())


@pytest.fixture
def tdx(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchDistX]:
    """The stand-in, importable as ``torchdistx`` for the duration of one test."""
    fake = FakeTorchDistX()
    package = types.ModuleType("torchdistx")
    package.__path__ = []  # a package, so its submodules import
    deferred = types.ModuleType("torchdistx.deferred_init")
    deferred.deferred_init = fake.deferred_init  # type: ignore[attr-defined]
    deferred.materialize_module = fake.materialize_module  # type: ignore[attr-defined]
    deferred.materialize_tensor = fake.materialize_tensor  # type: ignore[attr-defined]
    fake_mod = types.ModuleType("torchdistx.fake")
    fake_mod.is_fake = fake.is_fake  # type: ignore[attr-defined]
    package.deferred_init = deferred  # type: ignore[attr-defined]
    package.fake = fake_mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchdistx", package)
    monkeypatch.setitem(sys.modules, "torchdistx.deferred_init", deferred)
    monkeypatch.setitem(sys.modules, "torchdistx.fake", fake_mod)
    yield fake


def _builder(backend: str) -> ShardingBuilder:
    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    return kind().device(CPUDevice()).wrap(Block).materialize(DeferredInit())


def _eager(cls: type[DemoTransformer] = DemoTransformer, seed: int = 0) -> DemoTransformer:
    torch.manual_seed(seed)
    return cls(CFG)


def _deferred(
    tdx: FakeTorchDistX, cls: type[DemoTransformer] = DemoTransformer, seed: int = 0
) -> DemoTransformer:
    torch.manual_seed(seed)
    return tdx.deferred_init(cls, CFG)


def _state_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_the_stand_in_defers_and_replays_construction(tdx: FakeTorchDistX) -> None:
    model, eager = _deferred(tdx), _eager()
    assert all(tdx.is_fake(p) and p.isnan().all() for p in model.parameters())
    assert not any(tdx.is_fake(p) for p in eager.parameters())
    tdx.materialize_module(model)
    assert tdx.pending() == 0
    got, want = model.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_a_deferred_model_builds_and_trains_like_eager_construction(
    world1: None, tdx: FakeTorchDistX, backend: str
) -> None:
    model = _deferred(tdx)
    names = {id(m): name for name, m in model.named_modules()}
    builder = _builder(backend)
    sharded = builder.build(model)

    # Every fake was replaced, and the weights are those of eager construction.
    assert tdx.pending() == 0
    eager = _eager()
    state, want = full_state_dict(sharded), eager.state_dict()
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value), key

    # One materialize_module per unit, bottom-up; each accepts exactly its unit's own modules
    # (not the already-sharded blocks below the root), so every module is materialized once.
    got = [
        (names[id(root)], sorted(names[id(m)] for m in accepted)) for root, accepted in tdx.calls
    ]
    blocks = [f"blocks.{i}" for i in range(CFG.layers)]
    own = {
        unit: sorted(n for n in names.values() if n == unit or n.startswith(unit + "."))
        for unit in blocks
    }
    own[""] = sorted(
        n for n in names.values() if not any(n == b or n.startswith(b + ".") for b in blocks)
    )
    assert got == [(unit, own[unit]) for unit in [*blocks, ""]]

    # The report counts the bytes the unit materialized.
    materialized = sum(r.bytes for r in builder.report.records if r.stage == "materialize")
    assert materialized == _state_bytes(eager)

    ref = reference(_eager(), CFG, STEPS, 1)
    losses = train(sharded, CFG, STEPS, 0, 1)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref["losses"][0]), atol=1e-5, rtol=0)
    final = full_state_dict(sharded)
    for key, value in ref["state_dict"].items():
        assert torch.allclose(final[key], value, atol=1e-5, rtol=0), key


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_tied_fakes_become_one_tied_parameter(
    world1: None, tdx: FakeTorchDistX, backend: str
) -> None:
    model = _deferred(tdx, TiedDemo)
    assert model.head.weight is model.embed.weight
    sharded = _builder(backend).build(model)
    assert tdx.pending() == 0
    state = full_state_dict(sharded)
    want = _eager(TiedDemo).state_dict()
    assert torch.equal(state["embed.weight"], want["embed.weight"])
    assert torch.equal(state["head.weight"], state["embed.weight"])
    train(sharded, CFG, 1, 0, 1)
    trained = full_state_dict(sharded)
    assert torch.equal(trained["head.weight"], trained["embed.weight"])
    assert not torch.equal(trained["embed.weight"], want["embed.weight"])


def test_a_model_without_fakes_is_left_as_it_is(world1: None, tdx: FakeTorchDistX) -> None:
    model = _eager(seed=3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    builder = _builder("fsdp2")
    state = full_state_dict(builder.build(model))
    assert tdx.calls == []  # nothing fake: torchdistX is not asked to do anything
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert sum(r.bytes for r in builder.report.records if r.stage == "materialize") == 0
