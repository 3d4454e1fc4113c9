"""docs/migration.md: the tables list exactly the arguments of torch's ``FullyShardedDataParallel``
and ``fully_shard``, and each row that names a builder call builds the same module as the
hand-written call (compared setting by setting, in a one-rank gloo world on the CPU).

Adding a row: one line in the table, and, when it names a builder call, one check below keyed
by the argument's name.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Shard

from fsdp_builder import (
    BroadcastFromRank0,
    ConfigurationError,
    FSDPBuilder,
    FullyShardBuilder,
    InitFn,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration.md"
ROW = re.compile(r"^\| `(?P<arg>\w+)` \| (?P<call>[^|]*?) \| (?P<notes>.*)\|\s*$")
CPU = torch.device("cpu")

pytestmark = pytest.mark.filterwarnings(
    # One rank: FSDP and the builder both switch to NO_SHARD and say so.
    "ignore:.*NO_SHARD.*:UserWarning",
    "ignore:.*NO_SHARD.*:FutureWarning",
)


def table(name: str) -> dict[str, str]:
    """The rows of the table after ``<!-- migration-table: name -->``: argument -> builder call
    (empty when the argument is not expressible)."""
    text = DOC.read_text()
    marker = f"<!-- migration-table: {name} -->"
    assert text.count(marker) == 1, marker
    rows: dict[str, str] = {}
    for line in text.split(marker, 1)[1].lstrip().splitlines()[2:]:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"malformed row: {line}"
        assert match["arg"] not in rows, f"{match['arg']} listed twice"
        call = match["call"].strip()
        rows[match["arg"]] = "" if call.startswith("not expressible") else call
        assert call, f"{match['arg']}: no builder call and no reason"
    return rows


def signature_args(fn: Callable[..., Any]) -> list[str]:
    return [name for name in inspect.signature(fn).parameters if name != "self"]


# -- a small model ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Model(nn.Sequential):
    """Two Blocks and a head; indexable for mypy."""

    def __getitem__(self, idx: Any) -> Any:
        return super().__getitem__(idx)


def model(device: str = "cpu") -> Model:
    torch.manual_seed(0)
    with torch.device(device):
        return Model(Block(), Block(), nn.Linear(8, 2))


def param_names(root: nn.Module, params: Any) -> list[str]:
    wanted = {id(p) for p in params}
    return sorted(n for n, p in root.named_parameters(remove_duplicate=False) if id(p) in wanted)


# -- FSDP1 -----------------------------------------------------------------------------------


def _contains(unit: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in unit.modules())


def settings1(root: nn.Module) -> dict[str, Any]:
    """Every FullyShardedDataParallel instance's settings, by its name in the wrapped model."""
    out = {}
    for name, m in root.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            out[name] = {
                "sharding_strategy": m.sharding_strategy,
                "mixed_precision": m.mixed_precision,
                "cpu_offload": m.cpu_offload,
                "backward_prefetch": m.backward_prefetch,
                "forward_prefetch": m.forward_prefetch,
                "use_orig_params": m._use_orig_params,
                "limit_all_gathers": m.limit_all_gathers,
                "compute_device": m.compute_device,
                "process_group_size": dist.get_world_size(m.process_group),
                # Under this unit: the builder hands every unit the whole ignored list, FSDP's
                # auto-wrap only the root; a module outside a unit's subtree changes nothing.
                "ignored_modules": sorted(
                    type(x).__name__ for x in m._ignored_modules if _contains(m, x)
                ),
                "ignored_params": param_names(root, m._ignored_params),
            }
    return out


def both1(
    plain: Callable[[Model], dict[str, Any]],
    configure: Callable[[FSDPBuilder, Model], FSDPBuilder],
    device: str = "cpu",
) -> tuple[nn.Module, nn.Module]:
    """The model wrapped by hand (FSDP1 with an auto-wrap policy for ``Block``) and by the
    builder (``.wrap(Block)``), each given the argument under test; their settings must match."""
    hand_model = model(device)
    kwargs: dict[str, Any] = {
        "device_id": CPU,
        "auto_wrap_policy": ModuleWrapPolicy({Block}),
        **plain(hand_model),
    }
    by_hand = FullyShardedDataParallel(hand_model, **kwargs)
    built_model = model(device)
    built = configure(FSDPBuilder().device(CPU).wrap(Block), built_model).build(built_model)
    assert settings1(built) == settings1(by_hand)
    assert list(settings1(built)) == ["", "_fsdp_wrapped_module.0", "_fsdp_wrapped_module.1"]
    return by_hand, built


