"""Composition with torch.compile, activation checkpointing and tensor parallelism: each built
model against the same calls written out by hand (torchtitan's order: TP, activation
checkpointing, compile, ``fully_shard`` per unit, root last), compared on settings and losses.

Compile runs with the ``eager`` / ``aot_eager`` backends, which need no C compiler."""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import nullcontext
from functools import partial
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from models import Block, llama, new_net, train
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_builder import (
    BroadcastFromRank0,
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    KeepAsIs,
    MeshGroups,
    StateMismatchError,
    StreamInit,
    VerifyReplicas,
)
from fsdp_builder.groups import describe_mesh, other_dims

CLEAN_KEYS = list(new_net().state_dict())


def settings(model: nn.Module) -> dict[str, Any]:
    """Structure, which modules are compiled and with what, FSDP units and their policies,
    parameter placements and state-dict keys."""
    compiled = {}
    for fqn, module in model.named_modules():
        impl = getattr(module, "_compiled_call_impl", None)
        if impl is not None:
            compiled[fqn] = type(module).__name__
    units = {}
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            assert group is not None
            units[fqn] = (group.mp_policy, group.post_forward_mesh_info is not None)
    return {
        "structure": [(n, type(m).__name__) for n, m in model.named_modules()],
        "compiled": compiled,
        "units": units,
        "placements": {n: tuple(cast(DTensor, p).placements) for n, p in model.named_parameters()},
        "keys": list(model.state_dict()),
    }


# -- compile: scenarios --------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # name: (compile kwargs, per_unit, activation checkpointing)
    "units_aot_eager": ({"backend": "aot_eager"}, True, False),
    "units_checkpointed": ({"backend": "aot_eager", "fullgraph": True}, True, True),
    "whole_model_eager": ({"backend": "eager", "dynamic": False}, False, False),
}


