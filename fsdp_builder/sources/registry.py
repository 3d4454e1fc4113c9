"""Which format a path holds, and how to open it: formats a user registers are tried first,
then the built-in ones, in order; the first whose ``detect(path)`` is true opens the path."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch.distributed as dist
from attrs import frozen

import fsdp_builder.sources.dcp_folder as dcp_folder
import fsdp_builder.sources.hf_safetensors as hf_safetensors
import fsdp_builder.sources.memory as memory
import fsdp_builder.sources.torch_files as torch_files
from fsdp_builder.common.logs import get_logger
from fsdp_builder.errors import ConfigurationError, config_error
from fsdp_builder.sources.base import (
    CheckpointSource,
    MissingPath,
    SourceError,
    checked_source,
    listed,
    require_file,
)

log = get_logger(__name__)


@frozen
class Format:
    """A checkpoint format: its name, how to recognize a path, and how to open it."""

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], CheckpointSource]


def _is_file_with(*suffixes: str) -> Callable[[Path], bool]:
    return lambda path: path.is_file() and path.name.endswith(suffixes)


def _index_folder(name: str, pattern: str, open_index: Callable[[Path], Any]) -> Format:
    """A folder holding an index matching ``pattern``, opened through the one it holds."""
    return Format(
        name,
        lambda path: path.is_dir() and any(path.glob(pattern)),
        lambda folder: open_index(hf_safetensors.only_index(folder, pattern)),
    )


# The one-file weights a library's from_pretrained reads from a folder when no variant is asked
# for: transformers' and diffusers' names. A folder may hold variants beside it
# (diffusion_pytorch_model.fp16.safetensors), which from_pretrained(folder) leaves alone.
_PLAIN_WEIGHTS = ("model.safetensors", "diffusion_pytorch_model.safetensors")


def _plain_weights(folder: Path) -> Path | None:
    """``folder``'s one file of :data:`_PLAIN_WEIGHTS` when it holds variants beside it."""
    if not folder.is_dir():
        return None
    found = [folder / name for name in _PLAIN_WEIGHTS if (folder / name).is_file()]
    return found[0] if len(found) == 1 else None


def _open_plain_weights(folder: Path) -> CheckpointSource:
    file = _plain_weights(folder)
    assert file is not None
    variants = sorted(p.name for p in folder.glob("*.safetensors") if p != file)
    log.info("checkpoint_variants_left", path=str(folder), loaded=file.name, left=variants)
    return hf_safetensors.open_file(file)


_BUILT_IN: tuple[Format, ...] = (
    Format("safetensors", _is_file_with(".safetensors"), hf_safetensors.open_file),
    Format(
        "safetensors-index", _is_file_with(".safetensors.index.json"), hf_safetensors.open_index
    ),
    Format("torch-index", _is_file_with(".bin.index.json"), torch_files.open_index),
    _index_folder("hf-safetensors-folder", "*.safetensors.index.json", hf_safetensors.open_index),
    Format("dcp-folder", dcp_folder.is_dcp_folder, dcp_folder.DCPSource),
    Format(
        "safetensors-file-folder",
        hf_safetensors.is_single_file_folder,
        hf_safetensors.open_single_file_folder,
    ),
    # After the one-file folder: several .safetensors files, one of them the plain weights.
    Format("hf-plain-weights-folder", lambda p: _plain_weights(p) is not None, _open_plain_weights),
    _index_folder("hf-torch-folder", "*.bin.index.json", torch_files.open_index),
    Format(
        "torch-file-folder", torch_files.is_single_file_folder, torch_files.open_single_file_folder
    ),
    # Last: any other file is taken for a torch.save file (torch.load says if it is not one).
    Format("torch-file", lambda path: path.is_file(), torch_files.open_file),
)
_USER: list[Format] = []


