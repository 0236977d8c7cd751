"""The dump-task lifecycle of requests, engine-neutral.

The engine's save hook submits dump tasks and returns at once.  The tracker remembers them
per request, and

* ``reap()`` (every step) forgets tasks that completed, counting their results;
* ``finish(req)`` marks a request finished: if it still has dumps in flight the engine must
  keep its blocks (delayed free) until ``pop_finished()`` reports it;
* ``flush(reqs)`` waits the dumps of preempted requests, whose blocks the engine is about to
  reuse;
* ``discard(req)`` forgets a request entirely (aborted, or never dumped).

Every task handle is dropped once its results are counted, on success and on failure, and a
request's state is dropped when it ends, so the tracker holds nothing for finished work.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Iterable

import attrs
from ucm.core.store.task import KeyResult, Task

log = logging.getLogger(__name__)


@attrs.define
class DumpCounts:
    """Blocks dumped (or already stored) and blocks whose dump failed, by status."""

    ok: int = 0
    failed: int = 0
    failed_by_status: Counter[str] = attrs.field(factory=Counter)  # Status values

    def add(self, results: Iterable[KeyResult]) -> None:
        for result in results:
            if result.ok:
                self.ok += 1
            else:
                self.failed += 1
                self.failed_by_status[result.status.value] += 1


class DumpTracker:
    def __init__(self) -> None:
        self._tasks: dict[Hashable, list[Task]] = {}
        self._finished: set[Hashable] = set()
        self.counts = DumpCounts()

    def submit(self, req_id: Hashable, task: Task) -> None:
        self._tasks.setdefault(req_id, []).append(task)

    def _collect(self, task: Task) -> None:
        results = task.wait(0)
        before = self.counts.failed
        self.counts.add(results)
        if self.counts.failed != before:
            problems = {r.detail or r.status.value for r in results if not r.ok}
            log.warning(
                "ucm: %d block dumps failed: %s",
                self.counts.failed - before,
                "; ".join(sorted(problems)),
            )

    def _reap_request(self, req_id: Hashable) -> bool:
        """Drop the request's completed tasks; True when none remain."""
        tasks = self._tasks.get(req_id)
        if tasks is None:
            return True
        pending = []
        for task in tasks:
            if task.done():
                self._collect(task)
            else:
                pending.append(task)
        if pending:
            self._tasks[req_id] = pending
            return False
        del self._tasks[req_id]
        return True

    def reap(self) -> None:
        """Forget completed tasks of every request (call once per engine step)."""
        for req_id in list(self._tasks):
            self._reap_request(req_id)

    def finish(self, req_id: Hashable) -> bool:
        """The request ended normally.  True: its dumps are in flight, keep its blocks."""
        if self._reap_request(req_id):
            return False
        self._finished.add(req_id)
        return True

    def pop_finished(self, *, timeout: float | None = 0.0) -> set[Hashable]:
        """Finished requests whose dumps are all complete; their state is dropped.

        ``timeout=0`` polls; ``None`` waits for all of them."""
        done = set()
        for req_id in list(self._finished):
            if timeout != 0:
                for task in self._tasks.get(req_id, []):
                    task.wait(timeout)
            if self._reap_request(req_id):
                self._finished.discard(req_id)
                done.add(req_id)
        return done

    def flush(self, req_ids: Iterable[Hashable], timeout: float | None = None) -> None:
        """Wait every in-flight dump of these requests (preempted: their blocks go back)."""
        for req_id in req_ids:
            for task in self._tasks.get(req_id, []):
                try:
                    task.wait(timeout)
                except TimeoutError:
                    task.cancel()
                    log.warning("ucm: dump of preempted request %s timed out", req_id)
            self._reap_request(req_id)

    def flush_all(self, timeout: float | None = None) -> None:
        """Wait every dump in flight (shutdown)."""
        self.flush(list(self._tasks), timeout)

    def discard(self, req_id: Hashable) -> None:
        """Forget the request; its tasks are cancelled where they have not started."""
        for task in self._tasks.pop(req_id, []):
            task.cancel()
        self._finished.discard(req_id)

    def pending(self, req_id: Hashable) -> int:
        return len(self._tasks.get(req_id, ()))

    def in_flight(self) -> list[Task]:
        """Every dump task not reaped yet, of every request."""
        return [task for tasks in self._tasks.values() for task in tasks]

    def __len__(self) -> int:
        """Requests with state (tasks in flight or finished-and-waiting)."""
        return len(self._tasks.keys() | self._finished)
