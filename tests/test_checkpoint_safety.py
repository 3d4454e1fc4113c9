"""What a checkpoint folder may make the library do, and what a failed export may not undo.

- A DCP ``.metadata`` is a pickle: one that names anything but DCP's metadata classes is refused
  before it can run code (plain ``FileSystemReader.read_metadata`` runs it).
- An index's ``weight_map`` (and a DCP ``.metadata``'s data files) may name files inside the
  checkpoint's folder only.
- A second ``save_hf_checkpoint`` into the folder of a complete one that fails at any point
  leaves the first one byte for byte; a peer rank that dies mid-export makes the survivor raise
  the library's error and clean up.

Reference values come from plain PyTorch (the model's own ``state_dict``) and files are read back
with ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from isolated import START_METHOD
from torch import nn

import fsdp_builder.export as export
from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    ExportError,
    FromCheckpoint,
    FSDPBuilder,
    save_hf_checkpoint,
)
from fsdp_builder.tools.launch import RankFailure, run_ranks


def plain_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return plain_model()


def build(path: Path, model: nn.Module | None = None) -> nn.Module:
    return (
        FSDPBuilder()
        .device(CPUDevice())
        .materialize(FromCheckpoint(str(path)))
        .build(model if model is not None else meta_model())
    )


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """An FSDP1 model's full state dict (torch's default FULL_STATE_DICT) on one rank."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def every_file(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes, hidden ones and those in subfolders
    included; each subfolder as its name and a ``/``."""
    found: dict[str, bytes] = {}
    for root, folders, names in os.walk(folder):
        for name in folders:
            found[f"{Path(root, name).relative_to(folder)}/"] = b""
        for name in names:
            path = Path(root, name)
            found[str(path.relative_to(folder))] = path.read_bytes()
    return found


# -- DCP .metadata --------------------------------------------------------------------------


def save_dcp(folder: Path, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


class RunsCode:
    """Unpickles as ``call(*args)``: what a crafted ``.metadata`` smuggles in."""

    def __init__(self, call: Callable[..., Any], *args: Any) -> None:
        self.call = call
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.call, self.args


def writes(marker: Path) -> dict[str, RunsCode]:
    """Payloads that each create ``marker`` when unpickled."""
    return {
        "os.system": RunsCode(os.system, f"touch '{marker}'"),
        "builtins.exec": RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "torch.save": RunsCode(torch.save, torch.zeros(1), str(marker)),
    }


def plant(folder: Path, payload: RunsCode) -> None:
    """Rewrite ``folder``'s real ``.metadata`` with ``payload`` inside it."""
    with open(folder / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # our own file, written by dcp.save just before
    metadata.planner_data = {"payload": payload}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.fixture
def dcp_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = plain_model().state_dict()
    folder = tmp_path / "dcp"
    save_dcp(folder, state)
    return folder, state


def test_the_crafted_metadata_runs_code_in_plain_dcp(
    dcp_folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """The payloads are real: torch's own reader runs each of them."""
    from torch.distributed.checkpoint import FileSystemReader

    folder, _ = dcp_folder
    for name, payload in writes(tmp_path / "ran").items():
        plant(folder, payload)
        FileSystemReader(str(folder)).read_metadata()
        assert (tmp_path / "ran").exists(), name
        (tmp_path / "ran").unlink()


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "torch.save"])
def test_a_metadata_that_would_run_code_is_refused_and_runs_nothing(
    world1: None, dcp_folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, payload: str
) -> None:
    folder, _ = dcp_folder
    marker = tmp_path / "ran"
    plant(folder, writes(marker)[payload])
    model = meta_model()
    # How pickle names each callable: its defining module.
    refused = {
        "os.system": r"(posix|nt)\.system",
        "builtins.exec": r"builtins\.exec",
        "torch.save": r"torch\.serialization\.save",
    }[payload]
    with pytest.raises(ConfigurationError) as info:
        build(folder, model)
    message = str(info.value)
    assert str(folder / ".metadata") in message
    assert re.search(f"refers to `{refused}`.*no code in it ran", message, re.S), message
    assert "trust" in message
    assert not marker.exists()
    assert all(p.is_meta for p in model.parameters())  # refused before the model was touched


