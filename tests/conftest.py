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

from fsdp_builder.tools.launch import RANK_SLOTS, own_cores


def pytest_configure(config: pytest.Config) -> None:
    multiprocessing.set_forkserver_preload(PRELOAD)
    # The workers of one run share the cores: a test holds one while it runs (``_cores``), a
    # launch one per rank while its ranks run, so no more processes run than cores at once.
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
def _cores(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test holds a core while it runs (a launch it makes hands it back while its ranks
    run). A test marked ``cores(n)`` holds n, and what it starts (torchrun, the command line)
    runs on those without asking for its own."""
    marker = request.node.get_closest_marker("cores")
    with own_cores(marker.args[0] if marker else 1):
        if marker:
            monkeypatch.delenv(RANK_SLOTS, raising=False)
        yield


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """Entry points configure structlog (the CLI filters below WARNING); tests that call them
    in-process must not change what later tests capture."""
    yield
    structlog.reset_defaults()
