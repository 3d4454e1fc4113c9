"""Checkpoint folders a user can end up with by accident or by tampering, each refused before the
model is touched, in a message that names the file at fault:

- a DCP ``.metadata`` naming its data files as ``pathlib`` paths outside the folder (or as
  something that is no path at all), or whose storage records are not DCP's;
- a file where a checkpoint file is expected that is a named pipe: opening it would wait for a
  writer forever, on every rank (the dry run too);
- a folder holding two checkpoints of different formats (an export into the DCP folder a model
  was loaded from), and the export that would make one;
- a ``key_map`` of the wrong type given to ``save_hf_checkpoint``.

Reference values come from plain PyTorch (the model's own ``state_dict``), files are written with
torch's ``dcp.save`` and safetensors' ``save_file``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed as dist
from isolated import START_METHOD
from safetensors.torch import save_file
from test_checkpoint_safety import meta_model, plain_model
from torch import nn

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    FromCheckpoint,
    FSDPBuilder,
    FullyShardBuilder,
    save_hf_checkpoint,
)
from fsdp_builder.tools.launch import run_ranks


def fsdp1(path: Path | str, seconds: float | None = None) -> FSDPBuilder:
    builder = FSDPBuilder().device(CPUDevice()).materialize(FromCheckpoint(str(path)))
    return builder.timeout(seconds) if seconds is not None else builder


def fsdp2(path: Path | str) -> FullyShardBuilder:
    return (
        FullyShardBuilder()
        .device(CPUDevice())
        .wrap(nn.Linear)
        .materialize(FromCheckpoint(str(path)))
    )


def save_dcp(folder: Path, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def rewrite_metadata(folder: Path, change: Callable[[Any], None]) -> None:
    """Apply ``change`` to ``folder``'s real ``.metadata`` (our own file, written just before)."""
    with open(folder / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def every_file(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b""
        for p in sorted(folder.rglob("*"))
    }


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """An FSDP1 model's full state dict (torch's default FULL_STATE_DICT) on one rank."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- DCP data files named by pathlib paths -------------------------------------------------------


@pytest.fixture
def two_dcp(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The checkpoint to load, and another one beside it (other weights, same file names)."""
    state = plain_model(seed=0).state_dict()
    folder, other = tmp_path / "ckpt", tmp_path / "other"
    save_dcp(folder, state)
    save_dcp(other, plain_model(seed=1).state_dict())
    return folder, other, state


@pytest.mark.parametrize("how", ["absolute", "climbs out", "climbs out after a folder"])
def test_a_dcp_data_file_named_by_a_pathlib_path_outside_the_folder_is_refused(
    world1: None, two_dcp: tuple[Path, Path, dict[str, torch.Tensor]], how: str
) -> None:
    folder, other, _ = two_dcp

    def elsewhere(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            name = str(info.relative_path)
            info.relative_path = {
                "absolute": Path(other / name),
                "climbs out": PurePosixPath("..", "other", name),
                "climbs out after a folder": PurePosixPath("sub", "..", "..", "other", name),
            }[how]

    rewrite_metadata(folder, elsewhere)
    model = meta_model()
    with pytest.raises(ConfigurationError, match=r"outside the folder: .*__0_0\.distcp") as info:
        fsdp1(folder).build(model)
    assert str(folder) in str(info.value)
    assert all(p.is_meta for p in model.parameters())  # refused before the model was touched


def test_a_dcp_data_file_named_by_a_pathlib_path_inside_the_folder_still_loads(
    world1: None, two_dcp: tuple[Path, Path, dict[str, torch.Tensor]]
) -> None:
    folder, _, state = two_dcp

    def as_paths(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = PurePosixPath(info.relative_path)

    rewrite_metadata(folder, as_paths)
    got = full_state(fsdp1(folder).build(meta_model()))
    assert got.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", [42, b"__0_0.distcp", None])
def test_a_dcp_data_file_named_by_something_not_a_path_is_refused(
    world1: None, two_dcp: tuple[Path, Path, dict[str, torch.Tensor]], name: Any
) -> None:
    folder, _, _ = two_dcp

    def renamed(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = name

    rewrite_metadata(folder, renamed)
    model = meta_model()
    with pytest.raises(ConfigurationError) as info:
        fsdp1(folder).build(model)
    message = str(info.value)
    assert str(folder / ".metadata") in message, message
    assert f"{type(name).__name__} {name!r}" in message and "file name" in message, message
    assert all(p.is_meta for p in model.parameters())


# -- DCP storage records that are not DCP's -------------------------------------------------------


def _as_tuples(metadata: Any) -> None:
    metadata.storage_data = {
        key: (info.relative_path, info.offset, info.length)
        for key, info in metadata.storage_data.items()
    }


def _one_dropped(metadata: Any) -> None:
    first = next(iter(metadata.storage_data))
    del metadata.storage_data[first]


def _offset_as_text(metadata: Any) -> None:
    for info in metadata.storage_data.values():
        info.offset = str(info.offset)


def _keys_as_text(metadata: Any) -> None:
    metadata.storage_data = {key.fqn: info for key, info in metadata.storage_data.items()}


def _dtype_as_text(metadata: Any) -> None:
    for entry in metadata.state_dict_metadata.values():
        entry.properties.dtype = "float32"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_as_tuples, r"record of '0\.weight' that is tuple \('__0_0\.distcp', 0, \d+\), not"),
        (_one_dropped, r"has no storage record for .*'0\.weight'"),
        (_offset_as_text, r"storage record of '0\.weight' whose offset is str '0', not"),
        (_keys_as_text, r"storage record key that is str '0\.weight', not"),
        (_dtype_as_text, r"entry '0\.weight' has the dtype str 'float32', not"),
    ],
)
def test_a_dcp_metadata_with_records_not_dcp_s_is_refused_before_sharding(
    world1: None,
    two_dcp: tuple[Path, Path, dict[str, torch.Tensor]],
    change: Callable[[Any], None],
    said: str,
) -> None:
    """FSDP2 would otherwise shard the model and fail in ``dcp.load`` at the first unit."""
    folder, _, _ = two_dcp
    rewrite_metadata(folder, change)
    model = meta_model()
    with pytest.raises(ConfigurationError) as info:
        fsdp2(folder).build(model)
    message = str(info.value)
    assert re.search(said, message), message
    assert str(folder / ".metadata") in message, message
    assert "\n" not in message and "Traceback" not in message, message
    assert all(p.is_meta for p in model.parameters())
    assert not any(hasattr(m, "_get_fsdp_state") for m in model.modules())  # never sharded


# -- named pipes where checkpoint files belong ----------------------------------------------------


def _safetensors(folder: Path, state: dict[str, torch.Tensor], name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / name))


