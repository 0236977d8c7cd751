"""The tiered store: a local tier over another store (:mod:`.config`, :mod:`.store`)."""

from ucm.core.store.tiered.config import TieredStoreConfig
from ucm.core.store.tiered.store import TieredStore

__all__ = ["TieredStore", "TieredStoreConfig"]
