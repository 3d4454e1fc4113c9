"""A model whose units nothing chooses (no ``.wrap(...)``, no ``_no_split_modules``) is one unit:
above 8 MiB of parameters the build says so, as a ``one_unit_model`` event and a UserWarning
naming the model, its size and ``.wrap(...)``; below it, or when units are chosen, it is quiet."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
import torch
from helpers import full_state_dict
from structlog.testing import capture_logs
from torch import nn

from fsdp_builder import FSDPBuilder, FullyShardBuilder, ShardingBuilder

MIB = 2**20
BACKENDS: dict[str, Callable[[], ShardingBuilder]] = {
    "fsdp1": FSDPBuilder,
    "fsdp2": FullyShardBuilder,
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    """Three blocks of ``width``² fp32 weights: 12 MiB at width 1024, 3 MiB at 512."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Declaring(Net):
    _no_split_modules: ClassVar[list[str]] = ["Block"]


def meta(cls: type[Net], width: int) -> Net:
    with torch.device("meta"):
        return cls(width)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextmanager
def recorded() -> Iterator[tuple[list[warnings.WarningMessage], list[MutableMapping[str, Any]]]]:
    """The warnings (every one, not once per place) and the structlog events of a block."""
    with warnings.catch_warnings(record=True) as caught, capture_logs() as events:
        warnings.simplefilter("always")
        yield caught, events


def one_unit(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "one shard unit" in str(w.message)]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_large_model_with_no_wrap_is_warned_about_naming_wrap(backend: str) -> None:
    model = meta(Net, 1024)
    size = parameter_bytes(model)
    assert size > 8 * MIB
    with recorded() as (caught, events):
        plan = BACKENDS[backend]().plan_for(model)
    assert [u.label for u in plan] == ["<root>"]
    (message,) = one_unit(caught)
    assert "Net" in message and f"{size / MIB:.1f} MiB" in message
    assert "`.wrap(Block)`" in message
    (w,) = [w for w in caught if "one shard unit" in str(w.message)]
    assert w.category is UserWarning
    assert w.filename == __file__, "the warning points into the library, not at the caller"
    (event,) = [e for e in events if e["event"] == "one_unit_model"]
    assert event["log_level"] == "warning"
    assert event["model"] == "Net" and event["parameter_bytes"] == size
    assert event["block_like"] == ["Block"]


def test_a_real_build_warns_too_and_stays_one_unit(world1: None) -> None:
    model = Net(1024)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    builder = FullyShardBuilder()
    with recorded() as (caught, _):
        built = builder.build(model)
    assert len(one_unit(caught)) == 1
    assert builder.plan is not None and [u.label for u in builder.plan] == ["<root>"]
    got = full_state_dict(built)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_model_below_eight_mib_is_not_warned_about() -> None:
    model = meta(Net, 512)
    assert parameter_bytes(model) < 8 * MIB
    with recorded() as (caught, events):
        FullyShardBuilder().plan_for(model)
    assert one_unit(caught) == []
    assert [e for e in events if e["event"] == "one_unit_model"] == []


@pytest.mark.parametrize(
    ("cls", "wrap"),
    [
        (Net, (Block,)),
        (Net, (lambda module, fqn: False,)),
        (Declaring, ()),
    ],
    ids=["wrap-classes", "wrap-nothing-on-purpose", "no-split-modules"],
)
def test_a_chosen_wrap_is_not_warned_about(cls: type[Net], wrap: tuple[Any, ...]) -> None:
    model = meta(cls, 1024)
    builder = FullyShardBuilder()
    if wrap:
        builder = builder.wrap(*wrap)
    with recorded() as (caught, events):
        builder.plan_for(model)
    assert one_unit(caught) == []
    assert [e for e in events if e["event"] == "one_unit_model"] == []


def test_parameters_of_ignored_modules_do_not_count() -> None:
    model = meta(Net, 1024)
    # Two of the three 4 MiB blocks are left out of sharding: 4 MiB remain.
    builder = FullyShardBuilder().ignore(modules=[model.blocks[0], model.blocks[1]])
    with recorded() as (caught, _):
        builder.plan_for(model)
    assert one_unit(caught) == []


def test_a_transformers_model_without_no_split_modules_is_warned_about() -> None:
    transformers: Any = pytest.importorskip("transformers")
    config = transformers.PegasusConfig(
        vocab_size=50_000,  # a 12 MiB embedding, shared by encoder, decoder and head
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
    )
    with torch.device("meta"):
        model = transformers.PegasusForConditionalGeneration(config)
    assert not model._no_split_modules
    with recorded() as (caught, _):
        FSDPBuilder().plan_for(model)
    (message,) = one_unit(caught)
    assert "PegasusForConditionalGeneration" in message
    assert "PegasusEncoderLayer" in message and "PegasusDecoderLayer" in message
