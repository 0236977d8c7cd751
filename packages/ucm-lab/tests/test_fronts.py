"""The distributions' seams: each library package imports another only through its public
front (``ucm.core`` and its two public modules of settings; ``ucm.kernels`` and its mover),
and only downwards (adapters -> kernels -> core); ucm-core imports no engine and no torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
#: what another distribution may import of each library package
FRONTS = {
    "ucm.core": {"ucm.core", "ucm.core.config", "ucm.core.settings"},
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
