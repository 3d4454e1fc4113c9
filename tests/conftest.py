"""Shared fixtures: a one-rank gloo world inside the test process."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Iterator

import pytest
import structlog
import torch.distributed as dist
from isolated import PRELOAD

from fsdp_builder.tools.launch import RANK_SLOTS


def pytest_configure(config: pytest.Config) -> None:
    multiprocessing.set_forkserver_preload(PRELOAD)
    # The workers of one run share the cores: their launches (and the CLI processes they start)
    # wait for each other instead of running more ranks than cores at once.
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    os.environ.setdefault(RANK_SLOTS, os.path.join(tempfile.gettempdir(), f"fsdp-ranks-{run}"))


@pytest.fixture
def world1() -> Iterator[None]:
    """A default process group of one rank (gloo), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """Entry points configure structlog (the CLI filters below WARNING); tests that call them
    in-process must not change what later tests capture."""
    yield
    structlog.reset_defaults()