def test_a_real_dcp_checkpoint_still_loads(
    world1: None, dcp_folder: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from fsdp_builder.sources.dcp_folder import read_metadata

    folder, state = dcp_folder
    plain = FileSystemReader(str(folder)).read_metadata()
    assert read_metadata(folder).state_dict_metadata == plain.state_dict_metadata
    assert read_metadata(folder).storage_data == plain.storage_data
    got = full_state(build(folder))
    assert got.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(got[key], value), key


def test_dcp_metadata_of_every_kind_of_entry_reads_as_torch_reads_it(tmp_path: Path) -> None:
    """Dtypes, a 0-dim tensor, channels-last, bytes entries: all admitted."""
    from torch.distributed.checkpoint import FileSystemReader

    from fsdp_builder.sources.dcp_folder import read_metadata

    state: dict[str, Any] = {
        "bf16": torch.zeros(3, dtype=torch.bfloat16),
        "fp8": torch.zeros(2, dtype=torch.float8_e4m3fn),
        "c64": torch.zeros(2, dtype=torch.complex64),
        "i64": torch.tensor(7),
        "nhwc": torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last),
        "step": 5,
        "names": ["a", "b"],
    }
    save_dcp(tmp_path, state)
    plain = FileSystemReader(str(tmp_path)).read_metadata()
    ours = read_metadata(tmp_path)
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data
    assert ours.planner_data == plain.planner_data


