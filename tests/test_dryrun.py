"""The dry run (``fsdp_builder.tools.dryrun``) against the real build.

One spawn of 2 gloo ranks and one of 4 run the real builds; the dry run simulates the same
configurations in the test process on torch's fake process group. Expected values come from
the real builds, inspected with plain PyTorch (local shards of FSDP2's DTensors, FSDP1's flat
parameters) or measured (the kernel's resident high-water mark), and from
``safetensors.torch.load_file``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from isolated import Results, Spawns, run_each, values
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.dryrun_scale import (
    PEAK_BUILDERS,
    PEAK_MODELS,
    fixed_mmap_threshold,
    measured_peak,
    peak_builder,
)
from fsdp_builder import (
    AutoHybridGroups,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    KeepAsIs,
    ShardingBuilder,
)
from fsdp_builder.errors import ConfigurationError
from fsdp_builder.runtime.agreement import agree
from fsdp_builder.tools.cli import main
from fsdp_builder.tools.demo import Block, DemoConfig, DemoTransformer
from fsdp_builder.tools.dryrun import fake_world, simulate

TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)


def demo() -> nn.Module:
    return DemoTransformer(DemoConfig())


def llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))


MODELS: dict[str, Callable[[], nn.Module]] = {"demo": demo, "llama": llama}
BUILDERS: dict[str, type[ShardingBuilder]] = {"fsdp1": FSDPBuilder, "fsdp2": FullyShardBuilder}


def _checkpoint(path: str) -> str:
    return str(Path(path) / "demo.safetensors")


def _missing_key_checkpoint(path: str) -> str:
    return str(Path(path) / "missing.safetensors")


# Configurations the real job refuses, each a factory of the job's builder (called on every
# rank, after the process group is up, as a training script calls it). ``path``: a folder
# holding the test's checkpoints.
def error_builders(path: str) -> dict[str, Callable[[], ShardingBuilder]]:
    return {
        "nodes_of_3": lambda: (
            FSDPBuilder()
            .wrap(Block)
            .groups(AutoHybridGroups(devices_per_node=3))
            .sharding("hybrid")
        ),
        "hybrid_groups_full_shard": lambda: (
            FSDPBuilder().wrap(Block).groups(AutoHybridGroups(devices_per_node=1))
        ),
        "reshard_after_forward_3": lambda: FullyShardBuilder().wrap(Block).reshard_after_forward(3),
        "fsdp1_option_on_fsdp2": lambda: (
            FullyShardBuilder().wrap(Block).per_unit(lambda module, fqn: {"use_orig_params": True})
        ),
        "missing_key": lambda: (
            FullyShardBuilder()
            .wrap(Block)
            .materialize(FromCheckpoint(_missing_key_checkpoint(path)))
        ),
        "keep_as_is_on_meta": lambda: FSDPBuilder().wrap(Block).materialize(KeepAsIs()),
        "wrap_class_absent": lambda: FSDPBuilder().wrap(nn.GRU),
    }


def bytes_builder(backend: str, model: str) -> ShardingBuilder:
    builder = BUILDERS[backend]()
    return builder.wrap(Block) if model == "demo" else builder


def load_builder(backend: str, path: str) -> ShardingBuilder:
    return BUILDERS[backend]().wrap(Block).materialize(FromCheckpoint(_checkpoint(path)))


def write_checkpoints(folder: Path) -> None:
    state = {k: v.contiguous() for k, v in demo().state_dict().items()}
    save_file(state, _checkpoint(str(folder)))
    state.pop("embed.weight")
    save_file(state, _missing_key_checkpoint(str(folder)))


# -- what a real build holds, read with plain PyTorch ---------------------------------------------


def local_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each rank-local tensor of a built model: FSDP1's flat parameters, FSDP2's local shards."""
    flats: list[tuple[str, torch.Tensor]] = [
        (name, m._handle.flat_param)
        for name, m in module.named_modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None
    ]
    if flats:
        return flats
    return [
        (name, p.to_local() if isinstance(p, DTensor) else p)
        for name, p in module.named_parameters()
    ]


