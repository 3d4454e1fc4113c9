"""Counts of "one mechanism per job" in the library at git revisions, read from the source:

    python -m benchmarks.lean_counts 5aa7d60 HEAD [--out FILE.md]

Each revision's ``fsdp_builder`` is taken from git (``git archive``) and read with ``ast``:

- lines and statements (``ast.stmt`` nodes);
- interception mechanisms: classes deriving from torch's ``TorchDispatchMode`` or
  ``TorchFunctionMode``, and assignments that replace an attribute of another module;
- error channels besides the agreement: calls of ``broadcast_object_list``,
  ``all_gather_object`` or ``gather_object`` outside ``runtime/agreement.py``;
- subtree walks: call sites of a walk that names a module subtree's states (``module_names``,
  ``owned_states``, ``named_modules``, ``named_parameters``, ``named_buffers``, ``state_dict``)
  outside the planner (``planning/``), whole-model checks, export and the dry run included; the
  per-unit walks among them are what the unit record replaces;
- inline list cuts (``[:8]``) and list formatters (functions named like ``*names*`` /
  ``*listed*`` returning a joined string);
- modules in an import cycle (module-level and function-level imports alike);
- Linux-only page management: reads of ``/proc/self/maps`` and ``madvise`` calls.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.against import extract

WALKS = {
    "module_names",
    "owned_states",
    "named_modules",
    "named_parameters",
    "named_buffers",
    "state_dict",
}
CHANNELS = {"broadcast_object_list", "all_gather_object", "gather_object"}
MODES = {"TorchDispatchMode", "TorchFunctionMode"}


def _called(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _module(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(imports: dict[str, set[str]]) -> set[str]:
    """Modules on an import cycle (Tarjan's strongly connected components of size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[str] = set()
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in imports.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.update(component)

    sys.setrecursionlimit(10_000)
    for v in list(imports):
        if v not in index:
            visit(v)
    return found


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


def counts(package: Path) -> tuple[Counter[str], list[str]]:
    """The counts of one package folder, and the unit-view walks found."""
    files = sorted(package.rglob("*.py"))
    modules = {_module(package, f) for f in files}
    result: Counter[str] = Counter()
    walks: list[str] = []
    imports: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        tree = ast.parse(text)
        rel = str(path.relative_to(package.parent))
        nodes = list(ast.walk(tree))
        result["lines"] += len(text.splitlines())
        result["statements"] += sum(isinstance(n, ast.stmt) for n in nodes)
        result["inline [:8] cuts"] += text.count("[:8]")
        result["/proc/self/maps or madvise uses"] += text.count("/proc/self/maps") + sum(
            isinstance(n, ast.Call) and "madvise" in _called(n) for n in nodes
        )
        deps: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                if {_base_name(b) for b in node.bases} & MODES:
                    result["interception mechanisms (dispatch/function modes)"] += 1
            elif isinstance(node, ast.Call):
                called = _called(node)
                if called in CHANNELS and not rel.endswith("runtime/agreement.py"):
                    result["error/object channels outside the agreement"] += 1
                if called in WALKS and "/planning/" not in f"/{rel}":
                    walks.append(f"{rel}:{called}")
            elif isinstance(node, ast.FunctionDef) and any(
                k in node.name for k in ("names", "listed", "format_list")
            ):
                if any(isinstance(n, ast.Call) and _called(n) == "join" for n in ast.walk(node)):
                    result["list formatters"] += 1
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        name = _module(package, path)
        imports[name] = {d for d in deps if d in modules and d != name}
    result["subtree-walk call sites outside the planner"] = len(walks)
    result["modules in an import cycle"] = len(_cycles(imports))
    return result, sorted(walks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="git revisions")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--walks", action="store_true", help="list each unit-view walk")
    args = parser.parse_args(argv)
    columns: list[tuple[str, Counter[str], list[str]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, rev in enumerate(args.revs):
            commit, folder = extract(rev, Path(tmp) / str(i))
            columns.append((commit[:7], *counts(folder / "fsdp_builder")))
    keys = list(dict.fromkeys(k for _, col, _ in columns for k in col))
    lines = [
        f"`python -m benchmarks.lean_counts {' '.join(args.revs)}`",
        "",
        "| count | " + " | ".join(f"`{c}`" for c, _, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
        *(f"| {k} | " + " | ".join(str(col[k]) for _, col, _ in columns) + " |" for k in keys),
    ]
    if args.walks:
        for commit, _, walks in columns:
            lines += ["", f"Walks at `{commit}`:", ""]
            lines += [f"- `{w}`" for w in walks]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
