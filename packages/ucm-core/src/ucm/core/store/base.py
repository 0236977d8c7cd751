"""The store interface: batched, asynchronous, with a result per key.

A store keeps opaque blocks (byte payloads) under 16-byte keys.  ``dump`` and ``load``
return a :class:`Task` at once; the I/O runs on the store's threads; ``wait`` returns one
:class:`KeyResult` per key.  Buffers handed to ``dump`` must stay unchanged, and buffers
handed to ``load`` untouched by the caller, until the task is done, or until
``task.cancel(wait=...)`` has returned true.  The content of a load buffer whose result is
not ``OK`` is undefined and must not be used.

A key's buffer is one buffer-protocol object, or a list or tuple of them whose concatenation
is the payload (a scatter-gather list): an engine's cache blocks are dumped from and loaded
into where they live, with no staging copy, and the stored block is the same either way.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from ucm.core.keys import KEY_BYTES

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


@attrs.frozen
class StoreUsage:
    blocks: int
    bytes: int
    capacity_bytes: int | None


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
        if n == 0:
            self._event.set()

    def __len__(self) -> int:
        return len(self._results)

    @classmethod
    def completed(cls, results: Sequence[KeyResult]) -> Task:
        task = cls(len(results))
        for i, result in enumerate(results):
            task.set_result(i, result)
        return task

    def set_result(self, index: int, result: KeyResult) -> None:
        with self._lock:
            if self._results[index] is not None:
                raise RuntimeError(f"result {index} of a task set twice")
            self._results[index] = result
            self._remaining -= 1
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

    def run_keys(self, indices: Sequence[int], work: Callable[[], Sequence[KeyResult]]) -> None:
        """:meth:`run_key` for several keys moved by one call (``work()`` returns their
        results in order)."""
        with self._lock:
            start = not self._cancelled
            if start:
                self._busy += 1
        if not start:
            for index in indices:
                self.set_result(index, CANCELLED)
            return
        try:
            try:
                results = work()
                if len(results) != len(indices):
                    raise RuntimeError(f"{len(results)} results for {len(indices)} keys")
            except Exception as exc:
                log.exception("ucm store: unexpected failure")
                results = [KeyResult(Status.ERROR, f"unexpected: {exc!r}")] * len(indices)
            for index, result in zip(indices, results):
                self.set_result(index, result)  # callbacks run here, still counted as busy
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
        with self._lock:
            parts = list(self._parts)
        deadline = None if wait is None else time.monotonic() + wait
        quiet = all(part.cancel(_left(deadline)) for part in parts)
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

    def wait(self, timeout: float | None = None) -> list[KeyResult]:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self._remaining} of {len(self._results)} keys still in flight")
        return [r for r in self._results if r is not None]

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


class Payload:
    """One key's buffer as byte views: the payload is the concatenation of ``parts``.

    :meth:`deferred` makes one whose views are made only when a store moves it."""

    __slots__ = ("_parts", "nbytes")

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._parts = tuple(parts)
        self.nbytes = sum([p.nbytes for p in self._parts])

    @property
    def parts(self) -> tuple[memoryview, ...]:
        """The views, in payload order (a store takes them once per key it moves)."""
        return self._parts

    @staticmethod
    def deferred(nbytes: int, source: Sequence[Sequence[memoryview]], index: int) -> Payload:
        """A payload of ``nbytes`` whose views are ``source[index]``, made each time a store
        takes :attr:`parts` and dropped when it is done with them.

        For payloads of many views (one per cache tensor): a batch of thousands of blocks
        made up front keeps every view alive until the batch ends, and each is an object the
        garbage collector tracks; tens of thousands of those set off its full collections
        (150 ms each with paddle loaded, holding the GIL that the I/O threads need).  The
        views are checked when made: a wrong size or a view that is not flat bytes fails
        that key only."""
        return _DeferredPayload(nbytes, source, index)

    def copy_to(self, dst: memoryview) -> None:
        """Write the payload to the start of ``dst``."""
        copy_parts(self.parts, dst)

    def fill_from(self, src: memoryview) -> None:
        """Fill the parts from the start of ``src``."""
        fill_parts(self.parts, src)


class _DeferredPayload(Payload):
    __slots__ = ("_index", "_source")

    def __init__(self, nbytes: int, source: Sequence[Sequence[memoryview]], index: int) -> None:
        self.nbytes = nbytes
        self._source = source
        self._index = index

    @property
    def parts(self) -> tuple[memoryview, ...]:
        made = as_payload(list(self._source[self._index]), writable=False, what="deferred payload")
        if made.nbytes != self.nbytes:
            raise ValueError(
                f"deferred payload {self._index} is {made.nbytes} bytes, promised {self.nbytes}"
            )
        return made.parts


def copy_parts(parts: Sequence[memoryview], dst: memoryview) -> None:
    """Write the concatenation of ``parts`` to the start of ``dst``."""
    at = 0
    for part in parts:
        dst[at : at + part.nbytes] = part
        at += part.nbytes


def fill_parts(parts: Sequence[memoryview], src: memoryview) -> None:
    """Fill ``parts`` in order from the start of ``src``."""
    at = 0
    for part in parts:
        part[:] = src[at : at + part.nbytes]
        at += part.nbytes


def as_payload(buffer: object, *, writable: bool, what: str) -> Payload:
    """A buffer, or a list or tuple of buffers, as a :class:`Payload` (checked)."""
    if isinstance(buffer, Payload):
        return buffer
    if isinstance(buffer, (list, tuple)):
        if not buffer:
            raise ValueError(f"{what} is an empty list: give at least one buffer")
        return Payload(
            [
                b
                if _flat_bytes(b, writable)  # most parts: no checks to spell out, no f-string
                else byte_view(b, writable=writable, what=f"{what}[{j}]")
                for j, b in enumerate(buffer)
            ]
        )
    return Payload((byte_view(buffer, writable=writable, what=what),))


def _flat_bytes(buffer: object, writable: bool) -> bool:
    """Whether ``buffer`` is already a usable flat byte view (a slice of one, too)."""
    return (
        type(buffer) is memoryview
        and buffer.ndim == 1
        and buffer.format == "B"
        and buffer.strides == (1,)
        and not (writable and buffer.readonly)
    )


def byte_view(buffer: object, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of a buffer-protocol object; refuses what cannot be used as one."""
    if _flat_bytes(buffer, writable):
        return buffer  # type: ignore[return-value]
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must support the buffer protocol (bytes, bytearray, numpy array, "
            f"memoryview), got {type(buffer).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; a load needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_keys(keys: Sequence[bytes]) -> None:
    for i, key in enumerate(keys):
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"keys[{i}] must be {KEY_BYTES} bytes, got {key!r:.60}")


