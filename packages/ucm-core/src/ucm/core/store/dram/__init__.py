"""The dram store: blocks in host memory.

- :mod:`.config`: its settings (both scopes);
- :mod:`.shared`: scope ``host``, shared memory: an arena (:mod:`.arena`) on a memory filesystem,
  shared by every process on the host (:class:`SharedMemoryStore`);
- :mod:`.process`: scope ``process``, this process's own memory (:class:`DramStore`).
"""

from ucm.core.store.base import Store
from ucm.core.store.dram.config import DramStoreConfig, default_shared_memory_path
from ucm.core.store.dram.process import DramStore
from ucm.core.store.dram.shared import SharedMemoryStore


def open_store(settings: DramStoreConfig) -> Store:
    """The dram store its settings describe: shared memory (scope ``host``) or this
    process's own (scope ``process``)."""
    if settings.scope == "process":
        return DramStore(settings)
    return SharedMemoryStore(settings)


__all__ = [
    "DramStore",
    "DramStoreConfig",
    "SharedMemoryStore",
    "default_shared_memory_path",
    "open_store",
]
