"""The unit plan is a pure function of model, wrap policy and ignored states."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_builder import PlanError, WrapPolicy, plan_units, resolve_ignored
from fsdp_builder.planning.ignored import IgnoredStates
from fsdp_builder.planning.plan import plan_model
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer


def demo(device: str = "cpu") -> DemoTransformer:
    with torch.device(device):
        return DemoTransformer(DemoConfig(layers=2))


def test_units_are_bottom_up_with_root_last() -> None:
    model = demo()
    plan = plan_units(model, WrapPolicy.of(Block), IgnoredStates())
    assert [u.fqn for u in plan] == ["blocks.0", "blocks.1", ""]
    assert plan.root.is_root and not plan.units[0].is_root
    assert plan.units[0].module is model.blocks[0]


def test_units_own_their_states_directly_and_cover_the_model() -> None:
    model = demo()
    plan = plan_units(model, WrapPolicy.of(Block), IgnoredStates())
    block_names = {t.name for t in plan.units[0].params}
    assert block_names == {f"blocks.0.{n}" for n, _ in model.blocks[0].named_parameters()}
    root_names = {t.name for t in plan.root.params}
    assert root_names == {n for n, _ in model.named_parameters() if not n.startswith("blocks.")}
    assert plan.numel == sum(p.numel() for p in model.parameters())
    assert plan.nbytes == sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = {t.name: t.shape for u in plan for t in u.params}
    assert shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_plan_needs_no_real_storage() -> None:
    meta, real = demo("meta"), demo("cpu")
    a = plan_units(meta, WrapPolicy.of(Block), IgnoredStates())
    b = plan_units(real, WrapPolicy.of(Block), IgnoredStates())
    assert a.signature() == b.signature() and a.fingerprint() == b.fingerprint()
    assert "blocks.0" in a.format() and f"{a.numel:,}" in a.format()


def test_fingerprint_changes_with_shapes() -> None:
    small = plan_units(demo(), WrapPolicy.of(Block), IgnoredStates())
    with torch.device("meta"):
        wider = DemoTransformer(DemoConfig(layers=2, dim=128))
    assert (
        small.fingerprint()
        != plan_units(wider, WrapPolicy.of(Block), IgnoredStates()).fingerprint()
    )


def test_predicate_and_torch_policy_select_like_classes() -> None:
    model = demo("meta")
    by_class = plan_units(model, WrapPolicy.of(Block), IgnoredStates())
    by_pred = plan_units(
        model,
        WrapPolicy.of(lambda m, fqn: fqn.startswith("blocks.") and fqn.count(".") == 1),
        IgnoredStates(),
    )
    by_torch = plan_units(model, WrapPolicy.of(ModuleWrapPolicy({Block})), IgnoredStates())
    assert by_class.signature() == by_pred.signature() == by_torch.signature()


def test_no_policy_gives_a_root_only_plan() -> None:
    plan = plan_units(demo("meta"), WrapPolicy(), IgnoredStates())
    assert [u.fqn for u in plan] == [""]


def test_ignored_modules_are_neither_units_nor_owned() -> None:
    model = demo("meta")
    ignored = resolve_ignored(model, modules=[model.blocks[1]])
    plan = plan_units(model, WrapPolicy.of(Block), ignored)
    assert [u.fqn for u in plan] == ["blocks.0", ""]
    owned = {t.name for u in plan for t in u.params}
    assert not any(n.startswith("blocks.1.") for n in owned)


def test_ignored_parameters_are_not_owned() -> None:
    model = demo("meta")
    ignored = resolve_ignored(model, states=[model.head.weight])
    plan = plan_units(model, WrapPolicy.of(Block), ignored)
    assert "head.weight" not in {t.name for t in plan.root.params}
    assert "head.bias" in {t.name for t in plan.root.params}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_in_one_unit_are_listed_once() -> None:
    plan = plan_units(Tied(), WrapPolicy.of(nn.Sequential), IgnoredStates())
    names = [t.name for t in plan.root.params]
    assert names.count("embed.weight") == 1 and "head.weight" not in names


def test_tied_weights_split_across_units_name_both_and_the_fix() -> None:
    with pytest.raises(
        PlanError,
        match=r"'head.weight' \(unit 'head'\) and 'embed.weight' \(unit '<root>'\).*together",
    ):
        plan_units(Tied(), WrapPolicy.of(nn.Linear), IgnoredStates())


@pytest.mark.parametrize("min_params", [10_000, 20_000, 40_000, 60_000])
def test_fsdp1_callable_policies_select_what_fsdp1_wraps(world1: None, min_params: int) -> None:
    from functools import partial

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    from fsdp_builder.planning.ignored import clean_name

    policy = partial(size_based_auto_wrap_policy, min_num_params=min_params)
    plan = plan_units(demo("meta"), WrapPolicy.of(policy), IgnoredStates())
    wrapped = FullyShardedDataParallel(
        demo("cpu"), auto_wrap_policy=policy, device_id=torch.device("cpu")
    )
    fsdp1_units = {
        clean_name(name)
        for name, m in wrapped.named_modules()
        if isinstance(m, FullyShardedDataParallel) and m is not wrapped
    }
    assert {u.fqn for u in plan.units[:-1]} == fsdp1_units


def test_transformer_policy_selects_like_classes() -> None:
    from functools import partial

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model = demo("meta")
    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    by_policy = plan_units(model, WrapPolicy.of(policy), IgnoredStates())
    by_class = plan_units(model, WrapPolicy.of(Block), IgnoredStates())
    assert by_policy.signature() == by_class.signature()
    assert WrapPolicy.of(policy).describe() == "transformer_auto_wrap_policy"


def test_already_sharded_children_are_not_planned_again(world1: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from fsdp_builder import resolve_ignored

    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    model[0] = FullyShardedDataParallel(model[0], device_id=torch.device("cpu"))
    plan = plan_units(model, WrapPolicy.of(nn.Linear), resolve_ignored(model))
    assert [u.fqn for u in plan] == ["1", ""]
    assert not any(t.name.startswith("0.") for u in plan for t in u.params)


def test_a_module_under_two_names_is_planned_once_under_its_first() -> None:
    """A module registered twice (under one parent, and under another parent) is owned once,
    named as ``named_modules()`` first reaches it, with an empty slot in between skipped."""
    shared = nn.Linear(4, 4)
    block = nn.Module()
    block.first = shared
    block.register_module("gap", None)
    block.second = shared  # the same module, same parent
    model = nn.Module()
    model.block = block
    model.other = shared  # and under another parent
    model.head = nn.Linear(4, 2)
    plan = plan_units(model, WrapPolicy(), IgnoredStates())
    (root,) = plan.units
    names = [p.name for p in root.params]
    assert names == ["block.first.weight", "block.first.bias", "head.weight", "head.bias"]
    assert [n for n, _ in model.named_parameters()] == names  # torch's own naming agrees
    # As units: the shared module is its own unit, once, under its first name.
    wrapped = plan_units(model, WrapPolicy(classes=(nn.Linear,)), IgnoredStates())
    assert [u.fqn for u in wrapped.units] == ["block.first", "head", ""]


def test_each_unit_records_every_slot_of_its_states_once() -> None:
    """``Unit.states``: one record per (module, name) slot, tied names each, ignored modules'
    states marked, the tensor read from the slot as it is now; ``owned`` pairs with
    ``params + buffers``."""
    model = Tied()
    model.register_buffer("scale", torch.ones(2))
    model.register_buffer("steps", torch.zeros(1), persistent=False)
    model.aside = nn.Linear(2, 2)
    ignored = resolve_ignored(model, [model.aside])
    (root,) = plan_units(model, WrapPolicy(), ignored).units
    assert [(s.name, s.is_param, s.persistent, s.ignored) for s in root.states] == [
        ("scale", False, True, False),
        ("steps", False, False, False),
        ("embed.weight", True, True, False),
        ("head.weight", True, True, False),
        ("aside.weight", True, True, True),
        ("aside.bias", True, True, True),
        ("body.0.weight", True, True, False),
        ("body.0.bias", True, True, False),
    ]
    assert root.states[2].tensor is root.states[3].tensor is model.embed.weight
    assert [s.name for s in root.owned] == [t.name for t in root.params + root.buffers]
    assert root.fqns == ("", "embed", "body", "head", "body.0")  # ignored modules left out
    replaced = nn.Parameter(torch.zeros(8, 4))
    model.embed.weight = replaced  # as storage allocation and FSDP2 do
    assert root.states[2].tensor is replaced


def _counting_walks(model: nn.Module) -> list[int]:
    """Counts the walks of ``model`` that go through its own ``named_modules`` (``modules()``,
    ``named_parameters()`` and ``named_buffers()`` do too); children are not counted."""
    calls = [0]
    walk = model.named_modules

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return walk(*args, **kwargs)  # type: ignore[arg-type]

    model.named_modules = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("source", ["demo_by_class", "transformers_default"])
def test_planning_walks_the_model_once_and_agrees_with_torchs_own_walks(source: str) -> None:
    """``plan_model`` takes one ``named_modules()`` walk and every step of planning reads it; what
    it finds is what torch's own walks of the model give (and the steps called alone give)."""
    if source == "demo_by_class":
        model: nn.Module = demo("meta")
        wrap = WrapPolicy.of(Block)
    else:
        transformers = pytest.importorskip("transformers", reason="part of the test extra")
        config = transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        wrap = WrapPolicy()  # the default: the model's _no_split_modules, tied blocks left out
    calls = _counting_walks(model)
    planned = plan_model(model, wrap)
    assert calls[0] == 1
    del model.named_modules  # the class's own method again
    alone = plan_units(model, wrap, IgnoredStates())
    assert [u.fqn for u in planned.plan] == [u.fqn for u in alone]
    assert list(planned.managed) == list(model.parameters())
    if source == "transformers_default":
        assert [u.fqn for u in planned.plan] == ["model.layers.0", "model.layers.1", ""]
    infos = {t.name: t for u in planned.plan for t in u.params}
    assert {n: (t.requires_grad, t.contiguous) for n, t in infos.items()} == {
        n: (p.requires_grad, p.is_contiguous()) for n, p in model.named_parameters()
    }


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(2, 2), nn.Linear(2, 2)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 3), nn.Linear(3, 2)