def check_batch(
    keys: Sequence[bytes], buffers: Sequence[object], *, writable: bool
) -> list[Payload]:
    """Validate a dump/load batch before any I/O starts; return the payloads."""
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
    check_keys(keys)
    return [as_payload(b, writable=writable, what=f"buffers[{i}]") for i, b in enumerate(buffers)]


class Store(abc.ABC):
    """Batched, asynchronous block storage.  Thread-safe."""

    @property
    def read_only(self) -> bool:
        """Whether every dump fails (a read-only cache): callers need not plan any."""
        return False

    @property
    def reads_from_memory(self) -> bool:
        """Whether a load only copies from this host's memory, so that once cancelled it
        ends at once (nothing to wait on, no device or network that may hang): a caller may
        then read straight into memory it must take back, such as an engine's cache."""
        return False

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are stored (a hint: a later load may still miss)."""

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored."""
        for i, present in enumerate(self.lookup(keys)):
            if not present:
                return i
        return len(keys)

    @abc.abstractmethod
    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        """Store each buffer (or list of buffers: their concatenation) under its key; a key
        already stored is left as it is."""

    @abc.abstractmethod
    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        """Fill each buffer (or list of buffers, in order) with its key's block; the size must
        equal the block's."""

    def wait(self, task: Task, timeout: float | None = None) -> list[KeyResult]:
        """Per-key results; ``TimeoutError`` if the task is not done within ``timeout``."""
        return task.wait(timeout)

    def check(self, task: Task) -> bool:
        """Whether the task is done (never blocks)."""
        return task.done()

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete the keys; return how many were stored."""

    @abc.abstractmethod
    def usage(self) -> StoreUsage: ...

    def check_block_bytes(self, nbytes: int) -> None:  # noqa: B027 - most stores take any size
        """Refuse, with a ``ConfigError`` naming the setting, a store that could never hold a
        block of ``nbytes``: adapters call this at start-up, once they know their block size,
        so that a setting that cannot hit is an error rather than a silent miss."""

    def close(self) -> None:  # noqa: B027 - stores without resources need nothing
        """Finish queued work and release resources."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