def local_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for _, t in local_tensors(module))


def real_error(factory: Callable[[], ShardingBuilder]) -> tuple[str, str] | None:
    with torch.device("meta"):
        model = demo()
    try:
        factory().build(model)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def real_load(backend: str, path: str) -> dict[str, Any]:
    """A real FromCheckpoint load: the bytes this rank keeps of each checkpoint tensor."""
    with torch.device("meta"):
        model = demo()
    built = load_builder(backend, path).build(model)
    shards = {
        name.replace("_fsdp_wrapped_module.", ""): p.to_local().numel()
        for name, p in built.named_parameters()
        if isinstance(p, DTensor)
    }
    return {"shard_numel": shards, "local_bytes": local_bytes(built)}


def cases(path: str) -> Iterator[tuple[Hashable, Callable[[], Any]]]:
    if dist.get_world_size() == 2:
        for name, factory in error_builders(path).items():
            yield ("error", name), partial(real_error, factory)
        for backend in BUILDERS:
            yield ("load", backend), partial(real_load, backend, path)
    for backend in BUILDERS:
        for model in MODELS:

            def build(backend: str = backend, model: str = model) -> int:
                with torch.device("meta"):
                    meta = MODELS[model]()
                return local_bytes(bytes_builder(backend, model).build(meta))

            yield ("bytes", backend, model), build


def rank_main(path: str) -> Results:
    torch.manual_seed(0)
    return run_each(cases(path))


SPAWNS = Spawns(rank_main, timeout=240)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dryrun")
    write_checkpoints(path)
    return path


# -- (1) the same errors ----------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(error_builders("")))
def test_dry_run_raises_what_a_real_two_rank_build_raises(name: str, folder: Path) -> None:
    real = values(SPAWNS(2, str(folder)), ("error", name))
    assert real[0] is not None, f"the real build of {name} did not fail"
    assert real[0] == real[1]
    run = simulate(error_builders(str(folder))[name], demo, 2, ranks=(0, 1), local_world_size=2)
    for rank in run.runs:
        assert not rank.ok
        assert (rank.error_type, rank.error) == real[0]


# -- (2) bytes: shards and reads --------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("backend", list(BUILDERS))
def test_predicted_shard_bytes_equal_the_real_builds(
    backend: str, model: str, world: int, folder: Path
) -> None:
    measured = values(SPAWNS(world, str(folder)), ("bytes", backend, model))
    run = simulate(partial(bytes_builder, backend, model), MODELS[model], world, ranks=range(world))
    assert [r.error for r in run.runs] == [None] * world
    assert [r.param_bytes for r in run.runs] == measured


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", list(BUILDERS))
def test_read_plan_bytes_equal_a_real_load(backend: str, folder: Path) -> None:
    real = values(SPAWNS(2, str(folder)), ("load", backend))
    stored = load_file(_checkpoint(str(folder)))
    if backend == "fsdp2":
        # Each rank reads the rows of its own shards, in the checkpoint's dtype.
        expected = [
            sum(n * stored[name].element_size() for name, n in r["shard_numel"].items())
            for r in real
        ]
    else:
        # FSDP1 takes each unit whole on every rank before sharding it.
        expected = [sum(t.numel() * t.element_size() for t in stored.values())] * 2
    run = simulate(partial(load_builder, backend, str(folder)), demo, 2, ranks=(0, 1))
    assert [r.read_bytes for r in run.runs] == expected
    assert [r.param_bytes for r in run.runs] == [r["local_bytes"] for r in real]
    assert run.read_balance == 1.0
    # Every read is a run of whole rows of the tensor it names, its bytes those rows'.
    for r in run.runs:
        for x in r.reads:
            assert x.rows is not None
            first, stop = x.rows
            tensor = stored[x.key]
            assert 0 <= first <= stop <= (len(tensor) if tensor.dim() else 1)
            assert x.nbytes == tensor[first:stop].nbytes if tensor.dim() else tensor.nbytes
    if backend == "fsdp2":
        first_rank, second_rank = (
            {(x.key, row) for x in r.reads for row in range(*x.rows or ())} for r in run.runs
        )
        assert not first_rank & second_rank  # the two ranks read disjoint rows


