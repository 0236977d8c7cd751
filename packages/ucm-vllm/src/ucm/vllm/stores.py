"""The connector's stores: one for a model of full-attention groups; for a hybrid model a
full-attention store and a window store, so that neither evicts the other's blocks (the
capacity split is ``wa_capacity_fraction``, see :mod:`ucm.core.hybrid_store`)."""

from __future__ import annotations

import logging

from ucm.core import Store, create_store, split_store_config
from ucm.core.config import StoreSettings, for_lookups_only
from ucm.vllm.layout import GroupLayout

log = logging.getLogger(__name__)


class ConnectorStores:
    def __init__(self, full: Store, window: Store | None) -> None:
        self.full = full
        self.window = window

    @classmethod
    def open(
        cls, config: StoreSettings, hybrid: bool, wa_fraction: float, *, lookups_only: bool = False
    ) -> ConnectorStores | None:
        """The stores, or None (with a warning) when they cannot be used: serve without.
        ``lookups_only``: for the scheduler, which never moves a block."""
        if lookups_only:
            config = for_lookups_only(config)
        try:
            if not hybrid:
                return cls(create_store(config), None)
            fa_config, wa_config = split_store_config(config, wa_fraction)
            full = create_store(fa_config)
            try:
                return cls(full, create_store(wa_config))
            except OSError:
                full.close()
                raise
        except OSError as exc:
            log.warning("UCMConnector: store unavailable, serving without it: %s", exc)
            return None

    def of(self, group: GroupLayout) -> Store:
        if group.kind == "window" and self.window is not None:
            return self.window
        return self.full

    def check_block_bytes(self, group: GroupLayout, nbytes: int) -> None:
        """Refuse at start-up a store that cannot hold one of ``group``'s blocks."""
        self.of(group).check_block_bytes(nbytes)

    def take_evicted(self) -> list[object]:
        """The tags of the watched blocks the stores evicted (``Store.watch_evictions``)."""
        return self.full.take_evicted() + (self.window.take_evicted() if self.window else [])

    @property
    def evicted_blocks(self) -> int:
        return self.full.evicted_blocks + (self.window.evicted_blocks if self.window else 0)

    @property
    def read_only(self) -> bool:
        return self.full.read_only or (self.window is not None and self.window.read_only)

    def close(self) -> None:
        self.full.close()
        if self.window is not None:
            self.window.close()
