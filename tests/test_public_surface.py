"""The public surface: a short ``__all__``, and every module path that moved still importable,
with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fsdp_builder
from fsdp_builder.moved import MOVED


def test_all_is_short_and_each_name_resolves() -> None:
    assert len(fsdp_builder.__all__) <= 45
    assert len(set(fsdp_builder.__all__)) == len(fsdp_builder.__all__)
    for name in fsdp_builder.__all__:
        assert getattr(fsdp_builder, name) is not None, name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_path_warns_and_forwards(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"`{old}` moved to `{MOVED[old]}`"):
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    public = [n for n in getattr(new, "__all__", vars(new)) if not n.startswith("_")]
    assert public
    for name in public:
        assert getattr(module, name) is getattr(new, name), name
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_old_command_module_still_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "fsdp_builder.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: fsdp-builder" in done.stdout
    assert "`fsdp_builder.cli` moved to `fsdp_builder.tools.cli`" in done.stderr
