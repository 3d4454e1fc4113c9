"""FromCheckpoint: Hugging Face safetensors folders and DCP folders read rank-locally.

A real HF-layout folder (three shard files, ``model.safetensors.index.json``, HF key names) of
the torchtitan-style Llama in docs/recipes is written once per module; one spawn per world size
runs every scenario (see ``isolated``) and the tests compare what the ranks gathered with the
plain PyTorch load written out below.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import full_state_dict
from isolated import Results, Spawns, run_each, values
from models import counting_collectives, llama, meta_llama
from structlog.testing import capture_logs
from torch import nn

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    ShardingBuilder,
)

# 61 rows of vocabulary: the last shard is short (31/30 at 2 ranks, 16/16/16/13 at 4).
ARGS = llama.ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=61, multiple_of=16)
OTHER = llama.ModelArgs(dim=48, n_layers=3, n_heads=4, vocab_size=61, multiple_of=16)

# Checkpoint (HF) names → model (torchtitan) names, as a user would write them.
KEY_MAP = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.([qkvo])_proj\.", r".attention.w\1."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
]


def hf_names(n_layers: int) -> dict[str, str]:
    """Model name → HF name, spelled out (the reference does not use KEY_MAP)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    for i in range(n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def source_model(args: Any = ARGS, seed: int = 123) -> nn.Module:
    torch.manual_seed(seed)
    model = llama.Transformer(args)
    model.init_weights()
    with torch.no_grad():  # RMSNorm weights start at one: make them tell layers apart
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p))
    return model


def hf_state(args: Any = ARGS) -> dict[str, torch.Tensor]:
    names = hf_names(args.n_layers)
    return {names[k]: v.detach().clone() for k, v in source_model(args).state_dict().items()}


