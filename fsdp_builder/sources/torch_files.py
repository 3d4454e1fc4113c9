"""``torch.save`` checkpoints: one ``.bin`` / ``.pt`` file holding a state dict, or a Hugging
Face folder of ``.bin`` shards with a ``pytorch_model.bin.index.json``; files are mapped
(``mmap=True``) where their format allows, so reads touch only the pages they need."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fsdp_builder.sources.base import SourceError, listed, require_file
from fsdp_builder.sources.hf_safetensors import refuse_a_shard, shard_keys
from fsdp_builder.sources.memory import StateDictSource, check_state_dict


def load_state_dict_file(path: Path, describe: str) -> Mapping[str, torch.Tensor]:
    """The state dict a ``torch.save`` file holds (weights only: no code runs)."""
    require_file(path)  # torch.load of a named pipe would wait for a writer forever
    try:
        try:
            loaded: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not a zip file: mmap is not possible, read it whole
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    # Unpickling arbitrary bytes can fail with almost any exception type (IndexError, KeyError,
    # struct.error, UnicodeDecodeError...): each means the file is not a torch.save state dict.
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceError(
            f"{describe} is not a state dict (torch.load failed: {first[:200]})"
        ) from exc
    return check_state_dict(loaded, describe)


def open_file(path: Path) -> StateDictSource:
    """One ``torch.save`` file (not one shard of several)."""
    refuse_a_shard(path)
    where = f"'{path}'"
    return StateDictSource(load_state_dict_file(path, where), where)


def open_index(index: Path) -> StateDictSource:
    """``.bin`` shards named by an index, each loaded (mapped) when the source opens."""
    describe = f"'{index}'"
    tensors: dict[str, torch.Tensor] = {}
    absent: list[str] = []
    for name, keys in shard_keys(index).items():
        held = load_state_dict_file(index.parent / name, f"{describe} holds '{name}', which")
        tensors.update((key, held[key]) for key in keys if key in held)
        absent += [f"{key} (in {name})" for key in keys if key not in held]
    if absent:
        raise SourceError(
            f"{describe} has {len(absent)} key(s) in its index but not in their file: "
            f"{listed(absent)}"
        )
    return StateDictSource(tensors, describe)


def single_file_in(folder: Path) -> Path | None:
    """The one ``.bin`` / ``.pt`` / ``.pth`` file of a folder, if it holds exactly one."""
    # Any entry but a folder counts, so that one that is no file (a named pipe) is refused by
    # name when opened rather than the folder said to hold no checkpoint.
    files = [f for ext in ("bin", "pt", "pth") for f in folder.glob(f"*.{ext}") if not f.is_dir()]
    return files[0] if len(files) == 1 else None


def is_single_file_folder(path: Path) -> bool:
    return path.is_dir() and single_file_in(path) is not None


def open_single_file_folder(folder: Path) -> StateDictSource:
    file = single_file_in(folder)
    assert file is not None
    return open_file(file)


__all__ = [
    "is_single_file_folder",
    "load_state_dict_file",
    "open_file",
    "open_index",
    "open_single_file_folder",
]
