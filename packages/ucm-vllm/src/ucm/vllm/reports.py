"""A rank's half of KV events (:mod:`ucm.vllm.events`): the blocks it stored, and those it
dropped from the store (found corrupt on a load, or evicted by its own dumps).

An eviction can come before the stored report of the same block: a dump larger than the
store's room evicts the oldest blocks of its own batch while the batch is still being
written.  The scheduler announces a block removed only once it announced it stored, so
such an eviction waits here until the dump of that block is done, then follows its stored
report.  Plain data, no vLLM: the worker side runs on it alone."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from ucm.vllm.plan import DROPPED, STORED, Report


class RankReports:
    """What this rank stored or dropped since the scheduler last asked."""

    def __init__(self) -> None:
        self._reports: list[Report] = []
        self._dumping: Counter[Report] = Counter()  # the DROPPED reports of blocks in flight
        self._evicted_in_flight: set[Report] = set()
        self._lock = threading.Lock()

    def dumping(self, names: Sequence[Report]) -> None:
        """A dump of these blocks (their DROPPED reports) starts."""
        with self._lock:
            self._dumping.update(names)

    def dumped(self, names: Sequence[Report], stored: Sequence[bool]) -> None:
        """A dump is done: the blocks ``stored`` are reported stored, followed by those
        evicted meanwhile."""
        with self._lock:
            for name, ok in zip(names, stored):
                self._dumping[name] -= 1
                in_flight = self._dumping[name] > 0
                if not in_flight:
                    del self._dumping[name]
                if ok:
                    self._reports.append((STORED, *name[1:]))
                if not in_flight and name in self._evicted_in_flight:
                    self._evicted_in_flight.discard(name)
                    if ok:
                        self._reports.append(name)

    def dropped(self, names: Sequence[Report]) -> None:
        """These blocks left the store (corrupt, or evicted)."""
        with self._lock:
            for name in names:
                if name in self._dumping:
                    self._evicted_in_flight.add(name)  # after its stored report
                else:
                    self._reports.append(name)

    def take(self) -> list[Report]:
        with self._lock:
            reports, self._reports = self._reports, []
        return reports


def dropped_name(group: int, chain_key: bytes) -> Report:
    return (DROPPED, group, chain_key)