def write_hf_folder(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Three shard files and the index, as transformers' save_pretrained lays them out."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for key, value in state.items():
        if key.startswith("model.layers."):
            part = min(int(key.split(".")[2]), 2)
        else:
            part = 0 if "embed" in key else 2
        groups[part][key] = value
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def reference_state(folder: Path) -> dict[str, torch.Tensor]:
    """The plain PyTorch way: every tensor on one process, renamed, load_state_dict."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(folder / name)))
    back = {theirs: ours for ours, theirs in hf_names(ARGS.n_layers).items()}
    model = llama.Transformer(ARGS)
    model.load_state_dict({back[k]: v for k, v in loaded.items()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- inside the ranks ------------------------------------------------------------------------


def builder(backend: str, strategy: str) -> ShardingBuilder:
    from torch.distributed.device_mesh import init_device_mesh

    kind = FSDPBuilder if backend == "fsdp1" else FullyShardBuilder
    b = kind().device(CPUDevice()).wrap(llama.TransformerBlock).sharding(strategy)
    if strategy == "hybrid":
        b.groups(init_device_mesh("cpu", (2, dist.get_world_size() // 2)))
    return b


def load_case(backend: str, strategy: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """Build from ``path``; the gathered state (rank 0) and the dtype events."""
    with capture_logs() as events:
        sharded = builder(backend, strategy).materialize(FromCheckpoint(path, **kwargs))
        model = sharded.build(meta_llama(ARGS))
    state = full_state_dict(model)
    logged = [e for e in events if e.get("event") in ("converted_dtypes", "checkpoint_partial")]
    rope = next(b for n, b in model.named_buffers() if n.endswith("freqs_cis"))
    expected = llama.precompute_freqs_cis(
        ARGS.dim // ARGS.n_heads, ARGS.max_seq_len, ARGS.rope_theta
    )
    return {
        "state": state if dist.get_rank() == 0 else None,
        "events": logged,
        "rope_computed": bool(torch.equal(rope.cpu(), expected)),
    }


def partial_case(path: str) -> dict[str, Any]:
    """strict=False: the output layer is missing from the checkpoint and real in the model
    (it keeps its values), and the checkpoint has a key the model lacks."""
    model = meta_llama(ARGS)
    torch.manual_seed(5)
    model.output = nn.Linear(ARGS.dim, ARGS.vocab_size, bias=False)
    kept = model.output.weight.detach().clone()
    with capture_logs() as events:
        sharded = builder("fsdp2", "full").materialize(
            FromCheckpoint(path, key_map=KEY_MAP, strict=False)
        )
        built = sharded.build(model)
    state = full_state_dict(built)
    partial_events = [e for e in events if e.get("event") == "checkpoint_partial"]
    return {"state": state, "kept": kept, "events": partial_events}


def bad_case(backend: str, path: str, key_map: Any = KEY_MAP) -> tuple[str, str, bool] | None:
    model = meta_llama(ARGS)
    try:
        builder(backend, "full").materialize(FromCheckpoint(path, key_map=key_map)).build(model)
    except Exception as exc:
        return type(exc).__name__, str(exc), all(p.is_meta for p in model.parameters())
    return None




def counted_case(backend: str, path: str, shared: bool) -> dict[str, int]:
    """Build with every torch.distributed collective wrapped to count the tensors it carries,
    and the checkpoint's reads wrapped to count the bytes this rank read."""

    from fsdp_builder.sources.hf_safetensors import SafetensorsSource

    seen: list[int] = []
    read: list[int] = []
    saved: list[tuple[Any, str, Any]] = [
        (SafetensorsSource, "read", SafetensorsSource.read),
        (SafetensorsSource, "read_into", SafetensorsSource.read_into),
    ]

    def reading(self: Any, key: str, index: Any = None) -> torch.Tensor:
        tensor: torch.Tensor = saved[0][2](self, key, index)
        read.append(tensor.numel() * tensor.element_size())
        return tensor

    def reading_into(self: Any, key: str, index: Any, out: torch.Tensor) -> None:
        saved[1][2](self, key, index, out)
        read.append(out.numel() * self.tensors()[key].dtype.itemsize)

    SafetensorsSource.read = reading  # type: ignore[method-assign]
    SafetensorsSource.read_into = reading_into  # type: ignore[method-assign]

    try:
        with counting_collectives(seen):
            b = builder(backend, "full").materialize(
                FromCheckpoint(path, key_map=KEY_MAP, shared_filesystem=shared)
            )
            b.build(meta_llama(ARGS))
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    return {"largest": max(seen, default=0), "total": sum(seen), "read": sum(read)}


def dcp_save_case(hf: str, folder: str) -> None:
    """Save a sharded model (FSDP2, loaded from the HF folder) with dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = (
        builder("fsdp2", "full")
        .materialize(FromCheckpoint(hf, key_map=KEY_MAP))
        .build(meta_llama(ARGS))
    )
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)


BACKENDS = ["fsdp1", "fsdp2"]
STRATEGIES = {1: ["full"], 2: ["full", "grad_op"], 4: ["full", "hybrid"]}
BAD = [
    "missing_file",
    "absent_key",
    "truncated",
    "other_model",
    "wrong_shape",
    "missing_key",
    "int_dtype",
    "no_metadata",
    "bad_index",
    "not_there",
]


def cases(paths: dict[str, str]) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    world = dist.get_world_size()
    for backend in BACKENDS:
        for strategy in STRATEGIES[world]:
            yield (
                ("hf", backend, strategy),
                partial(load_case, backend, strategy, paths["hf"], key_map=KEY_MAP),
            )
        yield (
            ("bf16", backend),
            partial(load_case, backend, "full", paths["bf16"], key_map=KEY_MAP),
        )
        yield (
            ("rank0", backend),
            partial(
                load_case, backend, "full", paths["hf"], key_map=KEY_MAP, shared_filesystem=False
            ),
        )
        yield ("dcp_plain", backend), partial(load_case, backend, "full", paths["dcp_plain"])
        yield ("dcp_bf16", backend), partial(load_case, backend, "full", paths["dcp_bf16"])
    yield "partial", partial(partial_case, paths["partial"])
    if world > 1:
        dcp_folder = f"{paths['dcp_root']}/w{world}"
        yield "dcp_save", partial(dcp_save_case, paths["hf"], dcp_folder)
        for backend in BACKENDS:
            for strategy in STRATEGIES[world]:
                yield (
                    ("dcp", backend, strategy),
                    partial(load_case, backend, strategy, dcp_folder),
                )
            for shared in (True, False):
                yield (
                    ("counted", backend, shared),
                    partial(counted_case, backend, paths["hf"], shared),
                )
        for case in BAD:
            for backend in BACKENDS:
                key_map = None if case == "no_metadata" else KEY_MAP
                yield ("bad", case, backend), partial(bad_case, backend, paths[case], key_map)


def scenarios(paths: dict[str, str]) -> Results:
    """Every scenario of one world size, each on its own: a failure fails only its tests."""
    return run_each(cases(paths))


# -- the test process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("checkpoints")
    state = hf_state()
    write_hf_folder(root / "hf", state)
    save_file({k: v.bfloat16() for k, v in state.items()}, str(root / "bf16.safetensors"))
    partial_state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    partial_state["model.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(partial_state, str(root / "partial.safetensors"))

    names = hf_names(ARGS.n_layers)
    back = {theirs: ours for ours, theirs in names.items()}
    with warnings.catch_warnings():  # saving on one process without a group is the point
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        for name, convert in (("dcp_plain", False), ("dcp_bf16", True)):
            dcp.save(
                {back[k]: v.bfloat16() if convert else v for k, v in state.items()},
                checkpoint_id=str(root / name),
                no_dist=True,
            )
    (root / "dcp").mkdir()

    def variant(name: str, edit: Callable[[Path], None]) -> str:
        folder = root / name
        write_hf_folder(folder, state)
        edit(folder)
        return str(folder)

    def drop_file(folder: Path) -> None:
        (folder / "model-00002-of-00003.safetensors").unlink()

    def extra_key(folder: Path) -> None:
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"]["model.layers.1.mlp.up_proj.bias"] = "model-00002-of-00003.safetensors"
        index_path.write_text(json.dumps(index))

    def garble_index(folder: Path) -> None:
        (folder / "model.safetensors.index.json").write_text('{"weight_map": {')

    def truncate(folder: Path) -> None:
        shard = folder / "model-00003-of-00003.safetensors"
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])

    from fsdp_builder.tools.demo import DemoConfig, DemoTransformer

    demo = DemoTransformer(DemoConfig(vocab=61, dim=32, heads=2, layers=2, seq=8))
    save_file(
        {k: v.contiguous() for k, v in demo.state_dict().items()}, str(root / "other.safetensors")
    )
    write_hf_folder(root / "wrong_shape", hf_state(OTHER))
    save_file(partial_state, str(root / "missing.safetensors"))
    ints = dict(state)
    ints["model.norm.weight"] = torch.ones(ARGS.dim, dtype=torch.int32)
    save_file(ints, str(root / "ints.safetensors"))
    (root / "no_metadata").mkdir()
    (root / "no_metadata" / "__0_0.distcp").write_bytes(b"\0" * 16)
    return {
        "hf": str(root / "hf"),
        "bf16": str(root / "bf16.safetensors"),
        "partial": str(root / "partial.safetensors"),
        "dcp_plain": str(root / "dcp_plain"),
        "dcp_bf16": str(root / "dcp_bf16"),
        "dcp_root": str(root / "dcp"),
        "missing_file": variant("missing_file", drop_file),
        "absent_key": variant("absent_key", extra_key),
        "truncated": variant("truncated", truncate),
        "other_model": str(root / "other.safetensors"),
        "wrong_shape": str(root / "wrong_shape"),
        "missing_key": str(root / "missing.safetensors"),
        "int_dtype": str(root / "ints.safetensors"),
        "no_metadata": str(root / "no_metadata"),
        "bad_index": variant("bad_index", garble_index),
        "not_there": str(root / "absent"),
    }


SPAWNS = Spawns(scenarios, timeout=300)


def scenario(world: int, paths: dict[str, str], key: Hashable) -> list[Any]:
    """Scenario ``key``'s value on every rank; one spawn per world size, run when a test first
    asks for it."""
    return values(SPAWNS(world, paths), key)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype, (what, k)
        assert torch.equal(got[k], want[k]), (what, k)


LOADS = [(w, b, s) for w in STRATEGIES for b in BACKENDS for s in STRATEGIES[w]]
WORLDS = [1, 2, 4]
MULTI = [2, 4]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "backend", "strategy"), LOADS)
def test_hf_folder_loads_bit_equal_to_plain_pytorch(
    paths: dict[str, str], world: int, backend: str, strategy: str
) -> None:
    ranks = scenario(world, paths, ("hf", backend, strategy))
    assert_same(ranks[0]["state"], reference_state(Path(paths["hf"])), (world, backend, strategy))
    # The RoPE table is computed by the model's init_weights on every rank, not loaded.
    assert all(r["rope_computed"] for r in ranks)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_checkpoint_converts_to_the_model_dtype(
    paths: dict[str, str], world: int, backend: str
) -> None:
    ranks = scenario(world, paths, ("bf16", backend))
    want = {k: v.bfloat16().float() for k, v in reference_state(Path(paths["hf"])).items()}
    assert_same(ranks[0]["state"], want, (world, backend))
    for rank in ranks:
        (event,) = rank["events"]
        assert event["event"] == "converted_dtypes"
        assert event["conversions"] == {"bfloat16->float32": len(want)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0_read_without_a_shared_filesystem(
    paths: dict[str, str], world: int, backend: str
) -> None:
    got = scenario(world, paths, ("rank0", backend))[0]["state"]
    assert_same(got, reference_state(Path(paths["hf"])), (world, backend))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_folder_saved_on_one_process_loads(
    paths: dict[str, str], world: int, backend: str
) -> None:
    got = scenario(world, paths, ("dcp_plain", backend))[0]["state"]
    assert_same(got, reference_state(Path(paths["hf"])), (world, backend))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_dcp_folder_converts_to_the_model_dtype(
    paths: dict[str, str], world: int, backend: str
) -> None:
    ranks = scenario(world, paths, ("dcp_bf16", backend))
    want = {k: v.bfloat16().float() for k, v in reference_state(Path(paths["hf"])).items()}
    assert_same(ranks[0]["state"], want, (world, backend))
    assert [e["event"] for e in ranks[-1]["events"]] == ["converted_dtypes"]


DCP_LOADS = [(w, b, s) for w in MULTI for b in BACKENDS for s in STRATEGIES[w]]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "backend", "strategy"), DCP_LOADS)
def test_dcp_folder_saved_from_a_sharded_model_loads(
    paths: dict[str, str], world: int, backend: str, strategy: str
) -> None:
    scenario(world, paths, "dcp_save")
    got = scenario(world, paths, ("dcp", backend, strategy))[0]["state"]
    assert_same(got, reference_state(Path(paths["hf"])), (world, backend, strategy))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
def test_strict_false_keeps_real_states_and_reports_the_rest(
    paths: dict[str, str], world: int
) -> None:
    ranks = scenario(world, paths, "partial")
    want = reference_state(Path(paths["hf"]))
    want["output.weight"] = ranks[0]["kept"]
    assert_same(ranks[0]["state"], want, world)
    (event,) = ranks[0]["events"]
    assert event["missing"] == ["output.weight"]
    assert event["unexpected"] == ["model.rotary_emb.inv_freq"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", MULTI)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_local_load_sends_no_weight_bytes(
    paths: dict[str, str], world: int, backend: str
) -> None:
    local = scenario(world, paths, ("counted", backend, True))
    rank0 = scenario(world, paths, ("counted", backend, False))
    weights = sum(v.numel() * 4 for v in hf_state().values())
    for rank in range(world):
        # Only the agreements' pairs of int64 travel (16 bytes per rank).
        assert 0 < local[rank]["largest"] <= 64, local[rank]
        assert local[rank]["total"] < weights // 100, local[rank]
    # The counter sees weights when they do travel: rank 0 scatters / broadcasts them.
    assert rank0[0]["total"] >= weights // world
    assert [r["read"] for r in rank0] == [weights] + [0] * (world - 1)
    if backend == "fsdp2":  # each rank reads its own rows: every byte once, over all ranks
        assert sum(r["read"] for r in local) == weights
        assert all(r["read"] < weights // world * 1.2 for r in local), local
    else:  # FSDP1 keeps its shard of whole units that every rank reads
        assert all(r["read"] == weights for r in local), local


EXPECTED = {
    "missing_file": "names shard file(s) that do not exist: model-00002-of-00003.safetensors",
    "absent_key": "1 key(s) in its index but not in their file: model.layers.1.mlp.up_proj.bias",
    "truncated": "model-00003-of-00003.safetensors', which is truncated or not a safetensors",
    "other_model": "of the model's 30 states are in it: a checkpoint of another model",
    "wrong_shape": "30 wrong shape(s): 'model.layers.0.input_layernorm.weight' is [48] in the "
    "checkpoint but [32] in the model",
    "missing_key": "1 missing key(s): output.weight",
    "int_dtype": "'model.norm.weight' is torch.int32 in the checkpoint but torch.float32",
    "no_metadata": "holds DCP shard files (*.distcp) but no .metadata file",
    "bad_index": "model.safetensors.index.json' is not readable JSON",
    "not_there": "does not exist on rank 0",
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", MULTI)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint_raises_one_clear_error_everywhere(
    paths: dict[str, str], world: int, backend: str, case: str
) -> None:
    ranks = scenario(world, paths, ("bad", case, backend))
    expected = EXPECTED[case]
    for rank, outcome in enumerate(ranks):
        assert outcome is not None, (case, rank, "built")
        kind, message, untouched = outcome
        assert untouched, (case, rank)
        if case == "not_there":  # each rank names itself
            assert kind == ConfigurationError.__name__, message
            assert "does not exist on rank" in message, message
            continue
        assert (kind, message) == ranks[0][:2], (case, rank)
        assert kind == ConfigurationError.__name__, message
        assert expected in message, message


def test_key_map_forms() -> None:
    from fsdp_builder.materializers.checkpoints import key_mapper

    assert key_mapper({"a": "b"})("a") == "b"
    assert key_mapper({"a": "b"})("c") == "c"
    assert key_mapper(KEY_MAP)("model.layers.3.self_attn.k_proj.weight") == (
        "layers.3.attention.wk.weight"
    )
    assert key_mapper(lambda k: None if k.startswith("x") else k.upper())("xy") is None
    with pytest.raises(ConfigurationError, match="is not a regex"):
        FromCheckpoint("x", key_map=[("(", "")])
    with pytest.raises(ConfigurationError, match="expected a dict"):
        FromCheckpoint("x", key_map=3)  # type: ignore[arg-type]


# -- resume: build → train → dcp.save (model + optimizer) → new ranks → build → continue -------

STEPS = 3


def _steps(model: nn.Module, optim: torch.optim.Optimizer, first: int, count: int) -> list[float]:
    """AdamW steps on this rank's slice of a batch fixed by the step number."""
    rank = dist.get_rank()
    losses = []
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, ARGS.vocab_size, (2 * dist.get_world_size(), 9), generator=gen)
        part = tokens[2 * rank : 2 * rank + 2]
        logits = model(part[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    return losses


def _model_key(key: str) -> str | None:
    """The DCP folder holds {"model": ..., "optim": ...}: load the model's part only."""
    return key.removeprefix("model.") if key.startswith("model.") else None


def train_and_save(backend: str, hf: str, folder: str) -> list[float]:
    """Build from the HF folder, train, save model and optimizer with DCP, train on: the
    losses of the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = builder(backend, "full").materialize(FromCheckpoint(hf, key_map=KEY_MAP))
    built = model.build(meta_llama(ARGS))
    optim = torch.optim.AdamW(built.parameters(), lr=1e-2)
    losses = _steps(built, optim, 0, STEPS)
    model_sd, optim_sd = get_state_dict(built, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    return losses + _steps(built, optim, STEPS, STEPS)


def resume(backend: str, folder: str) -> list[float]:
    """New ranks: build from the DCP folder, load the optimizer with PyTorch's own APIs,
    continue."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

    b = builder(backend, "full").materialize(FromCheckpoint(folder, key_map=_model_key))
    built = b.build(meta_llama(ARGS))
    optim = torch.optim.AdamW(built.parameters(), lr=1e-2)
    _, optim_sd = get_state_dict(built, optim)
    dcp.load({"optim": optim_sd}, checkpoint_id=folder)
    set_optimizer_state_dict(built, optim, optim_sd)
    return _steps(built, optim, STEPS, STEPS)


def train_and_save_all(hf: str, root: str) -> Results:
    return run_each((b, partial(train_and_save, b, hf, f"{root}/{b}")) for b in BACKENDS)


def resume_all(root: str) -> Results:
    return run_each((b, partial(resume, b, f"{root}/{b}")) for b in BACKENDS)


# Resuming needs new ranks: a second spawn, after the first one saved.
UNINTERRUPTED = Spawns(train_and_save_all, timeout=300)
RESUMED = Spawns(resume_all, timeout=300)


@pytest.fixture(scope="module")
def resume_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("resume"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_from_dcp_continues_the_uninterrupted_run(
    paths: dict[str, str], resume_root: str, backend: str
) -> None:
    run = values(UNINTERRUPTED(2, paths["hf"], resume_root), backend)
    again = values(RESUMED(2, resume_root), backend)
    for rank in range(2):
        want, got = run[rank][STEPS:], again[rank]
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=0), (
            rank,
            want,
            got,
        )
