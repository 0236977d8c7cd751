"""Writes to the backing store behind the engine's back: a block the local tier holds is
copied from there to the store below on a thread of its own, so that a dump costs the
engine the local tier's time (a memory copy) and not a disk's or a network's.

The queue holds at most ``budget_bytes`` of blocks not yet written below; past that, the
tiered store writes through from the caller's buffers instead (the engine then waits for
the slower tier, which is the back-pressure of a backing store that cannot keep up).  A
block the local tier evicted before its turn is not written below (its copy is gone: a miss
there, as any evicted block is).  Failures below are counted and logged, a line a minute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from ucm.core.store.base import Store
from ucm.core.store.task import Status
from ucm.core.threads import store_thread

log = logging.getLogger(__name__)

#: the longest a backing write may take before it counts as failed (its copy is then freed)
WRITE_TIMEOUT_S = 60.0
#: what close() waits for the queue to drain before dropping the rest
CLOSE_WAIT_S = 10.0
#: blocks moved at a time
BATCH_KEYS = 64
_REPORT_EVERY_S = 60.0


class WriteBehind:
    """The queue of blocks to copy from ``front`` to ``backing``, and its thread."""

    def __init__(self, front: Store, backing: Store, budget_bytes: int) -> None:
        self.front = front
        self.backing = backing
        self.budget_bytes = budget_bytes
        self._queue: deque[tuple[bytes, int, bytes]] = deque()  # key, size, layout
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._unreported = 0  # blocks whose write below failed, not logged yet
        self._reported_at = 0.0
        self._thread = store_thread(self._run, "ucm-write-behind")
        self._thread.start()

    def offer(self, keys: Sequence[bytes], sizes: Sequence[int], layout: bytes) -> bool:
        """Queue these blocks (held by the local tier) for the backing store; False, queuing
        nothing, when they would pass the budget (the caller then writes through)."""
        total = sum(sizes)
        with self._cond:
            if self._closing or self._queued_bytes + total > self.budget_bytes:
                return False
            self._queue.extend((bytes(k), n, layout) for k, n in zip(keys, sizes))
            self._queued_bytes += total
            self._cond.notify()
        return True

    def forget(self, keys: Sequence[bytes], timeout: float = WRITE_TIMEOUT_S) -> None:
        """Drop these keys from the queue, and wait for the batch being written (it may
        hold them), so that a removal below is not undone by a write behind it."""
        drop = {bytes(k) for k in keys}
        deadline = time.monotonic() + timeout
        with self._cond:
            kept = deque(item for item in self._queue if item[0] not in drop)
            self._queued_bytes -= sum(n for k, n, _ in self._queue if k in drop)
            self._queue = kept
            while self._busy and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())

    def pending(self) -> int:
        """Blocks queued or being written."""
        with self._cond:
            return len(self._queue) + self._busy

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or being written; whether that happened in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Write what is queued (``CLOSE_WAIT_S`` at most), then stop."""
        if not self.drain(CLOSE_WAIT_S):
            log.warning(
                "ucm tiered store: %d blocks not written to the backing store at close",
                self.pending(),
            )
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(WRITE_TIMEOUT_S)

    def _take(self) -> list[tuple[bytes, int, bytes]] | None:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if self._closing:
                return None
            layout = self._queue[0][2]
            batch: list[tuple[bytes, int, bytes]] = []
            while self._queue and len(batch) < BATCH_KEYS and self._queue[0][2] == layout:
                batch.append(self._queue.popleft())
            self._busy = True
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._move(batch)
            except Exception:  # a bug must not stop the queue
                log.exception("ucm tiered store: writing behind failed")
                self._unreported += len(batch)
            finally:
                with self._cond:
                    self._queued_bytes -= sum(n for _, n, _ in batch)
                    self._busy = False
                    self._cond.notify_all()
            self._report()

    def _move(self, batch: list[tuple[bytes, int, bytes]]) -> None:
        keys = [k for k, _, _ in batch]
        layout = batch[0][2]
        copies = [bytearray(n) for _, n, _ in batch]  # sizes the engine gave, not read
        loaded = self.front.wait(self.front.load(keys, copies, layout), WRITE_TIMEOUT_S)
        held = [i for i, r in enumerate(loaded) if r.ok]
        if not held:
            return
        task = self.backing.dump([keys[i] for i in held], [copies[i] for i in held], layout)
        try:
            results = self.backing.wait(task, WRITE_TIMEOUT_S)
        except TimeoutError:
            task.cancel(wait=WRITE_TIMEOUT_S)
            results = [None] * len(held)  # type: ignore[list-item]
        ok = sum(r is not None and r.status is Status.OK for r in results)
        self._unreported += len(held) - ok

    def _report(self) -> None:
        now = time.monotonic()
        if self._unreported and now - self._reported_at >= _REPORT_EVERY_S:
            log.warning(
                "ucm tiered store: %d blocks could not be written to the backing store (they "
                "stay in the local tier only)",
                self._unreported,
            )
            self._unreported = 0
            self._reported_at = now
