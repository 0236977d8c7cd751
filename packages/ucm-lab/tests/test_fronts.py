"""The distributions' seams: each library package imports another only through its public
front (``ucm.core``, its two public modules of settings and the block digest's definition;
``ucm.kernels`` and its mover),
and only downwards (adapters -> kernels -> core); ucm-core imports no engine and no torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
#: what another distribution may import of each library package
FRONTS = {
    # the digest: a GPU's copy kernels compute it as the core does (ucm.kernels.digest)
    "ucm.core": {"ucm.core", "ucm.core.config", "ucm.core.settings", "ucm.core.digest"},
    "ucm.kernels": {"ucm.kernels", "ucm.kernels.mover"},
    "ucm.vllm": {"ucm.vllm"},
    "ucm.fastdeploy": {"ucm.fastdeploy"},
}
#: the packages each may import at all: imports go downwards only
BELOW = {
    "ucm.core": set(),
    "ucm.kernels": {"ucm.core"},
    "ucm.vllm": {"ucm.core", "ucm.kernels"},
    "ucm.fastdeploy": {"ucm.core", "ucm.kernels"},
}
SOURCES = {
    "ucm.core": "ucm-core",
    "ucm.kernels": "ucm-kernels",
    "ucm.vllm": "ucm-vllm",
    "ucm.fastdeploy": "ucm-fastdeploy",
}


def _imports(package: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every absolute import in ``package``'s sources."""
    found = []
    for file in (PACKAGES / SOURCES[package] / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found += [(file.name, node.lineno, m) for m in modules]
    return found


def _owner(module: str) -> str | None:
    return next((p for p in FRONTS if module == p or module.startswith(p + ".")), None)


def test_packages_import_each_other_through_their_fronts_and_downwards_only():
    problems = []
    for package in SOURCES:
        for file, line, module in _imports(package):
            owner = _owner(module)
            if owner is None or owner == package:
                continue
            if owner not in BELOW[package]:
                problems.append(f"{package} {file}:{line} imports {module}: not below it")
            elif module not in FRONTS[owner]:
                problems.append(
                    f"{package} {file}:{line} imports {module}, an internal module of "
                    f"{owner} (import it from {owner})"
                )
    assert not problems, "\n".join(problems)


def test_the_core_imports_no_engine_and_no_torch():
    engines = ("vllm", "paddle", "fastdeploy", "torch", "triton")
    found = [
        f"{file}:{line} imports {module}"
        for file, line, module in _imports("ucm.core")
        if module.split(".")[0] in engines
    ]
    assert not found, found


def test_the_core_has_no_import_circles():
    # every import counts, those inside functions too: a store kind's settings name their
    # store in a string (ucm.core.store.kinds), so no settings module imports its store
    src = PACKAGES / "ucm-core" / "src"
    modules = {}
    for file in src.rglob("*.py"):
        name = ".".join(file.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = file
    graph = {name: set() for name in modules}
    for name, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {m for m in found if m in modules and m != name}
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, circles


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph``, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found
