"""Which units run without watching their ops: those whose initializers are torch's own that
take no row of a state.

``ShardFirstReset`` skips ``LandedWrites``, ``StreamInit`` its ``_ShardWatch`` and
``PrivateDraws`` (each a Python dispatch of every op), for a unit whose initializers are all in
``WHOLE_TENSOR_INITIALIZERS``. That is safe only while each of them writes whole
states: here each runs under a recorder of every view of a state and every write through one,
and the recorder is shown to see ``Embedding``'s padding row.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from helpers import full_state_dict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_builder import CPUDevice, FullyShardBuilder, ShardFirstReset, StreamInit
from fsdp_builder.materializers import shard_writes
from fsdp_builder.materializers.initializers import PrivateDraws
from fsdp_builder.materializers.shard_writes import (
    WHOLE_TENSOR_INITIALIZERS,
    writes_whole_tensors,
)
from fsdp_builder.materializers.streams import _ShardWatch

WHOLE = {
    "linear": lambda: nn.Linear(6, 5),
    "bilinear": lambda: nn.Bilinear(3, 4, 5),
    "conv1d": lambda: nn.Conv1d(2, 4, 3),
    "conv2d": lambda: nn.Conv2d(2, 4, 3),
    "conv3d": lambda: nn.Conv3d(2, 4, 3),
    "conv_transpose2d": lambda: nn.ConvTranspose2d(2, 4, 3),
    "layer_norm": lambda: nn.LayerNorm(6),
    "rms_norm": lambda: nn.RMSNorm(6),
    "group_norm": lambda: nn.GroupNorm(2, 4),
    "batch_norm1d": lambda: nn.BatchNorm1d(4),
    "batch_norm2d": lambda: nn.BatchNorm2d(4),
}


class _Recorder(TorchDispatchMode):
    """Every view taken of one of ``states``, and every write into a tensor that is not one."""

    def __init__(self, states: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in states}
        self.ids = {id(t) for t in states}
        self.seen: list[str] = []

    def _of_state(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.is_view and args and self._of_state(args[0]):
            self.seen.append(f"view {func}")
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                if self._of_state(value) and id(value) not in self.ids:
                    self.seen.append(f"write through a view: {func}")
        return func(*args, **kwargs)


def _recorded(module: nn.Module) -> list[str]:
    states = [*module.parameters(), *module.buffers()]
    with torch.no_grad(), _Recorder(states) as recorder:
        module.reset_parameters()  # type: ignore[operator]
    return recorder.seen


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_listed_initializers_take_no_view_of_a_state(name: str) -> None:
    module = WHOLE[name]()
    assert writes_whole_tensors(module.reset_parameters)
    assert _recorded(module) == []


def test_every_listed_initializer_is_recorded() -> None:
    recorded = {cast(Any, type(make())).reset_parameters for make in WHOLE.values()}
    assert recorded == WHOLE_TENSOR_INITIALIZERS


def test_the_recorder_sees_a_padding_row_written() -> None:
    embedding = nn.Embedding(10, 4, padding_idx=3)
    assert not writes_whole_tensors(embedding.reset_parameters)
    seen = _recorded(embedding)
    assert any(s.startswith("view") for s in seen)
    assert any(s.startswith("write through a view") for s in seen)


class _OwnReset(nn.Linear):
    """A subclass with an initializer of its own: not torch's, so it is watched."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_()
            self.bias.zero_()


MODELS = {
    "torch_only": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), False),
    "padding_row": (lambda: nn.Sequential(nn.Embedding(8, 8, padding_idx=0)), True),
    "own_reset": (lambda: nn.Sequential(_OwnReset(8, 8)), True),
}
# Each shard-first materializer and the dispatch modes it enters around a unit that may write a
# row, run an op that is not element-wise on a shard, or draw without a stream.
WATCHES: dict[str, tuple[Any, tuple[type, ...]]] = {
    "shard_first_reset": (lambda: ShardFirstReset(seed=0), (shard_writes.LandedWrites,)),
    "stream_init": (lambda: StreamInit(seed=0), (_ShardWatch, PrivateDraws)),
    "stream_init_shard_by_shard": (
        lambda: StreamInit(seed=0, whole_below=0),
        (_ShardWatch, PrivateDraws),
    ),
}


def _counted(enter: Any, entered: list[type]) -> Any:
    def counted(self: Any) -> Any:
        entered.append(type(self))
        return enter(self)

    return counted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("materializer", sorted(WATCHES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_units_of_torch_own_initializers_run_unwatched(
    name: str, materializer: str, world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, watched = MODELS[name]
    make_materializer, modes = WATCHES[materializer]
    entered: list[type] = []
    for mode in modes:
        monkeypatch.setattr(mode, "__enter__", _counted(cast(Any, mode).__enter__, entered))
    with torch.device("meta"):
        model = make()
    torch.manual_seed(0)
    with torch.device("cpu"):
        eager = make()  # the shapes, and for stream_init the values' spread
    builder = FullyShardBuilder().device(CPUDevice()).materialize(make_materializer())
    with pytest.warns(UserWarning, match="NO_SHARD"):  # one rank
        built = builder.build(model)
    assert sorted(map(str, entered)) == (sorted(map(str, modes)) if watched else [])
    for (key, value), (eager_key, expected) in zip(
        full_state_dict(built).items(), eager.state_dict().items(), strict=True
    ):
        assert key == eager_key and value.shape == expected.shape
        assert torch.isfinite(value).all()
