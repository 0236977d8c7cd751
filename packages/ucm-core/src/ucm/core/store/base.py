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
from collections.abc import Hashable, Sequence

import attrs
from ucm.core.keys import KEY_BYTES
from ucm.core.store.evictions import EvictionWatch
from ucm.core.store.payload import Payload, as_payload, quick_payload
from ucm.core.store.reads import SlotReads
from ucm.core.store.task import KeyResult, Task
from ucm.core.store.writes import SlotWrites


@attrs.frozen
class StoreUsage:
    blocks: int
    bytes: int
    capacity_bytes: int | None
    #: whether blocks and bytes count the whole store (false for a Mooncake client, which
    #: knows only what it put: the cluster's totals are its master's metrics)
    whole_store: bool = True


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
    payloads = [quick_payload(b, writable) for b in buffers]
    if None in payloads:  # the rest, checked one by one, named in what they refuse
        payloads = [
            p or as_payload(b, writable=writable, what=f"buffers[{i}]")
            for i, (p, b) in enumerate(zip(payloads, buffers))
        ]
    return payloads  # type: ignore[return-value]


class Store(abc.ABC):
    """Batched, asynchronous block storage.  Thread-safe."""

    #: where this store keeps its blocks, as an engine reports where a hit came from:
    #: ``host`` (this host's memory), ``disk`` (a local or shared filesystem), ``remote``
    #: (other hosts' memory)
    tier = "disk"

    def tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier that would serve each of ``keys`` (stored ones: a tiered store asks its
        front, others answer without a lookup)."""
        return [self.tier] * len(keys)

    @property
    def read_only(self) -> bool:
        """Whether every dump fails (a read-only cache): callers need not plan any."""
        return False

    @property
    def reads_from_memory(self) -> bool:
        """Whether a load writes the caller's buffers only from this host's memory (a read
        from a disk, if any, lands in the store's own buffer first), so that once cancelled
        it ends at once (nothing to wait on, no device or network that may hang): a caller
        may then read straight into memory it must take back, such as an engine's cache."""
        return False

    @property
    def lends_blocks(self) -> bool:
        """Whether :meth:`open_reads` may lend blocks where they lie (it answers None
        otherwise): a caller that would copy out of them itself asks only such a store."""
        return False

    @property
    def reachable(self) -> bool:
        """Whether the store answers now: false while a remote store's link is down (its
        lookups miss and its dumps fail until it is back); a local store, once open, is."""
        return True

    @property
    def evicted_blocks(self) -> int:
        """Blocks this store object evicted to make room since it opened (another process's
        evictions are its own; evictions a remote store makes itself are not seen)."""
        return 0

    #: the watched blocks (:meth:`watch_evictions`), in the stores whose own passes evict;
    #: None in the others (a remote pool evicts in its own processes): they report nothing
    _evictions: EvictionWatch | None = None

    def watch_evictions(self, keys: Sequence[bytes], tags: Sequence[object]) -> None:
        """Should this store object evict one of ``keys`` to make room, hand its tag to
        :meth:`take_evicted` (the most recent watched only: see ``ucm.core.store.evictions``)."""
        if self._evictions is not None:
            self._evictions.watch(self._eviction_names(keys), tags)

    def take_evicted(self) -> list[object]:
        """The tags of the watched blocks evicted since the last call."""
        return [] if self._evictions is None else self._evictions.take()

    def _eviction_names(self, keys: Sequence[bytes]) -> list[Hashable]:
        """The names a store that evicts files ``keys`` under, as its passes report them:
        the keys themselves, unless the store names its blocks otherwise."""
        return [bytes(k) for k in keys]

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

    def open_writes(
        self, keys: Sequence[bytes], nbytes: int, layout: bytes = b""
    ) -> SlotWrites | None:
        """Room in this store's memory for the blocks of ``keys`` (``nbytes`` each), to be
        written in place and then committed (:mod:`.writes`); None where this store has no
        such memory, or none now: the caller dumps buffers instead."""
        return None

    def open_reads(
        self, keys: Sequence[bytes], nbytes: int, layout: bytes = b"", *, check: bool = True
    ) -> SlotReads | None:
        """The stored blocks of ``keys`` (``nbytes`` each) lent where they lie in this
        store's memory, checked (``check=False``: unchecked where the store does not sign,
        their stored digests given for the caller to check), to be copied out by the caller
        and given back (:mod:`.reads`); None where this store has no such memory: the
        caller loads into buffers instead."""
        return None

    def host_memory(self) -> list[memoryview]:
        """The host memory that :meth:`open_writes` and :meth:`open_reads` hand out views
        of, mapped in this process, so that a GPU's driver can be told of it (registered
        as pinned memory, its copies into and out of it run asynchronously); empty where
        this store hands out none."""
        return []

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
