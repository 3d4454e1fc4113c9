"""The public surface: a short ``__all__``, and every module path that moved still importable,
with a DeprecationWarning naming the new path, attributed to the importing line and shown by
Python's default warning filters."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

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
    with pytest.warns(DeprecationWarning, match=rf"`{old}` moved to `{MOVED[old]}`") as seen:
        line = sys._getframe().f_lineno + 1
        module = importlib.import_module(old)
    # Attributed to the line that imported it, not to the import machinery or to `sys:1`.
    assert [(w.filename, w.lineno) for w in seen] == [(__file__, line)]
    new = importlib.import_module(MOVED[old])
    public = [n for n in getattr(new, "__all__", vars(new)) if not n.startswith("_")]
    assert public
    for name in public:
        assert getattr(module, name) is getattr(new, name), name
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def _default_filters() -> dict[str, str]:
    """The environment of a fresh Python whose warning filters are Python's defaults."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.pop("PYTHONDEVMODE", None)
    return env


def test_a_users_script_importing_moved_paths_sees_each_warning_at_its_line(
    tmp_path: Path,
) -> None:
    # Python's default filters show a DeprecationWarning only where it is attributed to
    # __main__: a user's script sees it only if the warning names the script's own line.
    lines = []
    for i, old in enumerate(sorted(MOVED)):
        if i % 2:
            new = importlib.import_module(MOVED[old])
            name = next(n for n in getattr(new, "__all__", vars(new)) if not n.startswith("_"))
            lines.append(f"from {old} import {name}")
        else:
            lines.append(f"import {old}")
    script = tmp_path / "train.py"
    script.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [sys.executable, str(script)],  # no -W: the default filters
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_default_filters(),
    )
    assert done.returncode == 0, done.stderr
    for number, (old, line) in enumerate(zip(sorted(MOVED), lines, strict=True), start=1):
        header = f"{script}:{number}: DeprecationWarning: `{old}` moved to `{MOVED[old]}`"
        assert header in done.stderr, (header, done.stderr)
        assert f"\n  {line}\n" in done.stderr  # the user's line, quoted under the warning
    assert "sys:1" not in done.stderr and "importlib" not in done.stderr


def test_a_moved_path_imported_by_a_library_module_is_attributed_to_that_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not __main__: the default filters hide it, `-W` / filterwarnings can select it by module.
    (tmp_path / "their_lib.py").write_text("\n\nfrom fsdp_builder.wrap import *  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fsdp_builder.wrap", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        importlib.import_module("their_lib")
    moved = [w for w in seen if issubclass(w.category, DeprecationWarning)]
    assert [(w.filename, w.lineno) for w in moved] == [(str(tmp_path / "their_lib.py"), 3)]
    sys.modules.pop("their_lib", None)


def test_the_old_command_module_still_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_builder.cli", "--help"],  # no -W: the default filters
        capture_output=True,
        text=True,
        timeout=120,
        env=_default_filters(),
    )
    assert done.returncode == 0, done.stderr
    assert "usage: fsdp-builder" in done.stdout
    assert "`fsdp_builder.cli` moved to `fsdp_builder.tools.cli`" in done.stderr