# -- (3) per-rank build peak ------------------------------------------------------------------


def peak_main() -> Results:
    fixed_mmap_threshold()
    return run_each(
        ((b, m), partial(measured_peak, b, m)) for m in PEAK_MODELS for b in PEAK_BUILDERS
    )


PEAK_SPAWNS = Spawns(peak_main, timeout=200)


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resident high-water mark"
)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", list(PEAK_MODELS))
@pytest.mark.parametrize("builder", list(PEAK_BUILDERS))
def test_predicted_build_peak_is_within_10_percent_of_the_real_builds(
    builder: str, model: str, world: int
) -> None:
    measured = values(PEAK_SPAWNS(world), (builder, model))
    made = PEAK_MODELS[model][0]
    run = simulate(partial(peak_builder, builder, model), made, world, ranks=range(world))
    predicted = [r.build_peak for r in run.runs]
    assert all(abs(p - m) <= 0.1 * m for p, m in zip(predicted, measured, strict=True)), (
        f"predicted {predicted}, measured {measured}"
    )


def test_training_step_peak_from_fsdp_mem_tracker() -> None:
    def step(model: nn.Module) -> torch.Tensor:
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16))
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss

    fsdp2 = simulate(FullyShardBuilder, llama, 8, ranks=(0,), step=step).runs[0]
    assert fsdp2.ok, fsdp2.error
    assert fsdp2.step_peak is not None, fsdp2.step_note
    # Shards of 1/8 of each parameter's rows (torch.chunk), and AdamW's two states of each.
    shards = sum(torch.chunk(torch.empty(p.shape), 8)[0].nbytes for p in llama().parameters())
    assert fsdp2.step_peak["parameters"] == shards
    assert 2 * shards <= fsdp2.step_peak["optimizer state"] <= 2 * shards + 4 * 64  # + steps
    assert fsdp2.step_peak["total"] > shards * 3
    # FSDP1 through torch's MemTracker: its flat shards, padded to a multiple of 8 elements.
    fsdp1 = simulate(FSDPBuilder, llama, 8, ranks=(0,), step=step).runs[0]
    assert fsdp1.ok and fsdp1.step_peak is not None, fsdp1.step_note
    flat = sum(p.numel() for p in llama().parameters())
    assert 2 * flat * 4 // 8 <= fsdp1.step_peak["optimizer state"] <= 2 * (flat + 64) * 4 // 8 + 256
    # Each rank's parameters part is its padded shards, rank 0's chunk of every parameter (the
    # last rank's padded rows of the 300-row embedding once counted as an activation).
    first, last = simulate(FullyShardBuilder, llama, 8, ranks=(0, 7), step=step).runs
    assert last.param_bytes < shards  # the last rank's shards are padded to torch.chunk's
    for r in (first, last):
        assert r.step_peak is not None and r.step_peak["parameters"] == shards, r.rank
    # Without an optimizer there is no optimizer state.
    sgd = simulate(FullyShardBuilder, llama, 8, ranks=(0,), step=step, optimizer=None).runs[0]
    assert sgd.step_peak is not None and not sgd.step_peak.get("optimizer state")


# -- (4) scale ----------------------------------------------------------------------------------