def register_format(
    name: str, detect: Callable[[Path], bool], open: Callable[[Path], CheckpointSource]
) -> None:
    """Make ``FromCheckpoint`` and ``FromStateDict`` read a format of your own.

    ``detect(path)`` says whether a path holds your format; ``open(path)`` returns a
    :class:`~fsdp_builder.sources.CheckpointSource`. Registering a name again replaces it.
    Register on every rank before the build (e.g. at import of the module defining it): ranks
    compare their registered formats in the configure stage.

    What ``detect`` or ``open`` raises is reported naming the format. Each ``read`` is held to
    the source's ``tensors()`` listing: a tensor of another shape (which would be broadcast
    into every row) or another dtype (which would be converted) is refused, naming both.

    Raises:
        ConfigurationError: ``name`` is empty, or ``detect`` / ``open`` is not callable.

    Example:
        ```python
        register_format("npz", lambda path: path.suffix == ".npz", NpzSource)
        FromCheckpoint("/ckpt/model.npz")  # every rank reads its rows through NpzSource
        ```
    """
    if not isinstance(name, str) or not name:
        raise config_error(
            "register_format",
            "name",
            f"expected a name, got {name!r}",
            "Pass a short name such as 'npz'",
        )
    for argument, value in (("detect", detect), ("open", open)):
        if not callable(value):
            raise config_error(
                "register_format",
                argument,
                f"expected a callable taking a pathlib.Path, got {type(value).__name__}",
                "Pass a function (or class) taking the path",
            )
    _USER[:] = [f for f in _USER if f.name != name]
    _USER.insert(0, Format(name, detect, open))
    log.debug("checkpoint_format_registered", format=name)


def unregister_format(name: str) -> None:
    """Forget a format registered with :func:`register_format` (built-in ones stay)."""
    _USER[:] = [f for f in _USER if f.name != name]


def registered_formats() -> list[Format]:
    """The formats registered with :func:`register_format`, in the order they are tried."""
    return list(_USER)


def formats() -> list[str]:
    """The formats' names, in the order they are tried."""
    return [f.name for f in (*_USER, *_BUILT_IN)]


# What each source opened in a `wrapping_sources` context is handed to, innermost first.
_WRAPS: ContextVar[tuple[Callable[[CheckpointSource], CheckpointSource], ...]] = ContextVar(
    "source_wraps", default=()
)


@contextmanager
def wrapping_sources(wrap: Callable[[CheckpointSource], CheckpointSource]) -> Iterator[None]:
    """Within this context (this thread, or this asyncio task), every source that
    :func:`open_source` opens (the loaders open theirs through it) is handed to ``wrap``, and
    the loader reads through the source ``wrap`` returns: the source itself, or one that
    records, counts or replaces its reads. Contexts nest; the outer ``wrap`` sees the source the
    inner one returned. A source ``wrap`` raises on is closed. The dry run
    (``fsdp_builder.tools.dryrun``) records a build's safetensors reads this way."""
    token = _WRAPS.set((wrap, *_WRAPS.get()))
    try:
        yield
    finally:
        _WRAPS.reset(token)


def open_source(source: Mapping[str, Any] | str | os.PathLike[str]) -> CheckpointSource:
    """Open ``source``: a state dict in memory, or a path whose format is detected; a
    SourceError (:class:`MissingPath` for a missing path) says what is wrong. Inside
    :func:`wrapping_sources`, the source its ``wrap`` returns."""
    opened = _open_source(source)
    for wrap in _WRAPS.get():
        try:
            opened = wrap(opened)
        except BaseException:
            opened.close()
            raise
    return opened