def pipe_folders(root: Path) -> dict[str, tuple[Path, str]]:
    """Each case: the path to load, and the file in it that is a named pipe."""
    state = plain_model().state_dict()
    keys = sorted(state)
    cases: dict[str, tuple[Path, str]] = {}

    single = root / "single"
    single.mkdir()
    os.mkfifo(single / "model.safetensors")
    cases["the one .safetensors of a folder"] = (single, "model.safetensors")

    cases["a .safetensors file passed as the path"] = (
        single / "model.safetensors",
        "model.safetensors",
    )

    sharded = root / "sharded"
    _safetensors(sharded, {k: state[k] for k in keys[:3]}, "model-00001-of-00002.safetensors")
    os.mkfifo(sharded / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + (i >= 3)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cases["a shard an index names"] = (sharded, "model-00002-of-00002.safetensors")

    index = root / "index"
    _safetensors(index, state, "model-00001-of-00001.safetensors")
    os.mkfifo(index / "model.safetensors.index.json")
    cases["the index of a folder"] = (index, "model.safetensors.index.json")

    beside = root / "beside"
    _safetensors(beside, state, "model.safetensors")
    os.mkfifo(beside / "other.index.json")
    cases["an index beside the file loaded"] = (beside / "model.safetensors", "")

    data = root / "dcp-data"
    save_dcp(data, state)
    for file in data.glob("*.distcp"):
        file.unlink()
        os.mkfifo(file)
    cases["a DCP data file"] = (data, "__0_0.distcp")

    metadata = root / "dcp-metadata"
    save_dcp(metadata, state)
    (metadata / ".metadata").unlink()
    os.mkfifo(metadata / ".metadata")
    cases["a DCP .metadata"] = (metadata, ".metadata")

    torch_file = root / "torch"
    torch_file.mkdir()
    os.mkfifo(torch_file / "pytorch_model.bin")
    cases["the one .bin of a folder"] = (torch_file, "pytorch_model.bin")
    return cases


def _outcome(run: Callable[[], Any]) -> dict[str, Any]:
    try:
        run()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def load_each(cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """On each rank: every case built with a 10 s timeout, and the dry run of the first one."""
    from fsdp_builder.tools.dryrun import simulate

    found: dict[str, Any] = {}
    for name, (path, _) in cases.items():
        model = meta_model()
        found[name] = _outcome(lambda: fsdp1(path, seconds=10).build(model))  # noqa: B023
        found[name]["untouched"] = all(p.is_meta for p in model.parameters())
    if dist.get_rank() == 0:
        # The dry run sets up torch's fake process group of its own.
        dist.destroy_process_group()
        first = next(iter(cases.values()))[0]
        run = simulate(lambda: fsdp1(first), plain_model, 2, ranks=(0, 1))
        found["dry run"] = [{"type": r.error_type, "message": r.error} for r in run.runs]
    return found


@pytest.mark.timeout(240)
def test_a_named_pipe_where_a_checkpoint_file_belongs_is_refused_not_waited_on(
    tmp_path: Path,
) -> None:
    """Ranks (and a dry run) in processes of their own with a deadline: before the refusal,
    ``open`` of a named pipe waits for a writer forever."""
    cases = pipe_folders(tmp_path)
    per_rank = run_ranks(
        load_each,
        2,
        {k: (str(p), f) for k, (p, f) in cases.items()},
        timeout=150,
        start_method=START_METHOD,
    )
    for rank, found in enumerate(per_rank):
        for name, (_, pipe) in cases.items():
            outcome = found[name]
            where = f"rank {rank}, {name}"
            if not pipe:  # a stray pipe beside the file loaded is no reason to refuse it
                assert outcome["type"] is None, (where, outcome)
                continue
            assert outcome["type"] == "ConfigurationError", (where, outcome)
            message = outcome["message"]
            assert "named pipe" in message and "not a regular file" in message, (where, message)
            assert pipe in message, (where, message)
            assert outcome["untouched"], where
    for rank, run in enumerate(per_rank[0]["dry run"]):
        assert run["type"] == "ConfigurationError", (rank, run)
        assert "named pipe" in run["message"], (rank, run)


# -- two checkpoints in one folder ---------------------------------------------------------------


def test_an_export_into_the_dcp_folder_loaded_from_is_refused(
    world1: None, two_dcp: tuple[Path, Path, dict[str, torch.Tensor]]
) -> None:
    folder, _, _ = two_dcp
    model = fsdp1(folder).build(meta_model())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)  # "trained"
    before = every_file(folder)
    with pytest.raises(ConfigurationError) as info:
        save_hf_checkpoint(model, folder)
    message = str(info.value)
    assert "DCP" in message and str(folder / ".metadata") in message, message
    assert "fresh folder" in message, message
    assert every_file(folder) == before  # nothing written, the DCP checkpoint as it was


def test_an_export_into_a_fresh_folder_still_loads_back(
    world1: None, two_dcp: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder, _, _ = two_dcp
    model = fsdp1(folder).build(meta_model())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    want = full_state(model)
    save_hf_checkpoint(model, tmp_path / "trained")
    got = full_state(fsdp1(tmp_path / "trained").build(meta_model()))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize(
    "hf", ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin.index.json"]
)
def test_a_folder_holding_a_dcp_and_a_hugging_face_checkpoint_is_refused(
    world1: None, two_dcp: tuple[Path, Path, dict[str, torch.Tensor]], hf: str
) -> None:
    folder, _, state = two_dcp
    trained = {k: v + 1 for k, v in state.items()}
    if hf == "model.safetensors":
        _safetensors(folder, trained, hf)
    else:
        shard = hf.replace(".index.json", "").replace("model", "model-00001-of-00001")
        if shard.endswith(".safetensors"):
            _safetensors(folder, trained, shard)
        else:
            torch.save(trained, folder / shard)
        (folder / hf).write_text(json.dumps({"weight_map": dict.fromkeys(trained, shard)}))
    model = meta_model()
    with pytest.raises(ConfigurationError) as info:
        fsdp1(folder).build(model)
    message = str(info.value)
    assert "two checkpoints" in message, message
    assert ".metadata" in message and hf in message, message
    assert all(p.is_meta for p in model.parameters())


def test_a_hugging_face_folder_with_safetensors_and_bin_weights_still_loads(
    world1: None, tmp_path: Path
) -> None:
    """A Hub snapshot often holds the same weights in both formats: safetensors is read."""
    state = plain_model().state_dict()
    _safetensors(tmp_path, state, "model.safetensors")
    torch.save({k: v + 1 for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    got = full_state(fsdp1(tmp_path).build(meta_model()))
    for key, value in state.items():
        assert torch.equal(got[key], value), key


# -- save_hf_checkpoint's key_map ----------------------------------------------------------------


@pytest.mark.parametrize("key_map", [42, "lm_head.weight", 1.5])
def test_a_key_map_of_another_type_is_named_with_its_value(tmp_path: Path, key_map: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        save_hf_checkpoint(nn.Linear(2, 2), tmp_path, key_map=key_map)
    message = str(info.value)
    assert f"got {type(key_map).__name__} {key_map!r}" in message, message
    assert "a dict" in message and "a callable" in message, message
    assert not any(tmp_path.iterdir())