# How long this takes is measured by `python -m benchmarks.dryrun_scale --timings`, not here: a
# test's wall clock depends on whatever else the machine runs.
@pytest.mark.timeout(300)
def test_a_transformers_llama_at_1024_ranks() -> None:
    world = 1024
    fsdp2 = simulate(FullyShardBuilder, llama, world, ranks=(0, 1023))
    fsdp1 = simulate(FSDPBuilder, llama, world, ranks=(0, 1023))
    plain = llama()
    full = dict(plain.named_parameters())
    for r in fsdp2.runs:
        assert r.ok, r.error
        expected = {}
        for name, p in full.items():
            chunks = torch.chunk(torch.empty(p.shape, device="meta"), world)
            rows = tuple(chunks[r.rank].shape) if r.rank < len(chunks) else (0, *p.shape[1:])
            expected[name] = rows
        assert {s.name: s.local_shape for s in r.shards} == expected
        # FSDP2 pads every rank's shard to ceil(rows / world) rows; the last rank holds padding
        # only, as many bytes as rank 0.
        padded = sum(
            math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * 4 for p in full.values()
        )
        assert r.build_peak is not None and r.build_peak >= padded
    blocks: Any = plain.get_submodule("model.layers")
    layers = [sum(p.numel() for p in layer.parameters()) for layer in blocks]
    root = sum(p.numel() for p in full.values()) - sum(layers)
    flat = sum(math.ceil(n / world) for n in [*layers, root]) * 4
    for r in fsdp1.runs:
        assert r.ok, r.error
        assert r.param_bytes == flat


def test_agreements_on_the_fake_process_group_gather_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's fake group answers every rank's slot with this rank's own notes: the agreement's
    # answer is known without gathering a world of copies (a million here).
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("gathered")

    monkeypatch.setattr(dist, "all_gather", refuse)
    monkeypatch.setattr(dist, "all_gather_object", refuse)
    with fake_world(2**20, 7):
        assert agree("stage", flag=True) is True
        assert agree("stage") is False
        mine = ValueError("this rank's error")
        with pytest.raises(ValueError) as raised:
            agree("stage", mine)
        assert raised.value is mine


def test_cli_simulates_a_config_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--simulate", "64", "--rank", "0", "--rank", "63"]
    assert main([*args, "--backend", "fsdp2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranks"]] == [0, 63]
    total = sum(p.numel() * 4 for p in llama().parameters())
    assert 0 < out["ranks"][1]["param_bytes"] <= out["ranks"][0]["param_bytes"] < total
    # A layout the job would refuse: the exit status says so, the report says why.
    bad = [*args, "--backend", "fsdp1", "--strategy", "hybrid", "--devices-per-node", "3"]
    assert main(bad) == 1
    assert "world size 64 is not a multiple of 3 devices per node" in capsys.readouterr().out


