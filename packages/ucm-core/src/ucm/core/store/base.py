"""The store interface: batched, asynchronous, with a result per key.

A store keeps opaque blocks (byte payloads) under 16-byte keys.  ``dump`` and ``load``
return a :class:`Task` at once; the I/O runs on the store's threads; ``wait`` returns one
:class:`KeyResult` per key.  Buffers handed to ``dump`` must stay unchanged, and buffers
handed to ``load`` untouched by the caller, until the task is done.  The content of a load
buffer whose result is not ``OK`` is undefined and must not be used.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from ucm.core.keys import KEY_BYTES


class Status(enum.Enum):
    OK = "ok"
    MISS = "miss"  # nothing stored under the key
    CORRUPT = "corrupt"  # stored, but failed verification; removed, so it reads as a miss
    ERROR = "error"  # the I/O failed (disk full, permission, wrong buffer size, ...)
    CANCELLED = "cancelled"  # the task was cancelled before this key started


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
    """One batched operation in flight: completed key by key by the store's workers."""

    __slots__ = ("_callbacks", "_cancelled", "_event", "_lock", "_remaining", "_results")

    def __init__(self, n: int) -> None:
        self._results: list[KeyResult | None] = [None] * n
        self._remaining = n
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._cancelled = False
        self._callbacks: list[Callable[[Task], Any]] = []
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

    def cancel(self) -> None:
        """Keys not yet started will finish as ``CANCELLED``; keys in progress complete."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> list[KeyResult]:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self._remaining} of {len(self._results)} keys still in flight")
        return [r for r in self._results if r is not None]

    @classmethod
    def combine(cls, n: int, parts: Sequence[tuple[Sequence[int], Task]]) -> Task:
        """A task over ``n`` keys whose results come from ``parts`` (positions, sub-task)."""
        whole = cls(n)
        for positions, part in parts:

            def forward(done: Task, positions: Sequence[int] = positions) -> None:
                for pos, result in zip(positions, done.wait(0)):
                    whole.set_result(pos, result)

            part.add_done_callback(forward)
        return whole


def byte_view(buffer: object, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of a buffer-protocol object; refuses what cannot be used as one."""
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
) -> list[memoryview]:
    """Validate a dump/load batch before any I/O starts; return the byte views."""
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
    check_keys(keys)
    return [byte_view(b, writable=writable, what=f"buffers[{i}]") for i, b in enumerate(buffers)]


class Store(abc.ABC):
    """Batched, asynchronous block storage.  Thread-safe."""

    @property
    def read_only(self) -> bool:
        """Whether every dump fails (a read-only cache): callers need not plan any."""
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
        """Store each buffer under its key; a key already stored is left as it is."""

    @abc.abstractmethod
    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        """Fill each buffer with its key's block; the buffer size must equal the block's."""

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

    def close(self) -> None:  # noqa: B027 - stores without resources need nothing
        """Finish queued work and release resources."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
