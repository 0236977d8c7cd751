"""Select UCM in an unpatched FastDeploy: swap the classes its cache transfer manager uses.

FastDeploy chooses the storage backend by name (``--kvcache-storage-backend attention_store``
or ``file``) in ``cache_transfer_manager.py`` and takes the classes from
``fastdeploy.cache_manager.transfer_factory``.  :func:`install` registers an import hook that,
right after that module is imported, replaces ``AttentionStore`` by
:class:`ucm.fastdeploy.AttentionStore` (and, when asked, ``FileStore`` by
:class:`ucm.fastdeploy.UCMStorage`, which takes the same arguments).  The cache transfer
manager is a separate process FastDeploy starts with the parent's environment, so the usual
way in is a ``.pth`` file in site-packages holding one line::

    import ucm.fastdeploy.hook as h; h.install_from_env()

which does nothing unless ``UCM_FASTDEPLOY_BACKENDS`` is set (to ``attention_store``,
``file`` or ``attention_store,file``).  Importing this module imports neither FastDeploy,
paddle nor torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

TARGET = "fastdeploy.cache_manager.transfer_factory"
ENV = "UCM_FASTDEPLOY_BACKENDS"
#: FastDeploy's backend name -> (its class name, UCM's module, UCM's class)
REPLACEMENTS = {
    "attention_store": ("AttentionStore", "ucm.fastdeploy.attention_store", "AttentionStore"),
    "file": ("FileStore", "ucm.fastdeploy.storage", "UCMStorage"),
}


def _backends(names: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in chosen if n not in REPLACEMENTS]
    if unknown or not chosen:
        raise ValueError(
            f"{ENV}: unknown backend {unknown[0]!r}" if unknown else f"{ENV}: no backend named"
        )
    return chosen


def patch(module: ModuleType, backends: Sequence[str]) -> None:
    """Replace FastDeploy's classes in an imported ``transfer_factory`` module."""
    for name in backends:
        attr, ucm_module, ucm_class = REPLACEMENTS[name]
        setattr(module, attr, getattr(importlib.import_module(ucm_module), ucm_class))
        log.info("ucm fastdeploy: FastDeploy's %s backend is UCM's %s", name, ucm_class)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, backends: Sequence[str]) -> None:
        self.loader = loader
        self.backends = backends

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        patch(module, self.backends)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, backends: Sequence[str]) -> None:
        self.backends = backends

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.backends)
        return spec


def install(backends: Iterable[str] = ("attention_store",)) -> None:
    """Make FastDeploy use UCM for ``backends`` (patches now if it is already imported)."""
    chosen = _backends(backends)
    if TARGET in sys.modules:
        patch(sys.modules[TARGET], chosen)
        return
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    sys.meta_path.insert(0, _Finder(chosen))


def install_from_env(environ: Any = None) -> bool:
    """:func:`install` the backends named by ``UCM_FASTDEPLOY_BACKENDS``; False when unset."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if not value.strip():
        return False
    install(value.split(","))
    return True
