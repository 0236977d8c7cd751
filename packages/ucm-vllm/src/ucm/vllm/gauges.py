"""The store's gauges (reachable, bytes, blocks, capacity), sampled by the scheduler's
connector on a thread of its own: asking a store its usage may touch a disk or a network,
and the engine's step must never wait for that."""

from __future__ import annotations

import logging
import threading

from ucm.core import Store
from ucm.vllm.stores import ConnectorStores

log = logging.getLogger(__name__)

#: seconds between samples
INTERVAL_S = 5.0


def sample(stores: ConnectorStores | None) -> dict[str, float]:
    """The gauges of :data:`ucm.vllm.counters.GAUGES` now (the full and window stores of a
    hybrid model together); a store that cannot say is down."""
    if stores is None:
        return {"store_up": 0}
    parts: list[Store] = [stores.full, *([stores.window] if stores.window else [])]
    try:
        up = all(store.reachable for store in parts)
        usages = [store.usage() for store in parts]
    except Exception as exc:  # noqa: BLE001 - a store that cannot answer is down
        log.debug("ucm: store usage unavailable: %s", exc)
        return {"store_up": 0}
    out: dict[str, float] = {"store_up": int(up)}
    if all(u.whole_store for u in usages):
        out["store_bytes"] = sum(u.bytes for u in usages)
        out["store_blocks"] = sum(u.blocks for u in usages)
    capacities = [u.capacity_bytes for u in usages]
    if all(c is not None for c in capacities):
        out["store_capacity_bytes"] = sum(c for c in capacities if c is not None)
    return out


class GaugeSampler:
    """Samples the gauges every ``interval_s`` seconds; :meth:`take` hands each sample out
    once."""

    def __init__(self, stores: ConnectorStores | None, interval_s: float = INTERVAL_S) -> None:
        self._stores = stores
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._latest: dict[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ucm-gauges", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            values = sample(self._stores)
            with self._lock:
                self._latest = values
            if self._stop.wait(self._interval_s):
                return

    def take(self) -> dict[str, float] | None:
        """The newest sample not yet taken, or None."""
        with self._lock:
            values, self._latest = self._latest, None
        return values

    def close(self) -> None:
        self._stop.set()
