"""Materializers on one process, no process group: configuration, errors, values, ties."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from models import TiedDemo
from torch import nn

from fsdp_builder import (
    ConfigurationError,
    DeferredInit,
    DeterministicInit,
    FSDPBuilder,
    InitFn,
    MaterializationError,
    PlanError,
    ResetParameters,
    StreamInit,
)
from fsdp_builder.materializers.initializers import derived_seed
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer

CFG = DemoConfig(vocab=64, dim=32, heads=2, layers=2, seq=8)
M = TypeVar("M", bound=nn.Module)


def on_meta(factory: Callable[..., M], *args: object, **kwargs: object) -> M:
    with torch.device("meta"):
        return factory(*args, **kwargs)


def states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))

    def reset_parameters(self) -> None:
        raise RuntimeError("boom")


class TwoStrangers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = NoInit()
        self.inner = nn.Sequential(nn.Linear(2, 2), NoInit())


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [None, 3, "reset_parameters"])
def test_init_fn_must_be_callable(fn: object) -> None:
    with pytest.raises(ConfigurationError, match=r"`InitFn` got an invalid `fn`: expected a call"):
        InitFn(fn)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 1.5, True, 2**63])
def test_deterministic_seed_is_validated(seed: object) -> None:
    with pytest.raises(ConfigurationError, match=r"`DeterministicInit` got an invalid `seed`"):
        DeterministicInit(seed)  # type: ignore[arg-type]


def test_deferred_init_without_torchdistx_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchdistx made unimportable, whether or not it is installed (None in sys.modules stops
    # an import); with it importable, DeferredInit is built and used in test_deferred_init.py.
    monkeypatch.setitem(sys.modules, "torchdistx", None)
    monkeypatch.setitem(sys.modules, "torchdistx.deferred_init", None)
    with pytest.raises(ConfigurationError, match=r"`DeferredInit`.*torchdistx") as info:
        DeferredInit()
    assert "ResetParameters() or DeterministicInit(seed)" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


# -- ResetParameters ----------------------------------------------------------------------------


def test_modules_without_an_initializer_are_named_together() -> None:
    model = on_meta(TwoStrangers)
    with pytest.raises(MaterializationError, match=r"no initializer") as info:
        ResetParameters().materialize_model(model)
    assert "first (NoInit)" in str(info.value)
    assert "inner.1 (NoInit)" in str(info.value)
    assert "register_initializer(TheirClass, fn)" in str(info.value)
    assert "inner.0" not in str(info.value)


@pytest.mark.parametrize("name", ["ResetParameters", "ShardFirstReset", "StreamInit"])
def test_the_refusal_names_the_materializer_that_was_given(name: str) -> None:
    import fsdp_builder
    model = on_meta(TwoStrangers)
    with pytest.raises(
        MaterializationError, match=rf"^`{name}` cannot initialize .*first \(NoInit\)"
    ):
        getattr(fsdp_builder, name)().materialize_model(model)
    assert all(p.is_meta for p in model.parameters())  # refused before anything changed


def test_a_failing_initializer_names_the_module_and_its_type() -> None:
    model = on_meta(lambda: nn.Sequential(nn.Linear(2, 2), Broken()))
    with pytest.raises(MaterializationError, match=r"'1' \(Broken\).*RuntimeError: boom"):
        ResetParameters().materialize_model(model)


def test_real_modules_are_left_as_they_are() -> None:
    model = TwoStrangers()  # real: nothing to initialize, so no initializer is needed
    before = states(model)
    ResetParameters().materialize_model(model)
    after = states(model)
    # Bit for bit: NoInit's torch.empty may hold NaN patterns, which torch.equal calls unequal.
    assert all(
        torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before
    )


def test_multihead_attention_private_initializer_runs_and_parent_wins() -> None:
    model = on_meta(nn.MultiheadAttention, 16, 2)
    ResetParameters().materialize_model(model)
    assert torch.equal(model.out_proj.bias, torch.zeros(16))  # set by the parent's initializer
    assert torch.equal(model.in_proj_bias, torch.zeros(48))
    assert model.in_proj_weight.abs().max() <= math.sqrt(6 / (16 + 48)) + 1e-6


def _check_like_construction(meta_built: nn.Module, reference: nn.Module) -> None:
    for (name, got), (_, want) in zip(
        meta_built.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.isfinite(got).all(), name
        if not want.std() > 0:
            assert torch.equal(got, want), name  # constants: zeros and ones
            continue
        # Sampling noise shrinks with size; a wrong init (Kaiming instead of Xavier: ~30%) or
        # uninitialized memory does not.
        tolerance = 0.05 + 4 / math.sqrt(got.numel())
        assert abs(float(got.std()) / float(want.std()) - 1) < tolerance, name
        assert abs(float(got.abs().max()) / float(want.abs().max()) - 1) < tolerance, name
        assert abs(float(got.mean())) < 3 * float(want.std()) / math.sqrt(got.numel()) + 1e-3, name


@pytest.mark.parametrize("materializer", [ResetParameters(), DeterministicInit(3)])
def test_transformer_on_meta_matches_construction(materializer: ResetParameters) -> None:
    kwargs: dict[str, Any] = {
        "d_model": 64,
        "nhead": 4,
        "num_encoder_layers": 2,
        "num_decoder_layers": 1,
        "dim_feedforward": 128,
        "batch_first": True,
    }
    model = on_meta(nn.Transformer, **kwargs)
    # ResetParameters draws from the global generator: seeded, the sampled values (and so this
    # statistical check) do not depend on which tests ran before.
    torch.manual_seed(1)
    materializer.materialize_model(model)
    torch.manual_seed(0)
    _check_like_construction(model, nn.Transformer(**kwargs))


@pytest.mark.parametrize("materializer", [ResetParameters(), DeterministicInit(3)])
def test_encoder_layer_on_meta_matches_construction(materializer: ResetParameters) -> None:
    model = on_meta(nn.TransformerEncoderLayer, 64, 4, 256, batch_first=True)
    torch.manual_seed(1)  # as above
    materializer.materialize_model(model)
    torch.manual_seed(0)
    _check_like_construction(model, nn.TransformerEncoderLayer(64, 4, 256, batch_first=True))


# -- DeterministicInit --------------------------------------------------------------------------


def test_deterministic_init_does_not_depend_on_units_order_or_ambient_rng() -> None:
    whole, per_block = on_meta(DemoTransformer, CFG), on_meta(DemoTransformer, CFG)
    torch.manual_seed(1)
    DeterministicInit(5).materialize_model(whole)
    torch.manual_seed(2)
    DeterministicInit(5).materialize_model(per_block, wrap=Block)
    a, b = states(whole), states(per_block)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = on_meta(DemoTransformer, CFG)
    DeterministicInit(6).materialize_model(other)
    assert not torch.equal(states(other)["head.weight"], a["head.weight"])


def test_deterministic_init_reinitializes_real_weights_and_keeps_rng_untouched() -> None:
    real, meta = DemoTransformer(CFG), on_meta(DemoTransformer, CFG)
    torch.manual_seed(11)
    DeterministicInit(5).materialize_model(real)
    drawn = torch.rand(3)
    torch.manual_seed(11)
    DeterministicInit(5).materialize_model(meta)
    assert torch.equal(torch.rand(3), drawn)  # the caller's RNG stream is not consumed
    a, b = states(real), states(meta)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_derived_seeds_differ_by_name_and_seed() -> None:
    seeds = {derived_seed(s, n) for s in (0, 1) for n in ("a", "b", "blocks.0.attn")}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)


# -- InitFn -----------------------------------------------------------------------------------


def test_init_fn_sees_allocated_storage_children_first() -> None:
    seen: list[str] = []

    def fn(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            assert not p.is_meta
            p.fill_(1.0)

    model = on_meta(lambda: nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.LayerNorm(2))))
    InitFn(fn, allocate=True).materialize_model(model)
    assert seen == ["LayerNorm", "Sequential", "Linear", "Sequential"]  # reversed breadth-first
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


# -- ties ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("materializer", [ResetParameters(), DeterministicInit(0)])
def test_tied_parameters_stay_tied(materializer: ResetParameters) -> None:
    model = on_meta(TiedDemo, CFG)
    materializer.materialize_model(model, wrap=Block)
    assert model.head.weight is model.embed.weight
    assert not model.head.weight.is_meta
    pair = on_meta(TiedPair)
    materializer.materialize_model(pair)
    assert pair.a.weight is pair.b.weight


def test_tied_weights_split_across_units_are_refused_with_their_names() -> None:
    with pytest.raises(PlanError, match=r"'a\.weight' \(unit 'a'\) and 'b\.weight' \(unit 'b'\)"):
        FSDPBuilder().wrap(nn.Linear).plan_for(on_meta(TiedPair))


class WithMask(nn.Module):
    """A buffer filled in __init__ that no initializer writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((64,), 7.0))
        self.scale = nn.Parameter(torch.ones(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)


def test_reinitializing_a_real_model_keeps_buffers_its_initializers_do_not_write() -> None:
    model = WithMask()
    DeterministicInit(seed=0).materialize_model(model)
    mask = model.get_buffer("mask")
    assert torch.equal(mask, torch.full((64,), 7.0))


def test_a_real_ignored_parameter_in_a_meta_module_keeps_its_value(world1: None) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    frozen = nn.Parameter(torch.full((4, 4), 3.0), requires_grad=False)
    model[0].weight = frozen
    sharded = FSDPBuilder().device("cpu").ignore(states=[frozen]).build(model)
    assert model[0].weight is frozen  # the wrapper left the ignored parameter in place
    assert torch.equal(frozen, torch.full((4, 4), 3.0))
    assert not any(p.is_meta for p in sharded.parameters())


def test_the_suggested_fix_for_a_module_without_an_initializer_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp_builder import register_initializer
    from fsdp_builder.materializers import conventions

    monkeypatch.setattr(conventions, "_REGISTERED", dict(conventions._REGISTERED))
    monkeypatch.setattr(conventions, "_REGISTERED_BY_TYPE", {})
    register_initializer(NoInit, lambda m: nn.init.constant_(m.get_parameter("w"), 0.5))
    model = ResetParameters().materialize_model(on_meta(TwoStrangers))
    assert all(
        torch.equal(m.w, torch.full((3,), 0.5)) for m in model.modules() if isinstance(m, NoInit)
    )
    with pytest.raises(ConfigurationError, match=r"register_initializer.*`module_class`"):
        register_initializer(NoInit.__init__, lambda m: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("fails", [False, True])
def test_stream_init_build_leaves_torch_as_it_found_it(world1: None, fails: bool) -> None:
    """StreamInit answers torch.nn.init from its streams and seeds torch's generator for the
    whole build: after it, built or failed, both are the caller's again (an eager draw after
    the build continues the caller's stream, and nn.init is torch's own)."""
    from fsdp_builder import CPUDevice, FullyShardBuilder

    originals = {name: getattr(nn.init, name) for name in ("normal_", "uniform_", "zeros_")}
    model = on_meta(DemoTransformer, CFG)
    if fails:  # the last unit (the root) fails after the blocks were initialized
        model.head.reset_parameters = _raise  # type: ignore[method-assign]
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    builder.materialize(StreamInit(seed=3))
    with pytest.warns(UserWarning, match="NO_SHARD"):
        if fails:
            with pytest.raises(Exception, match="head is broken"):
                builder.build(model)
        else:
            builder.build(model)
    assert torch.equal(torch.rand(3), expected)
    assert all(getattr(nn.init, name) is fn for name, fn in originals.items())


def _raise() -> None:
    raise RuntimeError("head is broken")


class _OwnParameter(nn.Parameter):
    """A Parameter subclass (as quantization libraries define)."""


class _Mixed(nn.Module):
    # Plain parameters, a channels-last weight, a meta buffer next to a real one, a tied slot
    # and a Parameter subclass: what a unit's allocation must give storage like to_empty.
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv.weight = nn.Parameter(self.conv.weight.to(memory_format=torch.channels_last))
        self.norm = nn.BatchNorm1d(3)
        self.tied = nn.Linear(4, 3, bias=False)
        self.tied.weight = self.linear.weight
        self.odd = nn.Module()
        self.odd.register_parameter("w", _OwnParameter(torch.empty(2, 2)))
        self.frozen = nn.Linear(2, 2)
        self.frozen.weight.requires_grad_(False)


def test_allocation_gives_meta_states_what_to_empty_gives() -> None:
    """``allocate_empty`` makes each meta state directly instead of through ``to_empty``: the
    same shapes, strides, dtypes, devices, types and ``requires_grad`` as plain ``to_empty``,
    real buffers keep their values, tied slots stay tied, and it counts the bytes it gave."""
    from fsdp_builder.runtime.tree import allocate_empty, unit_modules

    with torch.device("meta"):
        model, reference = _Mixed(), _Mixed()
    real = torch.arange(3.0)
    for m in (model, reference):
        m.norm.register_buffer("running_mean", real.clone())
    allocated = allocate_empty(unit_modules(model, ()), torch.device("cpu"))
    for module in reference.modules():
        module.to_empty(device="cpu", recurse=False)
    reference.tied.weight = reference.linear.weight
    ours: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    theirs: dict[str, torch.Tensor] = dict(reference.named_parameters(remove_duplicate=False))
    ours.update(model.named_buffers())
    theirs.update(reference.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        ref = theirs[name]
        assert not t.is_meta, name
        assert (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad) == (
            type(ref),
            ref.shape,
            ref.stride(),
            ref.dtype,
            ref.device,
            ref.requires_grad,
        ), name
    assert model.conv.weight.stride() != model.conv.weight.contiguous().stride()
    assert model.norm.running_mean is not None and torch.equal(model.norm.running_mean, real)
    assert model.tied.weight is model.linear.weight
    assert allocated == sum(
        t.numel() * t.element_size()
        for t in [*model.parameters(), *model.buffers()]
        if t is not model.norm.running_mean
    )


def test_local_bytes_counts_each_fake_storage() -> None:
    """Fake tensors (a dry run's) all sit at address 0 yet each has its size: every one counts,
    and a tied parameter still counts once (the sizes from plain torch)."""
    from helpers import local_bytes
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
        model[1].weight = model[0].weight
    expected = sum(p.untyped_storage().nbytes() for p in model.parameters())  # each once
    assert expected == 4 * (100 + 10 + 10)
    assert local_bytes(model) == expected
