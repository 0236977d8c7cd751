"""A store's unit of work: one result per key (:class:`KeyResult`), gathered by a
:class:`Task` that the caller waits on, cancels, or combines from the tasks of several
stores."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

log = logging.getLogger(__name__)


class Status(enum.Enum):
    OK = "ok"
    MISS = "miss"  # nothing stored under the key
    CORRUPT = "corrupt"  # stored, but failed verification; removed, so it reads as a miss
    ERROR = "error"  # the I/O failed (disk full, permission, wrong buffer size, ...)
    CANCELLED = "cancelled"  # the task was cancelled before this key was done (not stored)


@attrs.frozen
class KeyResult:
    status: Status
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


OK = KeyResult(Status.OK)
MISS = KeyResult(Status.MISS)
CANCELLED = KeyResult(Status.CANCELLED)


def verified_prefix(
    results: Sequence[KeyResult | None], blocks: Sequence[int] | None = None
) -> int:
    """How many leading blocks count after a load: a block counts only if it and every
    block before it verified, since the engine recomputes from the first one that did not.

    ``results[i]`` is the result of block ``blocks[i]`` (several results may share a block:
    one per KV-cache group); by default result ``i`` is block ``i``.  ``None``: no result
    (not done, timed out, the store was unavailable), which counts as a failure."""
    numbers = range(len(results)) if blocks is None else blocks
    failed = [b for b, r in zip(numbers, results) if r is None or not r.ok]
    if failed:
        return min(failed)
    return max(numbers, default=-1) + 1


def first_problem(results: Sequence[KeyResult | None]) -> str:
    """What went wrong with the first result that did not verify ("" when none)."""
    for result in results:
        if result is None:
            return "timed out"
        if not result.ok:
            return result.detail or result.status.value
    return ""


class Task:
    """One batched operation in flight: completed key by key by the store's workers.

    A store's worker runs each key through :meth:`run_key`, which counts the keys in
    progress, so that :meth:`cancel` can wait until none of them touches the caller's
    buffers any more."""

    __slots__ = (
        "_busy",
        "_callbacks",
        "_cancelled",
        "_event",
        "_help",
        "_idle",
        "_lock",
        "_parts",
        "_remaining",
        "_results",
    )

    def __init__(self, n: int) -> None:
        self._results: list[KeyResult | None] = [None] * n
        self._remaining = n
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # keys in progress in run_key
        self._event = threading.Event()
        self._cancelled = False
        self._callbacks: list[Callable[[Task], Any]] = []
        self._parts: list[Task] = []  # sub-tasks of a combined task, cancelled with it
        self._help: Callable[[], bool] | None = None  # see help_with
        if n == 0:
            self._event.set()

    def __len__(self) -> int:
        return len(self._results)

    @classmethod
    def completed(cls, results: Sequence[KeyResult]) -> Task:
        task = cls(len(results))
        task.set_results(range(len(results)), results)
        return task

    def set_result(self, index: int, result: KeyResult) -> None:
        self.set_results((index,), (result,))

    def set_results(self, indices: Sequence[int], results: Sequence[KeyResult]) -> None:
        """Record the results of several keys at once (one hold of the lock)."""
        with self._lock:
            mine = self._results
            for index in indices:
                if mine[index] is not None:
                    raise RuntimeError(f"result {index} of a task set twice")
            for index, result in zip(indices, results):
                mine[index] = result
            self._remaining -= len(indices)
            finished = self._remaining == 0
            callbacks = self._callbacks if finished else []
            if finished:
                self._callbacks = []
        if finished:
            self._event.set()
            for callback in callbacks:
                callback(self)

    def add_done_callback(self, callback: Callable[[Task], Any]) -> None:
        """Run ``callback(task)`` once every key has a result (now, if it already has)."""
        with self._lock:
            if self._remaining:
                self._callbacks.append(callback)
                return
        callback(self)

    def run_key(self, index: int, work: Callable[[], KeyResult]) -> None:
        """Run ``work()`` for key ``index`` and record its result, or record ``CANCELLED``
        without running it once the task is cancelled.  An exception is an ``ERROR``
        result: a bug in one key must not leave the task hanging."""
        self.run_keys((index,), lambda: (work(),))

    def run_keys(
        self,
        indices: Sequence[int],
        work: Callable[[], Sequence[KeyResult]],
        skipped: Callable[[], Any] | None = None,
    ) -> None:
        """:meth:`run_key` for several keys moved by one call (``work()`` returns their
        results in order).  ``skipped()``, where given, runs instead of ``work`` once the
        task is cancelled, before the keys finish as ``CANCELLED``: it lets go of what the
        keys held (a caller that sees the task done finds it let go)."""
        self.try_keys(indices, work, skipped)

    def try_keys(
        self,
        indices: Sequence[int],
        work: Callable[[], Sequence[KeyResult | None]],
        skipped: Callable[[], Any] | None = None,
    ) -> list[int]:
        """:meth:`run_keys` where ``work()`` may leave keys undone (None for their result):
        they are returned, the caller's to hand to another worker."""
        with self._lock:
            start = not self._cancelled
            if start:
                self._busy += 1
        if not start:
            if skipped is not None:
                try:
                    skipped()
                except Exception:
                    log.exception("ucm store: unexpected failure letting go of a cancelled key")
            self.set_results(indices, [CANCELLED] * len(indices))
            return []
        try:
            try:
                results = work()
                if len(results) != len(indices):
                    raise RuntimeError(f"{len(results)} results for {len(indices)} keys")
            except Exception as exc:
                log.exception("ucm store: unexpected failure")
                results = [KeyResult(Status.ERROR, f"unexpected: {exc!r}")] * len(indices)
            done = [(i, r) for i, r in zip(indices, results) if r is not None]
            if done:  # callbacks run here, still counted as busy
                self.set_results([i for i, _ in done], [r for _, r in done])
            return [i for i, r in zip(indices, results) if r is None]
        finally:
            with self._lock:
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()

    def cancel(self, wait: float | None = 0.0) -> bool:
        """Stop the task: keys not yet started finish as ``CANCELLED``, and a dump in
        progress is not published (its block is not stored); a load in progress completes.

        ``wait``: seconds to wait (``None``: no limit) until no key is in progress.  Returns
        whether none is: then the store no longer reads or writes the caller's buffers.  (Not
        from a done callback of the task itself: the callback counts as in progress.)
        """
        self._cancelled = True
        deadline = None if wait is None else time.monotonic() + wait
        quiet = True
        seen = 0
        # A part may start while an earlier one finishes (a tiered load reads below once
        # the local tier has answered, from that answer's callback, which counts as the
        # earlier part's work): once the earlier ones are quiet, the later ones are waited
        # for too.  Every part is told, whether or not an earlier one went quiet in time.
        while True:
            with self._lock:
                parts = self._parts[seen:]
            if not parts:
                break
            seen += len(parts)
            quiet = all([part.cancel(_left(deadline)) for part in parts]) and quiet
        with self._lock:
            while self._busy:
                left = _left(deadline)
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return quiet

    def add_part(self, part: Task) -> None:
        """Make ``part`` a sub-task started later (cancelled with this one, at once if this
        one already is)."""
        with self._lock:
            self._parts.append(part)
        if self._cancelled:
            part.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._event.is_set()

    def partial(self) -> list[KeyResult | None]:
        """The results so far: ``None`` for keys not done yet (never blocks)."""
        with self._lock:
            return list(self._results)

    def help_with(self, work: Callable[[], bool]) -> None:
        """Let a thread that waits for this task do some of its work meanwhile: ``work()``
        runs one piece the store's threads have not taken yet, and returns False when none
        is left.  A thread that waits would otherwise idle on its core while the store's
        threads copy on theirs (a vLLM worker's sync load waits with its compute core idle,
        its store threads on the one core vLLM leaves to everything else)."""
        self._help = work

    def wait(self, timeout: float | None = None) -> list[KeyResult]:
        """The results, once every key has one; the waiting thread meanwhile does work its
        task, or a part of it, offers (:meth:`help_with`).  ``TimeoutError`` past
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # a piece is started only while time is left, and ends within its own bound (a
        # copy of a few MiB, or the dram arena's lock wait, LOCK_WAIT_S)
        while not self._event.is_set() and (deadline is None or time.monotonic() < deadline):
            if not self._help_once():
                break
        if not self._event.wait(_left(deadline)):
            raise TimeoutError(f"{self._remaining} of {len(self._results)} keys still in flight")
        return [r for r in self._results if r is not None]

    def _help_once(self) -> bool:
        """One piece of the work this task or a part of it offers, done on this thread:
        False when none is on offer now."""
        work = self._help
        if work is not None:
            if work():
                return True
            self._help = None  # nothing left to take (and no cycle kept alive)
        with self._lock:
            parts = list(self._parts)
        return any(part._help_once() for part in parts if not part.done())

    @classmethod
    def combine(cls, n: int, parts: Sequence[tuple[Sequence[int], Task]]) -> Task:
        """A task over ``n`` keys whose results come from ``parts`` (positions, sub-task)."""
        whole = cls(n)
        whole._parts = [part for _, part in parts]
        for positions, part in parts:

            def forward(done: Task, positions: Sequence[int] = positions) -> None:
                for pos, result in zip(positions, done.wait(0)):
                    whole.set_result(pos, result)

            part.add_done_callback(forward)
        return whole


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