class _Block(nn.Module):
    def __init__(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        super().__init__()
        self.attn = _Attn()
        self.mlp = checkpoint_wrapper(_MLP())
        self.register_buffer("steps", torch.zeros(1))


def test_unit_modules_are_breadth_first_and_names_clean_as_torch_gives_them() -> None:
    """Each unit's modules in the order of a breadth-first walk of torch's ``children()``
    (here not its depth-first ``modules()``), and its states named as ``state_dict()`` names
    them, a checkpoint wrapper's part left out."""
    model = nn.Sequential(_Block(), nn.Linear(2, 2), _Block())
    plan = plan_units(model, WrapPolicy.of(_Block), IgnoredStates())
    assert [u.fqn for u in plan] == ["0", "2", ""]
    for unit in plan.units[:-1]:
        expected, queue = [], [unit.module]
        while queue:
            module = queue.pop(0)
            expected.append(module)
            queue.extend(module.children())
        assert [id(m) for m in unit.modules] == [id(m) for m in expected]
        assert [id(m) for m in unit.module.modules()] != [id(m) for m in expected]
    names = [s.name for u in plan for s in u.states]
    assert sorted(names) == sorted(model.state_dict())
    assert sorted(t.name for u in plan for t in u.params + u.buffers) == sorted(model.state_dict())
    assert plan.units[0].fqns[:3] == ("0", "0.attn", "0.mlp")
