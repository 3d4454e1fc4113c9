"""Device resolution rules (no GPU needed: device checks take stand-ins for parameters)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_builder import (
    ConfigurationError,
    CPUDevice,
    ExplicitDevice,
    InferredDevice,
    LocalRankDevice,
)
from fsdp_builder.devices import check_compute_device, check_single_device


def fake(device: str) -> Any:
    return SimpleNamespace(device=torch.device(device))


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (0, torch.device("cuda", 0)),
        ("cpu", torch.device("cpu")),
        (torch.device("cuda", 1), torch.device("cuda", 1)),
    ],
)
def test_explicit_device_accepts_int_str_and_device(given: Any, expected: torch.device) -> None:
    assert ExplicitDevice(given).device == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_without_index_and_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"'cuda' was asked for but CUDA is not available"):
        ExplicitDevice("cuda").resolve(nn.Linear(1, 1), [], rank=0)


def test_cpu_resolvers() -> None:
    m = nn.Linear(2, 2)
    assert CPUDevice().resolve(m, m.parameters(), 0) == torch.device("cpu")
    assert ExplicitDevice("cpu").resolve(m, m.parameters(), 0) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert InferredDevice().resolve(m, list(m.parameters()), 0) == torch.device("cpu")
        os.environ.pop("LOCAL_RANK", None)
        assert LocalRankDevice().resolve(m, [], 0) == torch.device("cpu")


def test_inferred_device_takes_the_non_cpu_device() -> None:
    params = [fake("cpu"), fake("meta"), fake("cuda:1")]
    assert InferredDevice().resolve(nn.Linear(1, 1), params, 0) == torch.device("cuda", 1)


def test_inferred_device_refuses_two_device_types() -> None:
    with pytest.raises(
        ConfigurationError, match=r"two device types, cuda and xpu.*explicit device"
    ):
        InferredDevice().resolve(nn.Linear(1, 1), [fake("cuda:0"), fake("xpu:0")], 0)


def test_single_device_rules() -> None:
    check_single_device([fake("cpu"), fake("meta")], explicit=False)
    check_single_device([fake("cpu"), fake("cuda:0")], explicit=True)
    with pytest.raises(ConfigurationError, match=r"both CPU and cuda:0.*explicit device"):
        check_single_device([fake("cpu"), fake("cuda:0")], explicit=False)
    with pytest.raises(ConfigurationError, match=r"several devices.*one device"):
        check_single_device([fake("cuda:0"), fake("cuda:1")], explicit=True)


def test_compute_device_consistency() -> None:
    check_compute_device([fake("cpu"), fake("meta")], torch.device("cpu"), "blocks.0", 0)
    with pytest.raises(ConfigurationError, match=r"rank 3 in unit 'blocks.0'.*cuda:1.*cpu"):
        check_compute_device([fake("cuda:1")], torch.device("cpu"), "blocks.0", 3)