def built(name: str) -> nn.Module:
    kwargs, per_unit, checkpoint = SCENARIOS[name]
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block)
    if checkpoint:
        builder.activation_checkpointing(Block)
    builder.compile(per_unit=per_unit, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one rank: NO_SHARD
        return builder.build(new_net())


def by_hand(name: str, mesh: DeviceMesh) -> nn.Module:
    kwargs, per_unit, checkpoint = SCENARIOS[name]
    model = new_net()
    for i, block in enumerate(model.blocks):
        if checkpoint:
            block = model.blocks[i] = checkpoint_wrapper(block)
        if per_unit:
            block.compile(**kwargs)
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    if not per_unit:
        model.compile(**kwargs)
    return model


def compare(name: str, mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    torch._dynamo.reset()
    mine = built(name)
    hand = by_hand(name, mesh)
    return {
        "settings": (settings(mine), settings(hand)),
        "losses": (train(mine, rank), train(hand, rank)),
    }


def check(result: dict[str, Any], name: str) -> None:
    mine, hand = result["settings"]
    assert mine == hand
    assert mine["keys"] == CLEAN_KEYS
    assert mine["compiled"], name
    losses, hand_losses = result["losses"]
    assert losses == pytest.approx(hand_losses, abs=1e-5, rel=0)


@pytest.fixture
def mesh1(world1: None) -> Iterator[DeviceMesh]:
    yield init_device_mesh("cpu", (1,))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compile_matches_plain_calls(name: str, mesh1: DeviceMesh) -> None:
    result = compare(name, mesh1, 0)
    check(result, name)
    compiled = result["settings"][0]["compiled"]
    if SCENARIOS[name][1]:
        expected = "FSDPCheckpointWrapper" if SCENARIOS[name][2] else "FSDPBlock"
        assert compiled == {"blocks.0": expected, "blocks.1": expected}
    else:
        assert compiled == {"": "FSDPNet"}


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda b: b.compile(backend="eager", nonsense=1),
            r"takes no argument\(s\) \['nonsense'\]",
        ),
        (lambda b: b.compile(mode="default", options={"x": 1}), r"either mode or options"),
        (lambda b: b.compile(per_unit="yes"), r"per_unit.*expected a bool"),
        (lambda b: b.compile().compile(), r"already set"),
    ],
)
def test_compile_arguments_are_checked(call: Callable[[Any], Any], pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        call(FullyShardBuilder())


def test_per_unit_compile_without_units_is_refused(world1: None) -> None:
    builder = FullyShardBuilder().device(CPUDevice()).compile(backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ConfigurationError, match=r"only the root.*per_unit=False"):
            builder.build(new_net())


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("per_unit", [True, False])
def test_fsdp1_compile_matches_plain_calls(per_unit: bool, world1: None) -> None:
    """FSDPBuilder: each block compiled in place and then wrapped, or the wrapped root compiled."""
    torch._dynamo.reset()
    builder = FSDPBuilder().device(CPUDevice()).wrap(Block).use_orig_params()
    mine = builder.compile(per_unit=per_unit, backend="aot_eager").build(new_net())
    net = new_net()
    if per_unit:
        for block in net.blocks:
            block.compile(backend="aot_eager")
    hand = FullyShardedDataParallel(
        net,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        use_orig_params=True,
    )
    if not per_unit:
        hand.compile(backend="aot_eager")

    def compiled(model: nn.Module) -> list[str]:
        return [n for n, m in model.named_modules() if m._compiled_call_impl is not None]

    assert compiled(mine) == compiled(hand)
    assert compiled(mine) == (
        [f"_fsdp_wrapped_module.blocks.{i}._fsdp_wrapped_module" for i in (0, 1)]
        if per_unit
        else [""]
    )
    assert list(mine.state_dict()) == list(hand.state_dict()) == CLEAN_KEYS
    assert train(mine) == pytest.approx(train(hand), abs=1e-5, rel=0)


# -- two ranks: one spawn for every compile scenario ---------------------------------------------


def compile_cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in SCENARIOS:
        yield name, partial(compare, name, mesh, dist.get_rank())


def compile_rank_main() -> Results:
    return run_each(compile_cases())


COMPILE_SPAWNS = Spawns(compile_rank_main, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compile_on_two_ranks_matches_plain_calls(name: str) -> None:
    for result in values(COMPILE_SPAWNS(2), name):
        check(result, name)


# -- tensor parallelism (and HSDP) next to FSDP: four ranks, one spawn ---------------------------

TP_STEPS = 5
LLAMA = {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "max_seq_len": 16}
# aot_eager fails on tensor-parallel blocks under activation checkpointing in torch 2.13 (AOT
# autograd saves a DeviceMesh for backward, "expected all tensors_saved_with_vc_check to be
# Tensors"), by hand as through the builder: Dynamo alone here.
TP_COMPILE_BACKEND = "eager"
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def layers(model: nn.Module) -> nn.ModuleDict:
    return cast(nn.ModuleDict, model.get_submodule("layers"))


def tensor_parallel(model: nn.Module, tp: DeviceMesh) -> nn.Module:
    """torchtitan's plan for each block: column-wise q/k/v and w1/w3, row-wise wo and w2."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in layers(model).values():
        parallelize_module(block, tp, plan)
        # Each rank now computes its share of the heads.
        attention: Any = block.get_submodule("attention")
        attention.n_heads //= tp.size()
        attention.n_kv_heads //= tp.size()
    return model


def new_llama(mesh: DeviceMesh | None) -> nn.Module:
    torch.manual_seed(0)
    model = llama.Transformer(llama.ModelArgs(**LLAMA))
    model.init_weights()
    return model if mesh is None else tensor_parallel(model, mesh["tp"])


def llama_train(model: nn.Module, data_rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(TP_STEPS):
        gen = torch.Generator().manual_seed(100 * step + data_rank)
        tokens = torch.randint(0, LLAMA["vocab_size"], (2, 9), generator=gen)
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# name: (mesh shape and dims, activation checkpointing and compile per block, mixed precision)
COMPOSED: dict[str, tuple[tuple[int, ...], tuple[str, ...], bool, MixedPrecisionPolicy | None]] = {
    "tp2_fsdp2": ((2, 2), ("dp", "tp"), False, None),
    "tp2_fsdp2_ac_compile_bf16": ((2, 2), ("dp", "tp"), True, BF16),
    "hsdp_2x2": ((2, 2), ("dp_replicate", "dp_shard"), False, None),
    "hsdp_1x2_tp2": ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"), False, None),
}


def composed(name: str) -> dict[str, Any]:
    shape, dims, extras, mp = COMPOSED[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    has_tp = "tp" in dims
    dp_dims = tuple(d for d in dims if d != "tp")
    dp = mesh[dp_dims if len(dp_dims) > 1 else dp_dims[0]]
    torch._dynamo.reset()
    # The builder: TP by the user, then FSDP over the data-parallel dims of the same mesh.
    builder = FullyShardBuilder().device(CPUDevice()).wrap(llama.TransformerBlock)
    builder.materialize(KeepAsIs()).groups(dp)
    if len(dp_dims) > 1:
        builder.sharding("hybrid")
    if extras:
        builder.activation_checkpointing(llama.TransformerBlock)
        builder.compile(backend=TP_COMPILE_BACKEND)
    if mp is not None:
        builder.mixed_precision(mp)
    mine = builder.build(new_llama(mesh if has_tp else None))
    # By hand: the same calls written out.
    hand = new_llama(mesh if has_tp else None)
    kwargs: dict[str, Any] = {"mesh": dp} if mp is None else {"mesh": dp, "mp_policy": mp}
    for key, block in list(layers(hand).items()):
        if extras:
            block = checkpoint_wrapper(block)
            layers(hand)[key] = block
            block.compile(backend=TP_COMPILE_BACKEND)
        fully_shard(block, reshard_after_forward=True, **kwargs)
    fully_shard(hand, reshard_after_forward=False, **kwargs)
    # Ranks of one TP group (tp is the innermost dim) train on the same batch.
    data_rank = dist.get_rank() // (mesh["tp"].size() if has_tp else 1)
    unit = cast(FSDPModule, layers(mine)["0"])
    group = unit._get_fsdp_state()._fsdp_param_group
    assert group is not None
    return {
        "settings": (settings(mine), settings(hand)),
        "losses": (llama_train(mine, data_rank), llama_train(hand, data_rank)),
        "mesh": group.mesh_info.mesh.mesh_dim_names,
    }


def test_mesh_validation_names_the_dims(world1: None) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    picked = MeshGroups(mesh, dims=("dp",))
    assert picked.mesh.mesh_dim_names == ("dp",) and picked.dims == ("dp",)
    assert describe_mesh(picked.mesh) == "dims ('dp',) (1,) of the ('dp', 'tp') mesh (1, 1)"
    assert other_dims(picked.mesh) == ("tp",)
    with pytest.raises(ConfigurationError, match=r"\['pp'\] are not dims of the mesh"):
        MeshGroups(mesh, dims=("pp",))
    builder = FullyShardBuilder().device(CPUDevice()).wrap(Block).groups(mesh)
    with pytest.raises(
        ConfigurationError, match=r"FULL_SHARD shards over one dimension, got dims "
    ):
        builder.build(new_net())
    hybrid = FullyShardBuilder().sharding("hybrid").groups(mesh["dp"])
    with pytest.raises(ConfigurationError, match=r"needs a 2-D.*got dims \('dp',\) \(1,\) of the"):
        hybrid.build(new_net())


def dp_without_tp() -> str:
    """FSDP over mesh["dp"] of a model not placed on mesh["tp"]: refused."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    builder = FullyShardBuilder().device(CPUDevice()).wrap(llama.TransformerBlock)
    builder.materialize(KeepAsIs()).groups(mesh["dp"])
    try:
        builder.build(new_llama(None))
    except ConfigurationError as exc:
        return str(exc)
    return "built"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tp_from_rank0(layout: str) -> list[str]:
    """Every rank seeds its own model before TP and FSDP over the data-parallel dims, with
    BroadcastFromRank0: the parameters that differ from global rank 0's model afterwards."""
    hybrid = layout == "hsdp"
    shape, dims = (
        ((1, 2, 2), ("dp_replicate", "dp_shard", "tp")) if hybrid else ((2, 2), ("dp", "tp"))
    )
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    torch.manual_seed(100 + dist.get_rank())
    model = llama.Transformer(llama.ModelArgs(**LLAMA))
    model.init_weights()
    tensor_parallel(model, mesh["tp"])
    # Rank 0's model in plain PyTorch: its replicated states, and its TP shards gathered.
    mine = {n: _full(t).detach().clone() for n, t in model.named_parameters()}
    rank0 = [mine]
    dist.broadcast_object_list(rank0, src=0)
    dp = mesh[dims[:-1]] if hybrid else mesh["dp"]
    builder = FSDPBuilder() if layout == "fsdp1" else FullyShardBuilder()
    builder.device(CPUDevice()).wrap(llama.TransformerBlock).groups(dp)
    if hybrid:
        builder.sharding("hybrid")
    builder.materialize(KeepAsIs()).synchronize(BroadcastFromRank0(), VerifyReplicas())
    built = builder.build(model)
    with FullyShardedDataParallel.summon_full_params(built) if layout == "fsdp1" else nullcontext():
        got = {
            n.replace("_fsdp_wrapped_module.", ""): _full(t).detach().clone()
            for n, t in built.named_parameters()
        }
    assert got.keys() == rank0[0].keys()
    return [n for n, value in rank0[0].items() if not torch.equal(got[n], value)]


def tp_verify(replicas_differ: bool) -> str:
    """VerifyReplicas alone over the data-parallel dims of a TP model whose data-parallel
    replicas are seeded alike, or not: what the build raised, or "built"."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # Ranks of one TP group always seed alike (their replicated states must agree).
    torch.manual_seed(100 + (dist.get_rank() // 2 if replicas_differ else 0))
    model = llama.Transformer(llama.ModelArgs(**LLAMA))
    model.init_weights()
    tensor_parallel(model, mesh["tp"])
    builder = FullyShardBuilder().device(CPUDevice()).wrap(llama.TransformerBlock)
    builder.groups(mesh["dp"]).materialize(KeepAsIs()).synchronize(VerifyReplicas())
    try:
        builder.build(model)
    except StateMismatchError as exc:
        return str(exc)
    return "built"


def tp_checkpoint() -> list[str]:
    """A TP model given storage and values as torchtitan does (to_empty, init_weights), then
    FromCheckpoint over the data-parallel dims: the states that differ from the file."""
    from safetensors.torch import load_file, save_file

    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folder, src=0)
    path = os.path.join(folder[0], "model.safetensors")
    if dist.get_rank() == 0:
        save_file(new_llama(None).state_dict(), path)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs(**LLAMA))
    tensor_parallel(model, mesh["tp"])
    model.to_empty(device="cpu")
    model.init_weights()
    builder = FullyShardBuilder().device(CPUDevice()).wrap(llama.TransformerBlock)
    built = builder.groups(mesh["dp"]).materialize(FromCheckpoint(path)).build(model)
    got = {n: _full(t).detach() for n, t in built.state_dict().items()}
    stored = load_file(path)
    assert got.keys() == stored.keys()
    return [n for n, value in stored.items() if not torch.equal(got[n], value)]


def tp_stream_init() -> dict[str, torch.Tensor]:
    """A TP model built on meta, FSDP over the data-parallel dims, the default materializer
    (StreamInit): the full state, gathered."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs(**LLAMA))
    tensor_parallel(model, mesh["tp"])
    builder = FullyShardBuilder().device(CPUDevice()).wrap(llama.TransformerBlock)
    built = builder.groups(mesh["dp"]).materialize(StreamInit(seed=5)).build(model)
    return {n: _full(t).detach().clone() for n, t in built.state_dict().items()}


def tp_export(backend: str) -> list[str] | str:
    """A TP model built with KeepAsIs, then save_hf_checkpoint: the states whose exported value
    differs from the model's before the build (or the error every rank raised)."""
    from safetensors.torch import load_file

    from fsdp_builder import save_hf_checkpoint

    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folder, src=0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = new_llama(mesh)
    before = {n: _full(t).detach().clone() for n, t in model.state_dict().items()}
    builder = FSDPBuilder() if backend == "fsdp1" else FullyShardBuilder()
    builder.device(CPUDevice()).wrap(llama.TransformerBlock).groups(mesh["dp"])
    built = builder.materialize(KeepAsIs()).build(model)
    try:
        save_hf_checkpoint(built, folder[0])
    except ConfigurationError as exc:
        return str(exc)
    stored = load_file(os.path.join(folder[0], "model.safetensors"))
    assert stored.keys() == before.keys()
    return [n for n, value in before.items() if not torch.equal(stored[n], value)]


def composed_cases() -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    for name in COMPOSED:
        yield name, partial(composed, name)
    yield "dp_without_tp", dp_without_tp
    for layout in ("fsdp2", "hsdp", "fsdp1"):
        yield ("tp_from_rank0", layout), partial(tp_from_rank0, layout)
    for differ in (False, True):
        yield ("tp_verify", differ), partial(tp_verify, differ)
    yield "tp_checkpoint", tp_checkpoint
    yield "tp_stream_init", tp_stream_init
    for backend in ("fsdp2", "fsdp1"):
        yield ("tp_export", backend), partial(tp_export, backend)


def composed_rank_main() -> Results:
    return run_each(composed_cases())


COMPOSED_SPAWNS = Spawns(composed_rank_main, timeout=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", list(COMPOSED))
def test_composition_on_four_ranks_matches_plain_calls(name: str) -> None:
    tolerance = 1e-5 if COMPOSED[name][3] is None else 2e-2
    for result in values(COMPOSED_SPAWNS(4), name):
        mine, hand = result["settings"]
        assert mine == hand
        assert not any("_orig_mod" in k or "_checkpoint_wrapped" in k for k in mine["keys"])
        losses, hand_losses = result["losses"]
        assert losses == pytest.approx(hand_losses, abs=tolerance, rel=0)
        # FSDP shards over the data-parallel dims only.
        assert result["mesh"] == tuple(d for d in COMPOSED[name][1] if d != "tp")
        if COMPOSED[name][2]:
            assert set(mine["compiled"].values()) == {"FSDPCheckpointWrapper"}


@pytest.mark.timeout(450)
def test_a_dp_sub_mesh_without_tensor_parallelism_is_refused() -> None:
    for message in values(COMPOSED_SPAWNS(4), "dp_without_tp"):
        assert "the mesh spans 2 ranks but the world has 4" in message, message
        assert "dims ('dp',) (2,) of the ('dp', 'tp') mesh (2, 2)" in message
        assert "no parameter is placed on its other dims ('tp',)" in message


@pytest.mark.timeout(450)
@pytest.mark.parametrize("layout", ["fsdp2", "hsdp", "fsdp1"])
def test_broadcast_from_rank0_reaches_every_rank_with_tensor_parallelism(layout: str) -> None:
    # TP shards travel over the data-parallel ranks; states TP leaves whole, over every rank.
    assert values(COMPOSED_SPAWNS(4), ("tp_from_rank0", layout)) == [[], [], [], []]


@pytest.mark.timeout(450)
def test_a_tensor_parallel_model_loads_its_checkpoint() -> None:
    assert values(COMPOSED_SPAWNS(4), "tp_checkpoint") == [[], [], [], []]


@pytest.mark.timeout(450)
def test_a_tensor_parallel_model_on_meta_gets_the_weights_it_gets_without_tp(world1: None) -> None:
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs(**LLAMA))
    builder = FullyShardBuilder().device(CPUDevice()).wrap(llama.TransformerBlock)
    reference = full_state_dict(builder.materialize(StreamInit(seed=5)).build(model))
    for state in values(COMPOSED_SPAWNS(4), "tp_stream_init"):
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(state[name], value), name


@pytest.mark.timeout(450)
def test_a_tensor_parallel_model_exports_its_full_weights() -> None:
    assert values(COMPOSED_SPAWNS(4), ("tp_export", "fsdp2")) == [[], [], [], []]
    # FSDP1 gathers a unit on rank 0 alone: refused on every rank, naming the state and the fix.
    refusals = values(COMPOSED_SPAWNS(4), ("tp_export", "fsdp1"))
    assert len(set(refusals)) == 1
    assert re.search(
        r"`save_hf_checkpoint` got an invalid `model`: its state '[\w.]+' is a tensor-parallel "
        r"DTensor inside an FSDP1 unit.*Build the model with FullyShardBuilder",
        refusals[0],
    ), refusals[0]


@pytest.mark.timeout(450)
def test_verify_replicas_compares_tensor_parallel_shards_across_data_parallel_ranks() -> None:
    assert values(COMPOSED_SPAWNS(4), ("tp_verify", False)) == ["built"] * 4
    found = values(COMPOSED_SPAWNS(4), ("tp_verify", True))
    for message in found:
        # The first state that differs is a TP shard (wq), which no mesh dim of its own
        # replicates; each data-parallel group names its own ranks.
        assert re.search(
            r"`VerifyReplicas` found different values across ranks in unit 'layers.0': the first "
            r"differing state is 'layers.0.attention.wq.weight', where rank\(s\) [23] differ "
            r"from rank\(s\) [01]",
            message,
        ), message