def root_settings(m: nn.Module) -> dict[str, Any]:
    return settings1(m)[""]


def check1_module() -> None:
    by_hand, built = both1(lambda m: {}, lambda b, m: b)
    assert isinstance(built, FullyShardedDataParallel)
    assert type(built.module) is type(by_hand.module) is Model


def check1_process_group() -> None:
    group = dist.new_group([0])
    by_hand, built = both1(lambda m: {"process_group": group}, lambda b, m: b.groups(group))
    assert isinstance(built, FullyShardedDataParallel)
    assert built.process_group is group and by_hand.process_group is group


def check1_sharding_strategy() -> None:
    # One rank: both FSDP and the builder switch SHARD_GRAD_OP to NO_SHARD.
    _, built = both1(
        lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
        lambda b, m: b.sharding("grad_op"),
    )
    assert root_settings(built)["sharding_strategy"] is ShardingStrategy.NO_SHARD


def check1_cpu_offload() -> None:
    if not torch.accelerator.is_available():  # FSDP1's offload would fail at the first forward
        with pytest.raises(ConfigurationError, match="no accelerator"):
            FSDPBuilder().device(CPU).cpu_offload(CPUOffload(offload_params=True)).build(model())
        return
    _, built = both1(
        lambda m: {"cpu_offload": CPUOffload(offload_params=True)},
        lambda b, m: b.cpu_offload(CPUOffload(offload_params=True)),
    )
    assert root_settings(built)["cpu_offload"].offload_params


def check1_auto_wrap_policy() -> None:
    both1(lambda m: {}, lambda b, m: b)  # both1 wraps Block both ways and compares the units
    # A CustomPolicy's per-unit kwargs reach that unit; per_unit gives the same overrides.
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    policy = CustomPolicy(lambda m: {"mixed_precision": mp} if isinstance(m, Block) else False)
    _, built = both1(
        lambda m: {"auto_wrap_policy": policy},
        lambda b, m: b.per_unit(lambda module, fqn: {"mixed_precision": mp} if fqn else None),
    )
    assert settings1(built)["_fsdp_wrapped_module.0"]["mixed_precision"] == mp
    assert root_settings(built)["mixed_precision"].param_dtype is None


def check1_backward_prefetch() -> None:
    _, built = both1(
        lambda m: {"backward_prefetch": BackwardPrefetch.BACKWARD_POST},
        lambda b, m: b.prefetch(backward=BackwardPrefetch.BACKWARD_POST),
    )
    assert root_settings(built)["backward_prefetch"] is BackwardPrefetch.BACKWARD_POST


def check1_mixed_precision() -> None:
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, built = both1(lambda m: {"mixed_precision": policy}, lambda b, m: b.mixed_precision(policy))
    assert root_settings(built)["mixed_precision"].param_dtype is torch.bfloat16


def check1_ignored_modules() -> None:
    _, built = both1(lambda m: {"ignored_modules": [m[2]]}, lambda b, m: b.ignore(modules=[m[2]]))
    assert root_settings(built)["ignored_modules"] == ["Linear"]


def _fill(module: nn.Module) -> None:
    module.to_empty(device=CPU, recurse=False)
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.fill_(0.5)


def check1_param_init_fn() -> None:
    by_hand, built = both1(
        lambda m: {"param_init_fn": _fill}, lambda b, m: b.materialize(InitFn(_fill)), "meta"
    )
    for m in (by_hand, built):
        values = torch.cat([p.detach().flatten() for p in m.parameters()])
        assert not values.is_meta and bool((values == 0.5).all())


def check1_device_id() -> None:
    _, built = both1(lambda m: {"device_id": CPU}, lambda b, m: b)  # both1 sets the device
    assert root_settings(built)["compute_device"] == CPU


