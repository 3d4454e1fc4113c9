"""The API reference is generated from docstrings: each builder method and each ready-made
strategy says what it raises and shows an example."""

from __future__ import annotations

import inspect

import pytest

import fsdp_builder
from fsdp_builder import (
    BaseDeviceResolver,
    BaseGroupFactory,
    BaseMaterializer,
    BaseSynchronizer,
    ShardingBuilder,
)

BASES = (BaseDeviceResolver, BaseGroupFactory, BaseMaterializer, BaseSynchronizer)
STRATEGIES = sorted(
    name
    for name in fsdp_builder.__all__
    if inspect.isclass(obj := getattr(fsdp_builder, name))
    and issubclass(obj, BASES)
    and obj not in BASES
)
METHODS = sorted(
    name
    for name, member in vars(ShardingBuilder).items()
    if not name.startswith("_") and inspect.isfunction(member) and name not in {"plan_for"}
)


def test_the_lists_are_not_empty() -> None:
    assert len(STRATEGIES) >= 15 and len(METHODS) >= 18


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_ready_made_strategy_shows_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(fsdp_builder, name)) or ""
    assert "Example:" in doc and "```python" in doc, name


@pytest.mark.parametrize("name", METHODS)
def test_each_builder_method_says_what_it_raises_and_shows_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(ShardingBuilder, name)) or ""
    assert "Example:" in doc, name
    if name not in {"clone"}:
        assert "Raises:" in doc and "ConfigurationError" in doc, name
