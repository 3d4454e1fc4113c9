"""Init fidelity against code we did not write: FSDP1's ``param_init_fn`` patterns of PyTorch's
test_fsdp_meta.py, ``nn.Transformer``'s constructor, and storage that nobody wrote."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_builder import (
    CPUDevice,
    DeterministicInit,
    FSDPBuilder,
    FullyShardBuilder,
    InitFn,
    MaterializationError,
    ResetParameters,
    ShardFirstReset,
)

CPU = torch.device("cpu")


# -- a model in the style of PyTorch's test_fsdp_meta.py: every module has reset_parameters ----


class MyLinear(nn.Linear):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, 0.5)
            if self.bias is not None:
                self.bias.uniform_(-0.1, 0.1)


class MyBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.empty(3, 3))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.get_buffer("buf").normal_()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = MyLinear(4, 4, bias=False)
        self.lin2 = MyLinear(4, 4)
        self.buf_mod = MyBuffer()

    def reset_parameters(self) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x))) + self.buf_mod.get_buffer("buf").sum()


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = MyLinear(4, 2)
        self.scale = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * self.scale
        return self.head(x)


def _meta_states(module: nn.Module) -> bool:
    return any(
        t.is_meta
        for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
    )


def init_with_guard(module: nn.Module) -> None:
    """test_fsdp_meta.py's ``_init_with_reset_params``: only modules still on meta."""
    if _meta_states(module):
        module.to_empty(device=CPU, recurse=False)
        module.reset_parameters()  # type: ignore[operator]


def init_without_guard(module: nn.Module) -> None:
    """``to_empty(recurse=False)`` + ``reset_parameters()`` on every module, unconditionally."""
    module.to_empty(device=CPU, recurse=False)
    module.reset_parameters()  # type: ignore[operator]


PATTERNS: dict[str, Callable[[nn.Module], None]] = {
    "guard": init_with_guard,
    "no_guard": init_without_guard,
}


def _meta_model() -> MyModel:
    with torch.device("meta"):
        model = MyModel()
    # ModuleList has no reset_parameters; give it one, as test_fsdp_meta's models do.
    model.blocks.reset_parameters = lambda: None  # type: ignore[assignment]
    return model


def _parity(pattern: str) -> dict[str, Any]:
    """Both ways on this rank: FSDP1's own param_init_fn path, and the builder."""
    fn = PATTERNS[pattern]
    torch.manual_seed(11)
    by_hand = FullyShardedDataParallel(
        _meta_model(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        param_init_fn=fn,
        device_id=CPU,
    )
    expected = full_state_dict(by_hand)
    torch.manual_seed(11)
    built = FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(InitFn(fn))
    got = full_state_dict(built.build(_meta_model()))
    return {"expected": expected, "got": got}


def _parity_all() -> Results:
    return run_each((pattern, functools.partial(_parity, pattern)) for pattern in sorted(PATTERNS))


PARITY = Spawns(_parity_all, timeout=150)


def _assert_bit_equal(result: dict[str, Any]) -> None:
    expected, got = result["expected"], result["got"]
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_init_fn_equals_fsdp1_param_init_fn_on_one_rank(world1: None, pattern: str) -> None:
    _assert_bit_equal(_parity(pattern))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_init_fn_equals_fsdp1_param_init_fn_on_two_ranks(pattern: str) -> None:
    for rank_result in values(PARITY(2), pattern):
        _assert_bit_equal(rank_result)


def test_init_fn_that_leaves_a_module_on_meta_is_refused(world1: None) -> None:
    def only_linears(module: nn.Module) -> None:
        if isinstance(module, MyLinear):
            init_with_guard(module)

    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).materialize(InitFn(only_linears))
    with pytest.raises(MaterializationError, match=r"still on the meta device: .*buf_mod\.buf"):
        builder.build(_meta_model())


def test_allocating_init_fn_that_writes_nothing_is_refused(world1: None) -> None:
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block)
    builder.materialize(InitFn(lambda m: None, allocate=True))
    with pytest.raises(MaterializationError, match=r"never written: blocks\.0\.lin1\.weight"):
        builder.build(_meta_model())