def test_a_dcp_data_file_outside_the_folder_is_refused(
    world1: None, dcp_folder: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder, _ = dcp_folder
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for data in folder.glob("*.distcp"):
        shutil.copy(data, elsewhere / data.name)
    with open(folder / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    for info in metadata.storage_data.values():
        info.relative_path = f"../elsewhere/{info.relative_path}"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    model = meta_model()
    with pytest.raises(ConfigurationError, match=r"outside the folder: \.\./elsewhere/__0_0"):
        build(folder, model)
    assert all(p.is_meta for p in model.parameters())


def test_a_truncated_dcp_data_file_is_refused_before_any_read(
    world1: None, dcp_folder: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    folder, _ = dcp_folder
    data = next(folder.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    model = meta_model()
    with pytest.raises(
        ConfigurationError,
        match=rf"shorter than its \.metadata says \(truncated\): {data.name}.*Copy the whole",
    ):
        build(folder, model)
    assert all(p.is_meta for p in model.parameters())


# -- the index's weight_map -----------------------------------------------------------------


def write_sharded(folder: Path, state: dict[str, torch.Tensor], shard_folder: Path) -> Path:
    """Two shard files, the second in ``shard_folder``; an index naming it by a path relative
    to ``folder``."""
    from safetensors.torch import save_file

    keys = sorted(state)
    first, second = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    folder.mkdir(parents=True, exist_ok=True)
    shard_folder.mkdir(parents=True, exist_ok=True)
    save_file({k: state[k] for k in first}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in second}, str(shard_folder / "x.safetensors"))
    second_name = os.path.relpath(shard_folder / "x.safetensors", folder)
    return index_naming(folder, first, second, second_name)


def index_naming(folder: Path, first: list[str], second: list[str], name: str) -> Path:
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(second, name))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("how", ["climbs out", "absolute"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(
    world1: None, tmp_path: Path, how: str
) -> None:
    state = plain_model().state_dict()
    folder = tmp_path / "ckpt"
    index = write_sharded(folder, state, tmp_path / "elsewhere")
    if how == "absolute":
        data = json.loads(index.read_text())
        data["weight_map"] = {
            k: (str(tmp_path / "elsewhere" / "x.safetensors") if "/" in v else v)
            for k, v in data["weight_map"].items()
        }
        index.write_text(json.dumps(data))
    entry = next(v for v in json.loads(index.read_text())["weight_map"].values() if "/" in v)
    model = meta_model()
    with pytest.raises(ConfigurationError) as info:
        build(folder, model)
    message = str(info.value)
    assert str(index) in message and f"'{entry}'" in message, message
    assert "outside the index's folder" in message and "next to the index" in message, message
    assert all(p.is_meta for p in model.parameters())


def test_a_bin_index_naming_a_shard_outside_its_folder_is_refused(
    world1: None, tmp_path: Path
) -> None:
    state = plain_model().state_dict()
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    torch.save(state, elsewhere / "pytorch_model.bin")
    weight_map = dict.fromkeys(state, "../elsewhere/pytorch_model.bin")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigurationError, match=r"'\.\./elsewhere/pytorch_model\.bin'.*outside"):
        build(folder)


def test_linked_shards_inside_the_folder_still_load(world1: None, tmp_path: Path) -> None:
    """The Hugging Face cache's layout: the folder holds links to files kept elsewhere."""
    state = plain_model().state_dict()
    folder = tmp_path / "snapshot"
    write_sharded(folder, state, tmp_path / "blobs")
    (folder / "x.safetensors").symlink_to(tmp_path / "blobs" / "x.safetensors")
    data = json.loads((folder / "model.safetensors.index.json").read_text())
    first = [k for k, v in data["weight_map"].items() if v.startswith("model-")]
    second = [k for k in data["weight_map"] if k not in first]
    index_naming(folder, first, second, "x.safetensors")
    got = full_state(build(folder))
    assert got.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(got[key], value), key


# -- a failed second export -----------------------------------------------------------------


def _raise_enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


@contextlib.contextmanager
def failing(where: str, folder: Path) -> Iterator[None]:
    """Make the export fail at ``where``."""
    if where == "index write":
        with mock.patch.object(export, "_write_index", _raise_enospc):
            yield
    elif where == "second shard":
        from safetensors.torch import save_file

        calls = iter(range(100))

        def save(*args: Any, **kwargs: Any) -> None:
            if next(calls) == 1:
                _raise_enospc()
            save_file(*args, **kwargs)

        with mock.patch("safetensors.torch.save_file", save):
            yield
    elif where == "moving the index in":
        replace = os.replace
        failed: list[Any] = []

        def moving(src: Any, dst: Any) -> None:
            # Once: putting the first export's index back is a rename too.
            if Path(dst) == folder / "model.safetensors.index.json" and not failed:
                failed.append(src)
                _raise_enospc()
            replace(src, dst)

        with mock.patch.object(export.os, "replace", moving):
            yield
    else:
        raise AssertionError(where)


@pytest.mark.parametrize("first", ["several files", "one file"])
@pytest.mark.parametrize("where", ["index write", "second shard", "moving the index in"])
def test_a_failed_second_export_leaves_the_first_byte_for_byte(
    tmp_path: Path, first: str, where: str
) -> None:
    from safetensors.torch import load_file

    model = plain_model(seed=1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=300 if first == "several files" else 10**9)
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    before = every_file(tmp_path)
    assert len(before) == (5 if first == "several files" else 2)  # shards + index, or one

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)  # the second export would write other bytes
    with failing(where, tmp_path), pytest.raises(ExportError, match="disk is full"):
        save_hf_checkpoint(model, tmp_path, max_shard_bytes=300)

    assert every_file(tmp_path) == before  # same names, same bytes, no *.tmp, no staging
    got: dict[str, torch.Tensor] = {}
    for name in before:
        if name.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / name)))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_complete_second_export_replaces_the_first(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = plain_model(seed=1)
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=300)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    files = save_hf_checkpoint(model, tmp_path).files
    assert files == ("model.safetensors",)
    assert sorted(every_file(tmp_path)) == ["model.safetensors"]
    got = load_file(str(tmp_path / "model.safetensors"))
    for key, value in model.state_dict().items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("folder", [None, "", 3])
def test_a_folder_that_is_not_a_path_is_refused(tmp_path: Path, folder: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"invalid `folder`.*a folder path.*Pass the"):
        save_hf_checkpoint(nn.Linear(2, 2), folder)


# -- a peer rank that dies during the export ------------------------------------------------