def check1_sync_module_states() -> None:
    # FSDP1 refuses sync_module_states for CPU modules; the builder's broadcast works on gloo.
    with pytest.raises(ValueError, match="sync_module_states"):
        FullyShardedDataParallel(model(), device_id=CPU, sync_module_states=True)
    reference = torch.cat([p.detach().flatten() for p in model().parameters()])
    built_model = model()
    builder = FSDPBuilder().device(CPU).wrap(Block).synchronize(BroadcastFromRank0())
    built = builder.build(built_model)
    with FullyShardedDataParallel.summon_full_params(built):
        values = torch.cat([p.detach().flatten() for p in built_model.parameters()])
    assert torch.equal(values, reference)
    assert [r.unit for r in builder.report.records if r.stage == "synchronize"]


def check1_forward_prefetch() -> None:
    _, built = both1(lambda m: {"forward_prefetch": True}, lambda b, m: b.prefetch(forward=True))
    assert root_settings(built)["forward_prefetch"] is True


def check1_limit_all_gathers() -> None:
    _, built = both1(
        lambda m: {"limit_all_gathers": False}, lambda b, m: b.limit_all_gathers(False)
    )
    assert root_settings(built)["limit_all_gathers"] is False


def check1_use_orig_params() -> None:
    _, built = both1(lambda m: {"use_orig_params": True}, lambda b, m: b.use_orig_params(True))
    assert root_settings(built)["use_orig_params"] is True


def check1_ignored_states() -> None:
    _, built = both1(
        lambda m: {"ignored_states": [m[2].bias]}, lambda b, m: b.ignore(states=[m[2].bias])
    )
    assert root_settings(built)["ignored_params"] == ["_fsdp_wrapped_module.2.bias"]


def check1_device_mesh() -> None:
    mesh = init_device_mesh("cpu", (1,))
    by_hand, built = both1(lambda m: {"device_mesh": mesh}, lambda b, m: b.groups(mesh))
    assert isinstance(built, FullyShardedDataParallel)
    assert built._device_mesh is mesh and by_hand._device_mesh is mesh


FSDP1_CHECKS: dict[str, Callable[[], None]] = {
    "module": check1_module,
    "process_group": check1_process_group,
    "sharding_strategy": check1_sharding_strategy,
    "cpu_offload": check1_cpu_offload,
    "auto_wrap_policy": check1_auto_wrap_policy,
    "backward_prefetch": check1_backward_prefetch,
    "mixed_precision": check1_mixed_precision,
    "ignored_modules": check1_ignored_modules,
    "param_init_fn": check1_param_init_fn,
    "device_id": check1_device_id,
    "sync_module_states": check1_sync_module_states,
    "forward_prefetch": check1_forward_prefetch,
    "limit_all_gathers": check1_limit_all_gathers,
    "use_orig_params": check1_use_orig_params,
    "ignored_states": check1_ignored_states,
    "device_mesh": check1_device_mesh,
}


# -- FSDP2 -----------------------------------------------------------------------------------


def fsdp_units(root: nn.Module) -> Iterator[tuple[str, FSDPModule]]:
    for name, m in root.named_modules():
        if isinstance(m, FSDPModule):
            yield name, m


def settings2(root: nn.Module) -> dict[str, Any]:
    """Each fully_shard unit's parameter group: mixed precision, reshard, offload, mesh and the
    parameters it shards."""
    modules = {id(m): name for name, m in root.named_modules()}
    out = {}
    for name, unit in fsdp_units(root):
        group = unit._get_fsdp_state()._fsdp_param_group
        assert group is not None
        mesh = group.mesh_info.mesh
        out[name] = {
            "mp_policy": group.mp_policy,
            "reshard_after_forward": group.post_forward_mesh_info is not None,
            "offload_policy": group.offload_policy,
            "mesh": (mesh.ndim, mesh.mesh.tolist()),
            "params": sorted(
                f"{modules[id(p._module_info.module)]}.{p._module_info.param_name}".lstrip(".")
                for p in group.fsdp_params
            ),
            "placements": sorted(
                str(cast(DTensor, p.sharded_param).placements) for p in group.fsdp_params
            ),
        }
    return out


