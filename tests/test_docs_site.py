"""The documentation site: the API reference names every public name, and every page is in
the navigation (``mkdocs build --strict`` in the test command builds it)."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import fsdp_builder

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
DIRECTIVE = re.compile(r"^:::\s+fsdp_builder\.(?P<name>\w+)\s*$", re.M)
NAV_PAGE = re.compile(r"^\s*-\s+(?:[^:\n]+:\s+)?(?P<page>[\w/]+\.md)\s*$", re.M)


def api_names() -> list[str]:
    """Names documented with ``::: fsdp_builder.Name`` in docs/api/*.md."""
    return [
        m["name"]
        for page in sorted(DOCS.glob("api/*.md"))
        for m in DIRECTIVE.finditer(page.read_text())
    ]


def test_api_reference_lists_every_public_name_once() -> None:
    names = api_names()
    duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
    assert not duplicates, f"documented twice: {duplicates}"
    public = set(fsdp_builder.__all__)
    assert public - set(names) == set(), "public names missing from docs/api/*.md"
    assert set(names) - public == set(), "docs/api/*.md documents names that are not public"


def test_every_page_is_in_the_navigation() -> None:
    nav = set(NAV_PAGE.findall((REPO / "mkdocs.yml").read_text()))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav


def test_the_readme_is_short_and_starts_with_its_two_commands() -> None:
    """At most 150 lines; its first two code blocks are the demo's install-and-run command and
    the test command, which ``.ci/run`` runs as it is."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    demo, tests = blocks[0].strip(), blocks[1].strip()
    assert "pip install -q torch==2.13.0" in demo and demo.endswith("fsdp-builder demo")
    assert "pip install -q torch==2.13.0" in tests and tests.endswith("pytest -q")
    run = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert run[-1] == tests  # the last command of .ci/run, the test command itself


def test_every_private_torch_import_is_in_the_private_names_table() -> None:
    """Each import of a private torch or transformers module or name in the library is named in
    docs/private_names.md, the list to check on an upgrade."""
    table = (DOCS / "private_names.md").read_text()
    unlisted: list[str] = []
    for path in sorted((REPO / "fsdp_builder").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            parts = node.module.split(".")
            if parts[0] not in ("torch", "transformers"):
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    listed = alias.name in table
                elif any(part.startswith("_") for part in parts):
                    listed = node.module in table or alias.name in table
                else:
                    continue
                if not listed:
                    unlisted.append(f"{node.module}.{alias.name} ({path.name})")
    assert not unlisted, unlisted


def _defined_in_library(trees: list[ast.Module]) -> set[str]:
    """Underscore names the library gives itself: functions, classes, variables, arguments,
    attributes set on ``self``/``cls``, import aliases."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[0])
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    return own


def _private(name: object) -> bool:
    return (
        isinstance(name, str)
        and name.startswith("_")
        and not name.startswith("__")
        and name.isidentifier()
    )


def private_names_read(trees: list[ast.Module]) -> set[str]:
    """Underscore names of other code the library reads: attributes (``x._name``), names asked
    of ``getattr``/``hasattr``/``setattr``, and names in module-level tuples of names to probe."""
    found: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                found.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and _private(node.args[1].value)
            ):
                found.add(str(node.args[1].value))
        for statement in tree.body:
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Tuple):
                found |= {
                    str(e.value)
                    for e in statement.value.elts
                    if isinstance(e, ast.Constant) and _private(e.value)
                }
    return found - _defined_in_library(trees)


def test_every_private_name_the_library_reads_is_in_the_table() -> None:
    """Not only imports: every underscore attribute or probed name of torch, transformers or
    Python that the library's source reads is named in docs/private_names.md."""
    trees = [ast.parse(p.read_text()) for p in sorted((REPO / "fsdp_builder").rglob("*.py"))]
    table = (DOCS / "private_names.md").read_text()
    unlisted = sorted(n for n in private_names_read(trees) if f"{n}" not in table)
    assert not unlisted, unlisted


def test_the_private_name_scan_sees_what_it_must() -> None:
    """The scan finds an attribute read, a probed name and a tuple of names, and leaves the
    library's own underscore names alone."""
    source = (
        "PROBED = ('_probed',)\n"
        "def _mine(x):\n"
        "    x._own = 1\n"
        "    return x._read, getattr(x, '_asked'), _mine\n"
        "class _Own:\n"
        "    def f(self):\n"
        "        self._own = 2\n"
    )
    assert private_names_read([ast.parse(source)]) == {"_probed", "_read", "_asked"}


def test_the_docs_site_is_built_by_the_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "pytest -q" in line)
    assert "mkdocs build --strict -q && pytest -q" in command
    assert command in (REPO / ".ci" / "run").read_text()


# Names from other libraries, checked by those libraries' own documentation rather than ours.
FOREIGN = {"torch", "transformers", "accelerate", "safetensors", "structlog", "attrs", "nn"}
FOREIGN |= {"dist", "np", "os", "sys", "logging", "warnings", "pytest", "json"}
FILE_SUFFIXES: tuple[str, ...] = (".py", ".md", ".json", ".safetensors", ".bin", ".pt", ".txt")
FILE_SUFFIXES += (".sh", ".yml", ".cfg", ".toml", ".npz", ".metadata", ".whl", ".index")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
CODE_NAME = re.compile(r"^(?P<dotted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?P<call>\(.*\))?$")


def code_words() -> set[str]:
    """Every identifier in the repository's Python code (library, harness, recipes, tests)."""
    text = "\n".join(
        path.read_text()
        for folder in ("fsdp_builder", "benchmarks", "docs/recipes", "tests")
        for path in (REPO / folder).rglob("*.py")
    )
    return set(re.findall(r"[A-Za-z_]\w*", text))


def test_every_code_name_a_page_mentions_exists() -> None:
    """A name in backticks with a dot or a call (``Builder.build``, ``run_build(...)``) must
    name code that exists: pages may not describe functions that were renamed or removed."""
    words = code_words()
    stale: list[str] = []
    results = REPO / "benchmarks" / "results" / "README.md"
    for page in [*sorted(DOCS.rglob("*.md")), REPO / "README.md", results]:
        for span in CODE_SPAN.findall(page.read_text()):
            found = CODE_NAME.match(span.strip())
            if found is None or ("." not in found["dotted"] and not found["call"]):
                continue
            parts = found["dotted"].split(".")
            if parts[0] in FOREIGN or found["dotted"].endswith(FILE_SUFFIXES):
                continue
            missing = [part for part in parts if part not in words]
            if missing:
                stale.append(f"{page.relative_to(REPO)}: `{span}` ({', '.join(missing)} not found)")
    assert not stale, "pages name code that does not exist:\n" + "\n".join(stale)