def dies_mid_export(folder: str, report: str, when: str = "gather") -> None:
    """Rank 1 exits during the second export: in the middle of its gathers (``gather``), or
    where it would agree on rank 0's writing (``commit``: rank 0 has moved the new files in by
    then, and meets the death in that agreement). Rank 0 writes what it saw."""
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    model = plain_model(seed=3)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{report}.ref")
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    save_hf_checkpoint(model, folder, max_shard_bytes=300)  # the complete first export
    dist.barrier()
    before = every_file(Path(folder)) if rank == 0 else {}
    with torch.no_grad():
        for p in model.parameters():
            assert isinstance(p, DTensor)
            p.to_local().mul_(2)
    patch: Any = contextlib.nullcontext()
    if rank == 1 and when == "gather":
        gathered = DTensor.full_tensor
        calls = iter(range(100))

        def gather_then_die(self: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # The fifth gather: rank 0 has staged a file of the second export by then.
            if next(calls) == 4:
                os._exit(1)
            return gathered(self, *args, **kwargs)

        DTensor.full_tensor = gather_then_die  # type: ignore[method-assign]
    elif rank == 1:
        agreed = export.agree

        def die_at_the_write_agreement(stage: str, *args: Any, **kwargs: Any) -> bool:
            if stage == "export (write)":
                os._exit(1)
            return agreed(stage, *args, **kwargs)

        patch = mock.patch.object(export, "agree", die_at_the_write_agreement)
    moved_in: list[bool] = []
    if rank == 0:
        replace = os.replace

        def noting(src: Any, dst: Any) -> None:
            # A file of the new export moved into the folder: rank 0 committed.
            moved_in.append(Path(src).parent.name == "new" and Path(dst).parent == Path(folder))
            replace(src, dst)

        patch = mock.patch.object(export.os, "replace", noting)
    try:
        with patch:
            save_hf_checkpoint(model, folder, max_shard_bytes=300)
        outcome: dict[str, Any] = {"type": None}
    except Exception as exc:
        outcome = {
            "type": type(exc).__name__,
            "message": str(exc),
            "cause": type(exc.__cause__).__name__,
        }
    if rank == 0:
        after = every_file(Path(folder))
        outcome["committed"] = any(moved_in)
        outcome["left"] = sorted(after)
        outcome["unchanged"] = after == before
        outcome["before"] = sorted(before)
        Path(report).write_text(json.dumps(outcome))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", ["gather", "commit"])
def test_a_peer_that_dies_during_the_export_gives_the_survivor_the_library_error(
    tmp_path: Path, when: str
) -> None:
    from safetensors.torch import load_file

    folder, report = tmp_path / "export", tmp_path / "rank0.json"
    with pytest.raises(RankFailure, match="rank 1 exited with code 1"):
        run_ranks(
            dies_mid_export,
            2,
            str(folder),
            str(report),
            when,
            timeout=120,
            grace=60,
            start_method=START_METHOD,
        )
    assert report.exists(), "rank 0 did not finish after rank 1 died"
    outcome = json.loads(report.read_text())
    assert outcome["type"] == "ExportError", outcome
    message = outcome["message"]
    assert "a peer rank died or failed during the export" in message, message
    assert f"into '{folder}'" in message and "run the export again" in message, message
    if when == "gather":  # torch's error of the failed gather, before any commit
        causes = ("RuntimeError", "DistBackendError", "DistNetworkError")
        assert outcome["cause"] in causes and not outcome["committed"], outcome
    else:  # the agreement's on rank 0's writing, after rank 0 moved the new files in
        assert outcome["cause"] == "CommunicationError" and outcome["committed"], outcome
    assert outcome["unchanged"] and outcome["left"] == outcome["before"], outcome
    assert not [n for n in outcome["left"] if n.endswith(".tmp") or "/" in n], outcome
    want = load_file(f"{report}.ref")
    got: dict[str, torch.Tensor] = {}
    for name in outcome["left"]:
        if name.endswith(".safetensors"):
            got.update(load_file(str(folder / name)))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