def both2(
    shard: Callable[[Any, dict[str, Any]], dict[str, Any]],
    configure: Callable[[FullyShardBuilder, Model], FullyShardBuilder],
) -> tuple[dict[str, Any], dict[str, Any], nn.Module]:
    """``fully_shard`` by hand on each Block then the root, with ``shard(model, kwargs)``'s
    keywords, and the builder; one forward each (the root decides its resharding then)."""
    hand = model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in (hand[0], hand[1]):
        fully_shard(block, **shard(block, {"mesh": mesh}))
    fully_shard(hand, **shard(hand, {"mesh": mesh}))
    built_model = model()
    built = configure(FullyShardBuilder().device(CPU).wrap(Block), built_model).build(built_model)
    x = torch.randn(2, 8)
    torch.testing.assert_close(built(x), hand(x))
    mine, theirs = settings2(built), settings2(hand)
    world = dist.get_world_size()
    assert all(s["mesh"] == (1, list(range(world))) for s in mine.values())
    assert list(mine) == ["", "0", "1"]
    assert mine == theirs
    return mine, theirs, built


def check2_module() -> None:
    both2(lambda m, kw: kw, lambda b, m: b)


def check2_mesh() -> None:
    mesh = init_device_mesh("cpu", (1,))
    _, _, built = both2(lambda m, kw: {**kw, "mesh": mesh}, lambda b, m: b.groups(mesh))
    assert isinstance(built, FSDPModule)
    group = built._get_fsdp_state()._fsdp_param_group
    assert group is not None and group.mesh_info.mesh == mesh


def check2_reshard_after_forward() -> None:
    # fully_shard's default (None): True for every unit but the root, which keeps its
    # parameters after forward; .sharding("full") does the same.
    mine, _, _ = both2(lambda m, kw: kw, lambda b, m: b.sharding("full"))
    assert [s["reshard_after_forward"] for s in mine.values()] == [False, True, True]
    # reshard_after_forward=False is .sharding("grad_op"): checked on two ranks below, since one
    # rank makes the builder use NO_SHARD, as FSDP1 does.
    # The value itself, for every unit (the root too), as written in each fully_shard call.
    for value in (True, False):
        mine, _, _ = both2(*_reshard_both_ways(value))
        assert [s["reshard_after_forward"] for s in mine.values()] == [value] * 3


def _reshard_both_ways(
    value: bool,
) -> tuple[Callable[..., dict[str, Any]], Callable[..., FullyShardBuilder]]:
    return (
        lambda m, kw: {**kw, "reshard_after_forward": value},
        lambda b, m: b.reshard_after_forward(value),
    )


