"""Import direction, read from the source with `ast` (nothing is imported, so a test process that
already loaded `app` cannot hide a violation): compute/ and storage/ never import app/, storage/
imports nothing of compute/ or app/, and there are no import cycles inside app/ (auth and
services included: the sign-in routes that call services live in app/accounts.py), storage/ and
compute/. Imports inside functions count too: they run sooner or later."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from pkg import sub` counts as pkg.sub when
    sub is a module of ours, else as pkg)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if _is_module(sub) else base)
    return out


def _sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _offenders(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in _sources(*folders):
        for mod in sorted(imports_of(path)):
            if mod.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


def test_compute_and_storage_never_import_app() -> None:
    assert _offenders(("compute", "storage"), ("app",)) == []


def test_storage_imports_nothing_of_compute_or_app() -> None:
    assert _offenders(("storage",), ("compute", "app")) == []


def test_the_contract_imports_pydantic_and_itself_only() -> None:
    """compute/contract is what the web process, the CLI and the worker share: no database, no
    artifact store, no torch (references are resolved in app/services/refs.py; task names are
    parsed in compute/contract/tasknames.py, which compute.lm.verifiable_tasks builds on)."""
    import sys

    bad = []
    for path in _sources("compute/contract"):
        for mod in sorted(imports_of(path)):
            top = mod.split(".")[0]
            if mod.startswith("compute.contract") or top in ("pydantic", "pydantic_settings"):
                continue
            if top in sys.stdlib_module_names:
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert bad == []


def import_graph(folder: str) -> dict[str, set[str]]:
    """module -> the modules under `folder` it imports."""
    graph = {_module_name(p): imports_of(p) for p in _sources(folder)}
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (strongly connected components of more than one module),
    each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in graph[m]:
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            comp = []
            while True:
                top = stack.pop()
                comp.append(top)
                if top == m:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return cycles


@pytest.mark.parametrize("folder", ["app", "storage", "compute"])
def test_no_import_cycles(folder: str) -> None:
    assert find_cycles(import_graph(folder)) == []


def test_the_checks_see_what_they_check() -> None:
    """The parser finds imports inside functions and resolves `from pkg import submodule`; the
    cycle finder finds cycles (so the empty answers above mean something)."""
    deps = imports_of(ROOT / "compute" / "worker" / "execute.py")
    assert {"compute.worker.lifecycle", "compute.jobs.runners", "compute.jobs.registry"} <= deps
    assert "compute.worker.refs" in deps  # inside execute_job
    assert "compute.worker.reconciler" in imports_of(ROOT / "compute" / "worker" / "tasks.py")
    assert imports_of(ROOT / "storage" / "repo.py") >= {"storage.jobs", "storage.fanout"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"x": {"y"}, "y": set()}) == []


def private_uses(path: Path) -> list[str]:
    """`_name`s of another module of ours that `path` reaches: `from m import _x`, or `m._x` where
    `m` is a module of ours bound by an import. A name shared across modules is public."""
    ours = ("app", "compute", "storage")
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}  # local name -> our module it names
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ours:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if _is_module(sub):
                    bound[alias.asname or alias.name] = sub
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ours and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            bad.append(f"{node.value.id}.{node.attr} ({bound[node.value.id]})")
    return bad


def test_no_private_name_is_used_across_modules() -> None:
    bad = [f"{p.relative_to(ROOT)}: {u}" for p in _sources("app", "compute", "storage")
           for u in private_uses(p)]
    assert not bad, "make these public where they are shared:\n" + "\n".join(bad)


def test_private_use_check_sees_both_forms(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("from compute.sparsity.overlap import _hidden\n"
                   "from compute.sparsity import diff as d\nd._inner()\n")
    assert private_uses(src) == ["from compute.sparsity.overlap import _hidden",
                                 "d._inner (compute.sparsity.diff)"]
