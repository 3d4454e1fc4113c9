"""A state dict in memory (names → tensors) as a checkpoint source; also what a ``torch.save``
file holds once loaded (``fsdp_builder.sources.torch_files``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_builder.sources.base import Index, SourceError, TensorMeta, listed


def _names(keys: list[str]) -> str:
    return listed([f"'{k}'" for k in keys], shown=5)


def check_state_dict(value: Any, what: str) -> Mapping[str, torch.Tensor]:
    """``value`` as a state dict whose values can be read, or a SourceError saying why not."""
    if not isinstance(value, Mapping):
        raise SourceError(f"{what} is not a state dict (it holds a {type(value).__name__})")
    bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        shown = listed([repr(k) for k in bad], 5)
        raise SourceError(
            f"{what} is not a state dict (entries {shown} are "
            "not tensors named by strings; if it is a checkpoint holding a state dict, pass "
            "that inner dict)"
        )
    sharded = [k for k, v in value.items() if isinstance(v, DTensor)]
    if sharded:
        raise SourceError(
            f"{what} holds DTensors ({_names(sharded)}): it is the state dict of a sharded "
            "model, each rank holding a part",
            fix="Pass the full state dict: torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) on the "
            "sharded model, or model.state_dict() of the unwrapped one",
        )
    empty = [k for k, v in value.items() if v.is_meta]
    if empty:
        raise SourceError(
            f"{what} holds tensors on the meta device, which have no values ({_names(empty)})",
            fix="Pass the state dict of a model with real weights (not one built under "
            "torch.device('meta'))",
        )
    return value


class StateDictSource:
    """Tensors held in a mapping; reads are views of them (copied by the loader)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], describe: str) -> None:
        self.describe = describe
        self._tensors = tensors
        # Through __getitem__ (once per key), as every later read: a mapping that loads lazily
        # is asked the same way for its listing and its values.
        self._meta = {k: TensorMeta(tuple(t.shape), t.dtype) for k in tensors for t in [tensors[k]]}

    def tensors(self) -> Mapping[str, TensorMeta]:
        return self._meta

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        tensor = self._tensors[key].detach()
        return tensor[index] if index else tensor

    def close(self) -> None:
        # The caller's dict stays theirs; a loaded file's tensors (and mapping) go with it.
        self._tensors = {}


def open_state_dict(value: Mapping[str, Any]) -> StateDictSource:
    """A state dict given in memory."""
    return StateDictSource(check_state_dict(value, "the mapping given"), "the state dict given")


__all__ = ["StateDictSource", "check_state_dict", "open_state_dict"]