def _on_dim1(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.ndim == 2 else None


def check2_shard_placement_fn() -> None:
    mine, _, _ = both2(
        lambda m, kw: {**kw, "shard_placement_fn": _on_dim1},
        lambda b, m: b.shard_placement_fn(_on_dim1),
    )
    assert "(Shard(dim=1),)" in mine["0"]["placements"]


def check2_offload_policy() -> None:
    policy = CPUOffloadPolicy(pin_memory=False)
    mine, _, _ = both2(
        lambda m, kw: {**kw, "offload_policy": policy}, lambda b, m: b.cpu_offload(policy)
    )
    assert all(s["offload_policy"] == policy for s in mine.values())


def _grad_op_on_two_ranks() -> bool:
    mine, _, _ = both2(
        lambda m, kw: {**kw, "reshard_after_forward": False}, lambda b, m: b.sharding("grad_op")
    )
    return not any(s["reshard_after_forward"] for s in mine.values())


def check2_mp_policy() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    for configure in (
        lambda b, m: b.mixed_precision(policy),
        # Keywords take MixedPrecisionPolicy's defaults.
        lambda b, m: b.mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        lambda b, m: b.mixed_precision(mp),
    ):
        mine, _, _ = both2(lambda m, kw: {**kw, "mp_policy": policy}, configure)
        assert all(s["mp_policy"] == policy for s in mine.values())
    custom = MixedPrecisionPolicy(
        reduce_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=False
    )
    mine, _, _ = both2(
        lambda m, kw: {**kw, "mp_policy": custom}, lambda b, m: b.mixed_precision(custom)
    )
    assert all(s["mp_policy"] == custom for s in mine.values())


def check2_ignored_params() -> None:
    def shard(m: nn.Module, kw: dict[str, Any]) -> dict[str, Any]:
        return {**kw, "ignored_params": {m[2].bias}} if isinstance(m, nn.Sequential) else kw

    mine, _, built = both2(shard, lambda b, m: b.ignore(states=[m[2].bias]))
    assert "2.bias" not in mine[""]["params"] and "2.weight" in mine[""]["params"]
    assert isinstance(built, nn.Sequential)
    assert not isinstance(built[2].bias, DTensor)


FSDP2_CHECKS: dict[str, Callable[[], None]] = {
    "module": check2_module,
    "mesh": check2_mesh,
    "reshard_after_forward": check2_reshard_after_forward,
    "shard_placement_fn": check2_shard_placement_fn,
    "mp_policy": check2_mp_policy,
    "offload_policy": check2_offload_policy,
    "ignored_params": check2_ignored_params,
}


# -- the tests -------------------------------------------------------------------------------

TABLES: dict[str, tuple[Callable[..., Any], dict[str, Callable[[], None]]]] = {
    "fsdp1": (FullyShardedDataParallel.__init__, FSDP1_CHECKS),
    "fsdp2": (fully_shard, FSDP2_CHECKS),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_lists_exactly_the_arguments_of_torch(name: str) -> None:
    fn, _ = TABLES[name]
    assert list(table(name)) == signature_args(fn)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_row_with_a_builder_call_has_a_check(name: str) -> None:
    _, checks = TABLES[name]
    claimed = sorted(arg for arg, call in table(name).items() if call)
    assert claimed == sorted(checks)


@pytest.mark.parametrize(
    ("name", "argument"),
    [(name, arg) for name, (_, checks) in sorted(TABLES.items()) for arg in checks],
)
def test_builder_call_builds_what_the_argument_builds(
    name: str, argument: str, world1: None
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        TABLES[name][1][argument]()


def two_rank_scenarios() -> Results:
    return run_each([("grad_op", _grad_op_on_two_ranks)])


SPAWNS = Spawns(two_rank_scenarios, timeout=100)


@pytest.mark.timeout(120)
def test_grad_op_is_reshard_after_forward_false() -> None:
    assert values(SPAWNS(2), "grad_op") == [True, True]


# -- Accelerate's FullyShardedDataParallelPlugin -----------------------------------------------
#
# Accelerate applies its plugin only on an accelerator (CUDA, XPU, ...), so the checks run its
# own FSDP2 code (fsdp2_prepare_model, fsdp2_apply_ac) with the plugin on a one-rank gloo world,
# and for the options it hands unchanged to FullyShardedDataParallel (FSDP1), check that the
# plugin's value is the FSDP argument of the same name, whose builder call the FSDP1 table
# checks.

LLAMA: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def _plugin(**options: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**options)


def llama(meta: bool = False) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _layer_class() -> type[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def by_accelerate(plugin: Any, model: nn.Module) -> nn.Module:
    """What ``accelerator.prepare`` does with an FSDP2 plugin: activation checkpointing, then
    Accelerate's own ``fsdp2_prepare_model``."""
    from types import SimpleNamespace

    from accelerate.utils.fsdp_utils import (
        fsdp2_apply_ac,
        fsdp2_prepare_model,
    )

    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=None,
        device=CPU,
        mixed_precision="no",
        is_main_process=True,
    )
    plugin.set_auto_wrap_policy(model)
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    return cast(nn.Module, fsdp2_prepare_model(accelerator, model))


def layer_units(root: nn.Module) -> dict[str, Any]:
    """The decoder layers' fully_shard settings, by clean name (both build these units)."""
    from fsdp_builder.planning.ignored import clean_name

    out = {}
    for name, unit in fsdp_units(root):
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None or "layers." not in name:
            continue  # a checkpoint wrapper around a sharded layer holds no parameter of its own
        out[clean_name(name)] = {
            "mp_policy": group.mp_policy,
            "reshard_after_forward": group.post_forward_mesh_info is not None,
            "offload_policy": group.offload_policy,
            "params": sorted(
                clean_name(f"{n}")
                for n, p in cast(nn.Module, unit).named_parameters()
                if isinstance(p, DTensor)
            ),
        }
    return out


def both_accelerate(
    options: dict[str, Any],
    configure: Callable[[FullyShardBuilder], FullyShardBuilder],
    forward: bool = True,
) -> tuple[dict[str, Any], nn.Module, nn.Module]:
    """The Llama prepared by Accelerate with an FSDP2 plugin of ``options`` and built by the
    builder; their decoder-layer units must match, and so must their logits."""
    wrap = {"auto_wrap_policy": "transformer_based_wrap"}  # what `accelerate config` writes
    theirs = by_accelerate(_plugin(fsdp_version=2, **(wrap | options)), llama())
    built = configure(FullyShardBuilder().device(CPU)).build(llama())
    mine = layer_units(built)
    assert sorted(mine) == ["model.layers.0", "model.layers.1"]
    assert mine == layer_units(theirs)
    if forward:
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(built(input_ids=ids).logits, theirs(input_ids=ids).logits)
    return mine, built, theirs


def checka_fsdp_version() -> None:
    _, built, theirs = both_accelerate({}, lambda b: b)
    assert isinstance(built, FSDPModule) and isinstance(theirs, FSDPModule)
    assert _plugin().fsdp_version == 1  # FSDP1 is FSDPBuilder: the FSDP1 table's `module`
    check1_module()


def checka_sharding_strategy() -> None:
    assert _plugin(sharding_strategy="SHARD_GRAD_OP").sharding_strategy is (
        ShardingStrategy.SHARD_GRAD_OP
    )
    check1_sharding_strategy()


def _reshard_every_unit(value: bool) -> Callable[[FullyShardBuilder], FullyShardBuilder]:
    return lambda b: b.reshard_after_forward(value)


def checka_reshard_after_forward() -> None:
    for value in (True, False):
        mine, _, _ = both_accelerate({"reshard_after_forward": value}, _reshard_every_unit(value))
        assert [s["reshard_after_forward"] for s in mine.values()] == [value, value]


def checka_backward_prefetch() -> None:
    assert _plugin(backward_prefetch="BACKWARD_POST").backward_prefetch is (
        BackwardPrefetch.BACKWARD_POST
    )
    check1_backward_prefetch()


def checka_mixed_precision_policy() -> None:
    dtypes: dict[str, Any] = {
        "param_dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "output_dtype": torch.float32,
    }
    policy = _plugin(fsdp_version=2, mixed_precision_policy=dtypes).mixed_precision_policy
    assert policy == MixedPrecisionPolicy(**dtypes)
    mine, _, _ = both_accelerate(
        {"mixed_precision_policy": dict(dtypes)}, lambda b: b.mixed_precision(**dtypes), False
    )
    assert all(s["mp_policy"] == policy for s in mine.values())
    # With an output_dtype the layers hand float32 to the head: a unit of its own (as Accelerate
    # makes it) casts its input to param_dtype, and the logits are Accelerate's.
    layer = _layer_class()
    both_accelerate(
        {"mixed_precision_policy": dict(dtypes)},
        lambda b: b.wrap(lambda m, fqn: isinstance(m, layer) or fqn == "lm_head").mixed_precision(
            **dtypes
        ),
    )


def checka_auto_wrap_policy() -> None:
    # transformer_based_wrap: the model's _no_split_modules, the builder's default.
    both_accelerate({"auto_wrap_policy": "transformer_based_wrap"}, lambda b: b)


def checka_cpu_offload() -> None:
    assert _plugin(cpu_offload=True).cpu_offload == CPUOffload(offload_params=True)
    check1_cpu_offload()


def checka_ignored_modules() -> None:
    assert _plugin(ignored_modules="2").ignored_modules == "2"  # handed to FSDP as given
    check1_ignored_modules()


def checka_limit_all_gathers() -> None:
    assert _plugin(limit_all_gathers=False).limit_all_gathers is False
    check1_limit_all_gathers()


def checka_use_orig_params() -> None:
    assert _plugin(use_orig_params=True).use_orig_params is True
    check1_use_orig_params()


def checka_param_init_fn() -> None:
    assert _plugin(param_init_fn=_fill).param_init_fn is _fill
    check1_param_init_fn()


def checka_sync_module_states() -> None:
    # Accelerate needs an accelerator for it; the builder's broadcast runs on gloo. (Its message:
    # up to accelerate 1.15 "no available devices", from 1.16 "... not supported on cpu".)
    with pytest.raises(
        RuntimeError, match=r"no available devices|sync_module_states=True` is not supported on cpu"
    ):
        _plugin(sync_module_states=True)
    check1_sync_module_states()


def checka_forward_prefetch() -> None:
    assert _plugin(forward_prefetch=True).forward_prefetch is True
    check1_forward_prefetch()


def checka_activation_checkpointing() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from fsdp_builder.planning.ignored import clean_name

    layer = _layer_class()
    _, built, theirs = both_accelerate(
        {"activation_checkpointing": True, "auto_wrap_policy": "transformer_based_wrap"},
        lambda b: b.activation_checkpointing(layer),
    )
    for model in (built, theirs):
        wrapped = [
            clean_name(n) for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)
        ]
        assert wrapped == ["model.layers.0", "model.layers.1"]


def checka_cpu_ram_efficient_loading(tmp_path: Path) -> None:
    import transformers
    from helpers import full_state_dict

    from fsdp_builder import FromCheckpoint

    torch.manual_seed(3)
    cast(Any, llama()).save_pretrained(tmp_path, max_shard_size="40KB")
    theirs = by_accelerate(
        _plugin(
            fsdp_version=2,
            cpu_ram_efficient_loading=True,
            auto_wrap_policy="transformer_based_wrap",
        ),
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path),
    )
    built = FullyShardBuilder().device(CPU).materialize(FromCheckpoint(tmp_path)).build(llama(True))
    want, got = full_state_dict(theirs), full_state_dict(built)
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert layer_units(built) == layer_units(theirs)


def checka_transformer_cls_names_to_wrap() -> None:
    layer = _layer_class()
    both_accelerate(
        {
            "auto_wrap_policy": "transformer_based_wrap",
            "transformer_cls_names_to_wrap": [layer.__name__],
        },
        lambda b: b.wrap(layer),
    )


def checka_min_num_params() -> None:
    from functools import partial

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    plugin = _plugin(auto_wrap_policy="size_based_wrap", min_num_params=100)
    plugin.set_auto_wrap_policy(model())
    assert plugin.auto_wrap_policy.func is size_based_auto_wrap_policy
    assert plugin.auto_wrap_policy.keywords == {"min_num_params": 100}
    policy = partial(size_based_auto_wrap_policy, min_num_params=100)
    by_hand = FullyShardedDataParallel(
        model(), device_id=CPU, auto_wrap_policy=plugin.auto_wrap_policy
    )
    built = FSDPBuilder().device(CPU).wrap(policy).build(model())
    units = list(settings1(built))
    assert units == list(settings1(by_hand)) and len(units) > 1
    assert settings1(built) == settings1(by_hand)


ACCELERATE_CHECKS: dict[str, Callable[..., None]] = {
    "fsdp_version": checka_fsdp_version,
    "sharding_strategy": checka_sharding_strategy,
    "reshard_after_forward": checka_reshard_after_forward,
    "backward_prefetch": checka_backward_prefetch,
    "mixed_precision_policy": checka_mixed_precision_policy,
    "auto_wrap_policy": checka_auto_wrap_policy,
    "cpu_offload": checka_cpu_offload,
    "ignored_modules": checka_ignored_modules,
    "limit_all_gathers": checka_limit_all_gathers,
    "use_orig_params": checka_use_orig_params,
    "param_init_fn": checka_param_init_fn,
    "sync_module_states": checka_sync_module_states,
    "forward_prefetch": checka_forward_prefetch,
    "activation_checkpointing": checka_activation_checkpointing,
    "cpu_ram_efficient_loading": checka_cpu_ram_efficient_loading,
    "transformer_cls_names_to_wrap": checka_transformer_cls_names_to_wrap,
    "min_num_params": checka_min_num_params,
}


def test_accelerate_table_lists_exactly_the_plugins_fields() -> None:
    pytest.importorskip("accelerate", reason="accelerate is part of the test extra")
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    fields = [f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)]
    assert list(table("accelerate")) == fields
    assert all(hasattr(FullyShardedDataParallelPlugin(), name) for name in fields)
    claimed = sorted(arg for arg, call in table("accelerate").items() if call)
    assert claimed == sorted(ACCELERATE_CHECKS)


@pytest.fixture
def accelerate_env() -> Iterator[None]:
    """The plugin writes some options to the environment (FSDP_CPU_RAM_EFFICIENT_LOADING, read
    by later plugins and by transformers): each check starts and ends with the test's own."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.mark.parametrize("option", sorted(ACCELERATE_CHECKS))
def test_builder_call_builds_what_accelerates_option_builds(
    option: str, world1: None, accelerate_env: None, tmp_path: Path
) -> None:
    pytest.importorskip("accelerate", reason="accelerate is part of the test extra")
    pytest.importorskip("transformers", reason="transformers is part of the test extra")
    check = ACCELERATE_CHECKS[option]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if "tmp_path" in inspect.signature(check).parameters:
            check(tmp_path)
        else:
            check()