# -- poisoned allocations: no materializer may leave storage from torch.empty unwritten ---------


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``torch.empty_like`` (what ``to_empty`` allocates with) returns NaN-filled memory."""
    real = torch.empty_like

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        if out.is_floating_point() and not out.is_meta:
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty_like", poisoned)


MATERIALIZERS: dict[str, Callable[[], Any]] = {
    "reset": ResetParameters,
    "deterministic": lambda: DeterministicInit(seed=1),
    "init_fn": lambda: InitFn(init_with_guard),
    "init_fn_allocate": lambda: InitFn(lambda m: m.reset_parameters(), allocate=True),  # type: ignore[operator]
    "shard_first": lambda: ShardFirstReset(seed=1),
}


@pytest.mark.parametrize("name", sorted(MATERIALIZERS))
@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_no_poison_survives_a_build(
    world1: None, poisoned_empty: None, name: str, backend: str
) -> None:
    builder = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    builder.device(CPUDevice()).wrap(Block).materialize(MATERIALIZERS[name]())
    state = full_state_dict(builder.build(_meta_model()))
    assert torch.isnan(torch.empty_like(torch.zeros(2))).all()  # the poison is active
    poisoned = [k for k, v in state.items() if v.is_floating_point() and torch.isnan(v).any()]
    assert not poisoned


# -- nn.Transformer with its layers wrapped: the constructor's Xavier reaches every layer -------

TRANSFORMER: dict[str, Any] = {
    "d_model": 64,
    "nhead": 4,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
}
LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _eager_stds(seeds: int = 4) -> dict[str, float]:
    totals: dict[str, float] = {}
    for seed in range(seeds):
        torch.manual_seed(seed)
        for name, p in nn.Transformer(**TRANSFORMER).named_parameters():
            totals[name] = totals.get(name, 0.0) + float(p.detach().std()) / seeds
    return totals


BUILDS: dict[str, Callable[[], Any]] = {
    "fsdp1_reset": lambda: FSDPBuilder().materialize(ResetParameters()),
    "fsdp2_reset": lambda: FullyShardBuilder().materialize(ResetParameters()),
    "fsdp1_deterministic": lambda: FSDPBuilder().materialize(DeterministicInit(seed=5)),
    "fsdp2_deterministic": lambda: FullyShardBuilder().materialize(DeterministicInit(seed=5)),
    "fsdp2_shard_first": lambda: FullyShardBuilder().materialize(ShardFirstReset(seed=5)),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_wrapped_transformer_layers_match_eager_statistics(world1: None, name: str) -> None:
    eager = _eager_stds()
    with torch.device("meta"):
        model = nn.Transformer(**TRANSFORMER)
    torch.manual_seed(123)
    built = BUILDS[name]().device(CPUDevice()).wrap(LAYERS).build(model)
    state = full_state_dict(built)
    assert state.keys() == eager.keys()
    off = {}
    for key, std in eager.items():
        got = float(state[key].std())
        if std == 0.0:  # biases zeroed and norms set to ones by their constructors
            if got != 0.0:
                off[key] = (got, std)
        elif abs(got - std) > 0.1 * std:
            off[key] = (got, std)
    assert not off, off


# -- wrappers do not change names: activation checkpointing and compile ---------------------------


def test_deterministic_init_ignores_checkpoint_and_compile_wrappers(world1: None) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    def built(wrap: str) -> dict[str, torch.Tensor]:
        model = _meta_model()
        if wrap == "checkpoint":
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        elif wrap == "compile":
            model.head = torch.compile(model.head, backend="eager")  # type: ignore[assignment]
        builder = FSDPBuilder().device(CPUDevice()).wrap(Block)
        sharded = builder.materialize(DeterministicInit(seed=2)).build(model)
        return {
            k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): v
            for k, v in full_state_dict(sharded).items()
        }

    plain = built("none")
    for wrap in ("checkpoint", "compile"):
        other = built(wrap)
        assert other.keys() == plain.keys(), wrap
        assert all(torch.equal(other[k], plain[k]) for k in plain), wrap


def test_a_parent_initializer_that_cannot_reach_its_units_is_a_warning(world1: None) -> None:
    with torch.device("meta"):
        model = nn.Transformer(**TRANSFORMER)

    def init(module: nn.Module) -> None:
        if _meta_states(module):
            module.to_empty(device=CPU, recurse=False)
            reset = getattr(module, "reset_parameters", None) or getattr(
                module, "_reset_parameters", None
            )
            if reset is not None:
                reset()

    builder = FSDPBuilder().device(CPUDevice()).wrap(LAYERS).materialize(InitFn(init))
    with pytest.warns(UserWarning, match=r"subtree initializer of '<root>'.*encoder\.layers\.0"):
        builder.build(model)


# -- a registered subtree rule: what a parent's constructor does to its subtree -------------------


def _quarter_matrices(param: torch.Tensor) -> None:
    if param.dim() > 1:
        nn.init.constant_(param, 0.25)


class Tower(nn.Module):
    """A parent whose constructor overwrites its subtree's matrices, as ``nn.Transformer``
    does with Xavier: eager construction is the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        with torch.no_grad():
            for p in self.parameters():
                _quarter_matrices(p)


@pytest.mark.parametrize("name", ["fsdp1_reset", "fsdp2_default"])
def test_a_registered_subtree_rule_reaches_every_unit_below_its_parent(
    world1: None, name: str
) -> None:
    from fsdp_builder import register_subtree_rule
    from fsdp_builder.materializers import conventions

    eager = nn.Sequential(Tower(), nn.Linear(8, 4))
    register_subtree_rule(Tower, _quarter_matrices)
    try:
        with torch.device("meta"):
            model = nn.Sequential(Tower(), nn.Linear(8, 4))
        builder = (
            FSDPBuilder().materialize(ResetParameters())
            if name == "fsdp1_reset"
            else FullyShardBuilder()
        )
        state = full_state_dict(builder.device(CPUDevice()).wrap(nn.Linear).build(model))
    finally:
        del conventions._SUBTREE_RULES[Tower]
    reference = eager.state_dict()
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        got = state[key]
        if key.startswith("0.") and key.endswith("weight"):  # the rule's, in both
            assert torch.equal(got, value), key
        else:  # the module's own initializer (random draws), not the rule's
            assert not torch.all(got == 0.25), key
            assert got.std() > 0, key
