"""The mooncake store: blocks in a Mooncake Store cluster, shared by every host on it.

- :mod:`.config`: its settings;
- :mod:`.link`: the client and whether its master answers;
- :mod:`.store`: :class:`~ucm.core.store.mooncake.store.MooncakeStore` (imported on use:
  opening one loads Mooncake's client).
"""

from ucm.core.store.mooncake.config import MooncakeStoreConfig

__all__ = ["MooncakeStoreConfig"]
