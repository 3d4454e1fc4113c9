"""Every test in this folder needs CUDA and NCCL: without them each is skipped, with a reason,
before any fixture runs or any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).parent


def missing() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "needs CUDA: torch.cuda.is_available() is False"
    if not dist.is_available() or not dist.is_nccl_available():
        return "needs NCCL: this torch build has no NCCL backend"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(skip)