def test_cli_text_report_lists_each_ranks_shards_and_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The report people read (no --json): each listed shard and read is held to torch.chunk's
    # rows of the plain model's parameters.
    LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    plain = dict(llama().named_parameters())
    save_file({n: p.detach() for n, p in plain.items()}, str(tmp_path / "model.safetensors"))
    world = 4
    args = ["plan", str(tmp_path), "--simulate", str(world), "--rank", "0", "--rank", "3"]
    assert main([*args, "--backend", "fsdp2", "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"world size {world}" in out

    def rows(name: str, rank: int) -> list[int]:
        return list(torch.chunk(torch.empty(plain[name].shape, device="meta"), world)[rank].shape)

    for rank, section in zip([0, 3], out.split("\nrank ")[1:], strict=True):
        assert section.startswith(f"{rank} (") and "build peak" in section, section
        shard_lines = [ln.split() for ln in section.splitlines() if " -> " in ln]
        read_lines = [ln.split() for ln in section.splitlines() if ".safetensors: " in ln]
        assert shard_lines and read_lines
        for name, *rest in shard_lines:
            shapes = " ".join(rest).split(" -> ")
            assert shapes[0] == str(list(plain[name].shape))
            assert shapes[1].startswith(str(rows(name, rank)))
        for line in read_lines:
            key, nbytes = line[1], int(line[-2].lstrip("("))
            assert nbytes == math.prod(rows(key, rank)) * plain[key].element_size()


def test_a_recorded_reads_bytes_and_rows_for_every_stored_dtype(tmp_path: Path) -> None:
    # Shapes and dtypes from safetensors, as the loader's source reads them: packed FP4 counts
    # two values a byte, as a real read takes it.
    from test_safetensors_dtypes import every_dtype

    from fsdp_builder.sources.hf_safetensors import open_file
    from fsdp_builder.tools.dryrun import _read_of

    file = tmp_path / "every.safetensors"
    save_file(every_dtype(), str(file))
    source = open_file(file)
    header = dict(source.tensors())
    source.close()
    for key, full in load_file(str(file)).items():
        rows: list[tuple[Any, tuple[int, int] | None]] = [
            (None, (0, len(full) if full.dim() else 1))
        ]
        if full.dim():  # 9 rows, or none ("empty")
            whole = len(full) == 9
            rows.append(((slice(2, 7),), (2, 7) if whole else (0, 0)))
            rows.append(((slice(1, None, 3),), None if whole else (0, 0)))  # every third row
            rows.append(((slice(0, 2), slice(1, 3)), None))  # part of each row
        for index, expected in rows:
            read = _read_of(file, key, index, header[key])
            assert read.nbytes == (full[index] if index else full).nbytes, (key, index)
            assert read.rows == expected, (key, index)


# -- (5) bad inputs, refused once and clearly; a shared builder is no false alarm ---------------


def test_a_world_size_beyond_torchs_process_groups_is_refused_naming_the_limit() -> None:
    # Before: torch's raw TypeError from ProcessGroup's constructor (its size is a C int).
    too_many = r"`world_size`: 1,099,511,627,776 .*at most 2,147,483,647"
    with pytest.raises(ConfigurationError, match=too_many):
        simulate(FullyShardBuilder, llama, 2**40)
    assert not dist.is_initialized()


@pytest.mark.parametrize("argument", ["builder_factory", "model_factory"])
def test_a_factory_that_is_not_callable_is_refused_once(argument: str) -> None:
    factories: dict[str, Any] = {"builder_factory": FullyShardBuilder, "model_factory": llama}
    factories[argument] = "FullyShardBuilder" if argument == "builder_factory" else "llama"
    with pytest.raises(ConfigurationError, match=rf"`{argument}`: expected a function"):
        simulate(factories["builder_factory"], factories["model_factory"], 4, ranks=(0, 1))
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_a_factory_returning_one_module_level_builder_simulates_every_rank(backend: str) -> None:
    # A real job's processes each build once, so `return BUILDER` is fine there; the dry run
    # builds once per simulated rank and must not report the second build as the job's error.
    shared = BUILDERS[backend]()
    world = 4
    run = simulate(lambda: shared, llama, world, ranks=range(world))
    assert [(r.rank, r.error) for r in run.runs] == [(r, None) for r in range(world)]
    plain = dict(llama().named_parameters())
    if backend == "fsdp2":
        for r in run.runs:
            expected = {
                n: tuple(torch.chunk(torch.empty(p.shape, device="meta"), world)[r.rank].shape)
                for n, p in plain.items()
            }
            assert {s.name: s.local_shape for s in r.shards} == expected
    else:
        total = sum(p.numel() for p in plain.values())
        assert all(world * r.param_bytes >= total * 4 for r in run.runs)
    # The job's own builder is left as it was: unbuilt, its device not replaced.
    assert shared._result is None and shared.config.device is None


def test_cli_builder_without_a_colon_names_the_expected_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--simulate", "2"]
    with pytest.raises(SystemExit, match=r"--builder: expected the form module:function"):
        main([*args, "--builder", "make_builder"])
    # A name that is not a function: refused once, naming it, not a TypeError per rank.
    (tmp_path / "dryrun_job_settings.py").write_text("BACKEND = 'fsdp2'\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        SystemExit, match=r"--builder dryrun_job_settings:BACKEND: BACKEND is a str"
    ):
        main([*args, "--builder", "dryrun_job_settings:BACKEND"])
    assert not dist.is_initialized()