def _open_source(source: Mapping[str, Any] | str | os.PathLike[str]) -> CheckpointSource:
    if isinstance(source, Mapping):
        return memory.open_state_dict(source)
    path = Path(os.fspath(source))
    if not path.exists():
        parent = path.parent
        names = [p.name for p in parent.iterdir()] if parent.is_dir() else []
        near = difflib.get_close_matches(path.name, names, n=1)
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise MissingPath(str(path), rank, str(parent / near[0]) if near else None)
    for fmt in _USER:
        if _user_call(fmt, "detect", path):
            opened = _user_call(fmt, "open", path)
            if not isinstance(opened, CheckpointSource):
                raise ConfigurationError(
                    f"The checkpoint format '{fmt.name}' opened '{path}' as a "
                    f"{type(opened).__name__}, which lacks what a CheckpointSource has "
                    "(describe, tensors(), read(key, index), close()). Fix the format's open "
                    "function."
                )
            log.debug("checkpoint_opened", format=fmt.name, path=str(path))
            return checked_source(fmt.name, opened)
    if path.is_dir():
        refuse_two_checkpoints(path)
    else:
        require_file(path)  # a named pipe or a device: no format of ours can read it
    for fmt in _BUILT_IN:
        if fmt.detect(path):
            opened = fmt.open(path)
            log.debug("checkpoint_opened", format=fmt.name, path=str(path))
            return opened
    raise SourceError(_unknown_folder(path))


def _user_call(fmt: Format, step: str, path: Path) -> Any:
    """A registered format's ``detect`` or ``open`` of ``path``; its errors name both."""
    detect = step == "detect"
    try:
        return (fmt.detect if detect else fmt.open)(path)
    except ConfigurationError:
        raise
    except Exception as exc:
        raise SourceError(
            f"'{path}' could not be read: the checkpoint format '{fmt.name}' (registered with "
            f"register_format) raised {type(exc).__name__}: {exc} in its {step} function",
            f"Fix the {step} function of the format '{fmt.name}'"
            + (" (it should only look at the path and say True or False)" if detect else "")
            + f", or remove the format with unregister_format('{fmt.name}')",
        ) from exc


# Files of a Hugging Face checkpoint (what save_pretrained and save_hf_checkpoint write) that a
# DCP folder has no use for.
_HF_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "*.bin.index.json")


def hf_weights(folder: Path) -> list[str]:
    """The names of the Hugging Face checkpoint files ``folder`` holds."""
    return sorted({p.name for pattern in _HF_WEIGHTS for p in folder.glob(pattern)})


def refuse_two_checkpoints(folder: Path) -> None:
    """Refuse a folder holding both a DCP checkpoint and Hugging Face weights: the formats'
    order would pick one without a word, though neither says which is current (an export into
    the DCP folder a model was loaded from puts the trained weights beside the old ones). A
    ``.bin`` file beside a DCP checkpoint is left alone: training state is often kept so."""
    if not dcp_folder.is_dcp_folder(folder):
        return
    found = hf_weights(folder)
    if found:
        raise SourceError(
            f"'{folder}' holds two checkpoints of different formats: a DCP checkpoint "
            f"('.metadata' and its data files) and Hugging Face weights ({listed(found)}); "
            "which of them to load cannot be told",
            fix="Move one of them to a folder of its own and pass that folder (export with "
            "save_hf_checkpoint into a fresh folder, not the DCP folder)",
        )


def _unknown_folder(path: Path) -> str:
    where = f"'{path}'"
    if any(path.glob("*.distcp")):
        return f"{where} holds DCP shard files (*.distcp) but no .metadata file"
    singles = list(path.glob("*.safetensors"))
    if singles:
        return (
            f"{where} holds {len(singles)} .safetensors files but no *.safetensors.index.json "
            "saying which tensor lives where"
        )
    components = sorted({p.parent.name for p in path.glob("*/diffusion_pytorch_model*")})
    if components:
        # A diffusers pipeline folder: each model is in a folder of its own.
        return (
            f"{where} holds no checkpoint of its own but a diffusers pipeline, whose models "
            f"are in folders of their own ({listed(components)}): pass one of them, e.g. "
            f"'{path / components[0]}'"
        )
    return (
        f"{where} holds no checkpoint: it is not a file, and it holds no .safetensors file, "
        "index or DCP .metadata (nor a single .bin / .pt file)"
    )


__all__ = [
    "Format",
    "formats",
    "hf_weights",
    "open_source",
    "refuse_two_checkpoints",
    "register_format",
    "registered_formats",
    "unregister_format",
    "wrapping_sources",
]
