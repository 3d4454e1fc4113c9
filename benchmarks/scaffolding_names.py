"""Public top-level names of the package that no library module uses, only tests or benchmarks:
scaffolding that belongs beside its users. ``python -m benchmarks.scaffolding_names [root]``.

A name counts as used by the library when a module of ``fsdp_builder`` reads it: its own module
by name, another through ``from ... import`` (re-exports followed) or ``module.name``. A module's
own ``__all__`` is no use. Names the docs mention (README, docs/) are marked: public API stays.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

Key = tuple[str, str]  # (defining module, name)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(module: str, level: int, current: str, is_package: bool) -> str:
    """The module a relative ``from`` import names."""
    if level == 0:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


class Package:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = sorted((root / "fsdp_builder").rglob("*.py"))
        self.modules = {module_name(root, f) for f in self.files}
        self.defs: set[Key] = set()
        self.aliases: dict[Key, Key] = {}  # a re-export → what it re-exports
        for f in self.files:
            current = module_name(root, f)
            for node in ast.parse(f.read_text()).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    if not node.name.startswith("_"):
                        self.defs.add((current, node.name))
                elif isinstance(node, ast.ImportFrom):
                    source = absolute(node.module or "", node.level, current, f.stem == "__init__")
                    for a in node.names:
                        self.aliases[(current, a.asname or a.name)] = (source, a.name)

    def defining(self, key: Key) -> Key:
        seen: set[Key] = set()
        while key in self.aliases and key not in self.defs and key not in seen:
            seen.add(key)
            key = self.aliases[key]
        return key

    def users(self, files: list[Path], library: bool) -> dict[Key, set[str]]:
        """Each package name → the files (relative paths) that read it."""
        out: dict[Key, set[str]] = defaultdict(set)
        for f in files:
            current = module_name(self.root, f) if library else f.stem
            where = str(f.relative_to(self.root))
            own = {n for m, n in self.defs if m == current} if library else set()
            modules: dict[str, str] = {}  # local name → package module
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom):
                    source = absolute(node.module or "", node.level, current, f.stem == "__init__")
                    for a in node.names:
                        key = self.defining((source, a.name))
                        if key in self.defs:
                            out[key].add(where)
                        if f"{source}.{a.name}" in self.modules:
                            modules[a.asname or a.name] = f"{source}.{a.name}"
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        modules[a.asname or a.name] = a.name
                elif isinstance(node, ast.Name) and node.id in own:
                    out[(current, node.id)].add(where)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    module = modules.get(node.value.id)
                    if module is not None:
                        key = self.defining((module, node.attr))
                        if key in self.defs:
                            out[key].add(where)
        return out


def main(root: Path) -> None:
    package = Package(root)
    library = package.users(package.files, library=True)
    others = package.users(
        sorted((root / "tests").rglob("*.py")) + sorted((root / "benchmarks").rglob("*.py")),
        library=False,
    )
    docs = (root / "README.md").read_text() + "".join(
        p.read_text() for p in sorted((root / "docs").rglob("*")) if p.suffix in (".md", ".py")
    )
    only = sorted(k for k in package.defs if not library.get(k) and others.get(k))
    print(f"public top-level names: {len(package.defs)}")
    print(f"only tests or benchmarks use: {len(only)}, in {len({m for m, _ in only})} modules")
    for module, name in only:
        # Named as code: `name`, `module.name`, module:name (a CLI argument), name(...), or
        # imported; the bare word is often plain English ("reference").
        spelled = rf"`[\w.]*\b{name}\b|:{name}\b|\b{name}\(|import [^\n]*\b{name}\b"
        documented = "  [in the docs]" if re.search(spelled, docs) else ""
        print(f"  {module}.{name}{documented}: {', '.join(sorted(others[(module, name)])[:3])}")
    unused = sorted(k for k in package.defs if not library.get(k) and not others.get(k))
    print(f"used by nothing: {len(unused)}")
    for module, name in unused:
        print(f"  {module}.{name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
