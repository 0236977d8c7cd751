"""Which of the blocks a caller asked about this store object evicted.

An engine that announces its blocks to a router (vLLM's KV events) must say when one is
gone.  The store knows which blocks its own eviction passes remove, by the name it files
them under (a key keyed by the secret, in a signed store); the caller knows the blocks by
what it announced.  :class:`EvictionWatch` joins the two: the caller watches the keys it
stored, each with a tag of its own, and takes the tags of those evicted since it last asked.
Both sides are bounded: the most recently watched ``limit`` names, and as many tags.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

#: names watched at most by one store object (the oldest forgotten first)
WATCH_LIMIT = 100_000


class EvictionWatch:
    """Names watched (each with the caller's tag), and the tags of those evicted."""

    def __init__(self, limit: int = WATCH_LIMIT) -> None:
        self.limit = limit
        self._watched: OrderedDict[Hashable, Any] = OrderedDict()
        self._evicted: list[Any] = []
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._watched)  # read without the lock: a hint to skip the work

    def watch(self, names: Iterable[Hashable], tags: Iterable[Any]) -> None:
        with self._lock:
            for name, tag in zip(names, tags):
                self._watched[name] = tag
                self._watched.move_to_end(name)
            while len(self._watched) > self.limit:
                self._watched.popitem(last=False)

    def evicted(self, names: Iterable[Hashable]) -> None:
        """The store removed these blocks to make room."""
        with self._lock:
            for name in names:
                tag = self._watched.pop(name, None)
                if tag is not None:
                    self._evicted.append(tag)
            del self._evicted[: max(0, len(self._evicted) - self.limit)]

    def take(self) -> list[Any]:
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted
