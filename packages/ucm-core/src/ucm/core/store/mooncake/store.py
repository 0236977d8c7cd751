"""The mooncake store: blocks in a Mooncake Store cluster, shared by every host on it.

Each block is one Mooncake object, ``key_prefix + key.hex()`` (with a secret, the keyed
name of the key), holding the same bytes a posix block file holds (the header page, then
the payload), so every load verifies the key, the layout and the payload checksum (or MAC):
a foreign, truncated or corrupted object is a miss, never data.  Any client of the master
can put, read and remove any object: without a secret, nothing stops one from planting a
block under a key it computed (see docs/security.md).  Nothing is ever sized by an object's
size: a load reads into the caller's buffers, and an object larger than the block asked for
is refused unread.  Values move with ``batch_put_from_multi_buffers`` and
``batch_get_into_multi_buffers`` straight between the caller's buffers and the cluster: no
Python bytes and no staging copy on the data path.

While the master is down, lookups answer miss and dumps are dropped at once, with no call
made (:mod:`.link`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ucm.core.block_format import (
    HEADER_BYTES,
    BlockFormatError,
    OtherVersion,
    decode_header,
    encode_header,
    verify_payload,
)
from ucm.core.settings import ConfigError
from ucm.core.signing import signer_for
from ucm.core.store.base import Store, StoreUsage, check_batch, check_keys
from ucm.core.store.mooncake.config import MooncakeStoreConfig
from ucm.core.store.mooncake.link import MasterLink
from ucm.core.store.payload import Payload
from ucm.core.store.task import KeyResult, Status, Task
from ucm.core.threads import store_pool

log = logging.getLogger(__name__)

#: Keys moved by one Mooncake call: each call is a round trip to the master, which 16-key
#: calls paid for with 10-15% of the throughput of 2 MiB blocks here (an engine step hands
#: over up to about this many blocks; a cancel stops the calls not yet started).
BATCH_KEYS = 128

# Mooncake's error codes (mooncake-store/include/types.h) that this store tells apart.
NO_AVAILABLE_HANDLE = -200  # the pool is full
INVALID_PARAMS = -600  # on a get: the buffers are smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800  # a segment's owner did not answer, or the buffers exceed the object
RPC_FAIL = -900
RPC_TIMEOUT = -901
TENANT_QUOTA_EXCEEDED = -1700
TENANT_NOT_REGISTERED = -1701
#: Codes meaning the master did not answer: the link goes down.
MASTER_DOWN = frozenset({RPC_FAIL, RPC_TIMEOUT, -1010, -1011})

_UNREACHABLE = "mooncake master unreachable"
_DROPPED = KeyResult(Status.ERROR, _UNREACHABLE)  # a dump while the master is down
_UNANSWERED = KeyResult(Status.MISS, _UNREACHABLE)  # a load while the master is down


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only ones too)."""
    info = _PyBuffer()
    _get_buffer(view, ctypes.byref(info), 0)  # PyBUF_SIMPLE
    try:
        return int(info.buf or 0)
    finally:
        _release_buffer(ctypes.byref(info))


def _ranges(views: Sequence[memoryview]) -> tuple[list[int], list[int]]:
    """Addresses and sizes of the non-empty views (Mooncake refuses empty buffers)."""
    ptrs: list[int] = []
    sizes: list[int] = []
    for view in views:
        if view.nbytes:
            ptrs.append(address(view))
            sizes.append(view.nbytes)
    return ptrs, sizes


class _Call:
    """The keys of one Mooncake call: the buffers of each (its header page first), and the
    results of keys refused before the call or answered after it."""

    def __init__(self, n: int) -> None:
        self.results: list[KeyResult | None] = [None] * n
        self.names: list[str] = []
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.where: list[int] = []  # the key of each name

    def add(self, index: int, name: str, views: Sequence[memoryview]) -> None:
        ptrs, sizes = _ranges(views)
        self.names.append(name)
        self.ptrs.append(ptrs)
        self.sizes.append(sizes)
        self.where.append(index)

    def refuse(self, index: int, exc: Exception) -> None:
        self.results[index] = KeyResult(Status.ERROR, str(exc))

    def finish(self) -> list[KeyResult]:
        return [r if r is not None else KeyResult(Status.ERROR, "not moved") for r in self.results]


class MooncakeStore(Store):
    tier = "remote"  # the pool's memory, on the hosts that give it

    def __init__(
        self,
        config: MooncakeStoreConfig | None = None,
        *,
        make_client: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config or MooncakeStoreConfig()
        self._signer = signer_for(self.config.secret)
        if make_client is None:
            make_client = _mooncake_client_class()
        self._link = MasterLink(self.config, make_client)
        self._pool = store_pool(self.config.io_thread_count, "ucm-mooncake")
        # Lookups run here so that one can be given up on after timeout_s.
        self._lookups = store_pool(2, "ucm-mooncake-lookup")
        self._lock = threading.Lock()
        self._errors = 0
        self.dropped = 0  # keys not dumped, or answered miss, because the master was down
        self._put_blocks = 0
        self._put_bytes = 0
        self._closed = False
        self._replicate: Any = None
        self._link.wait_up(self.config.timeout_s)

    # -- the link --

    @property
    def connected(self) -> bool:
        """Whether the master answers (as of the last call or probe)."""
        return self._link.up

    @property
    def reachable(self) -> bool:
        return self._link.up

    @property
    def master_failures(self) -> int:
        """Times the master was found unreachable."""
        return self._link.failures

    @property
    def errors(self) -> int:
        return self._errors

    def _name(self, key: bytes) -> str:
        key = bytes(key)
        return (
            self.config.key_prefix + (key if self._signer is None else self._signer.name(key)).hex()
        )

    def _count(self, errors: int = 0, dropped: int = 0) -> None:
        with self._lock:
            self._errors += errors
            self.dropped += dropped

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the mooncake store is closed")

    def _start(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[object],
        layout: bytes,
        move: Callable[[Any, list[bytes], list[Payload], bytes], list[KeyResult]],
        *,
        writable: bool,
        down: KeyResult,
    ) -> Task:
        """A dump or load: ``move`` runs on the transfer threads, ``BATCH_KEYS`` keys a call;
        keys find ``down`` instead while the master is down."""
        self._check_open()
        payloads = check_batch(keys, buffers, writable=writable)
        if self._link.client is None:
            self._count(dropped=len(keys))
            return Task.completed([down] * len(keys))
        task = Task(len(keys))
        for start in range(0, len(keys), BATCH_KEYS):
            indices = range(start, min(start + BATCH_KEYS, len(keys)))
            batch = ([bytes(keys[i]) for i in indices], [payloads[i] for i in indices])
            self._pool.submit(
                task.run_keys, indices, functools.partial(self._moved, move, batch, layout, down)
            )
        return task

    def _moved(
        self,
        move: Callable[[Any, list[bytes], list[Payload], bytes], list[KeyResult]],
        batch: tuple[list[bytes], list[Payload]],
        layout: bytes,
        down: KeyResult,
    ) -> list[KeyResult]:
        client = self._link.client
        if client is None:  # went down since the task started
            self._count(dropped=len(batch[0]))
            return [down] * len(batch[0])
        return move(client, *batch, layout)

    def _master_down(self, codes: Sequence[int], what: str) -> bool:
        down = next((c for c in codes if c in MASTER_DOWN), None)
        if down is not None:
            self._link.failed(f"{what} answered {down}")
        return down is not None

    # -- dump --

    def dump(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        return self._start(keys, buffers, layout, self._put, writable=False, down=_DROPPED)

    def _put(
        self, client: Any, keys: list[bytes], payloads: list[Payload], layout: bytes
    ) -> list[KeyResult]:
        call = _Call(len(keys))
        headers: list[bytearray] = []  # kept alive until the call returns
        for i, (key, payload) in enumerate(zip(keys, payloads)):
            try:
                parts = payload.parts
                headers.append(bytearray(encode_header(key, parts, layout, self._signer)))
            except (TypeError, ValueError) as exc:
                call.refuse(i, exc)
                continue
            call.add(i, self._name(key), (memoryview(headers[-1]), *parts))
        if call.names:
            codes = client.batch_put_from_multi_buffers(
                call.names, call.ptrs, call.sizes, self._replicate_config()
            )
            down = self._master_down(codes, "a put")
            for i, code in zip(call.where, codes):
                call.results[i] = self._put_result(code, payloads[i].nbytes, down)
        return call.finish()

    def _put_result(self, code: int, nbytes: int, down: bool) -> KeyResult:
        if code == 0 or code == OBJECT_ALREADY_EXISTS:
            if code == 0:
                with self._lock:
                    self._put_blocks += 1
                    self._put_bytes += HEADER_BYTES + nbytes
            return KeyResult(Status.OK)
        if down:
            self._count(dropped=1)
            return _DROPPED
        self._count(errors=1)
        if code == NO_AVAILABLE_HANDLE:
            return KeyResult(Status.ERROR, "the mooncake pool is full (no segment has room)")
        if code == TENANT_NOT_REGISTERED:
            return KeyResult(
                Status.ERROR,
                f"mooncake tenant {self.config.tenant_id or 'default'!r} is not registered "
                "with the master (its quota policy, --enable_multi_tenants)",
            )
        if code == TENANT_QUOTA_EXCEEDED:
            return KeyResult(Status.ERROR, "the mooncake tenant's quota is exceeded")
        return KeyResult(Status.ERROR, f"mooncake put failed with code {code}")

    def _replicate_config(self) -> Any:
        if self._replicate is None:
            from mooncake.store import ReplicateConfig  # type: ignore[import-untyped]

            replicate = ReplicateConfig()
            replicate.replica_num = self.config.replicas
            self._replicate = replicate
        return self._replicate

    # -- load --

    def load(self, keys: Sequence[bytes], buffers: Sequence[object], layout: bytes = b"") -> Task:
        return self._start(keys, buffers, layout, self._get, writable=True, down=_UNANSWERED)

    def _get(
        self, client: Any, keys: list[bytes], payloads: list[Payload], layout: bytes
    ) -> list[KeyResult]:
        call = _Call(len(keys))
        pages = memoryview(bytearray(HEADER_BYTES * len(keys)))
        page_of = [pages[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(len(keys))]
        parts_of: dict[int, tuple[memoryview, ...]] = {}
        for i, (key, payload) in enumerate(zip(keys, payloads)):
            try:
                parts_of[i] = payload.parts
            except (TypeError, ValueError) as exc:
                call.refuse(i, exc)
                continue
            call.add(i, self._name(key), (page_of[i], *parts_of[i]))
        if call.names:
            codes = client.batch_get_into_multi_buffers(call.names, call.ptrs, call.sizes)
            down = self._master_down(codes, "a get")
            for i, code in zip(call.where, codes):
                call.results[i] = self._get_result(
                    client, keys[i], code, page_of[i], parts_of[i], payloads[i], layout, down
                )
        return call.finish()

    def _get_result(
        self,
        client: Any,
        key: bytes,
        code: int,
        page: memoryview,
        parts: tuple[memoryview, ...],
        payload: Payload,
        layout: bytes,
        down: bool,
    ) -> KeyResult:
        if code == OBJECT_NOT_FOUND:
            return KeyResult(Status.MISS)
        if code < 0:
            if down:
                self._count(dropped=1)
                return _UNANSWERED
            self._count(errors=1)
            if code in (INVALID_PARAMS, TRANSFER_FAIL):  # the buffers may not fit the object
                return self._not_fitting(client, key, payload.nbytes)
            # Most often the segment holding the block is gone with its host: a miss.
            return KeyResult(Status.MISS, f"mooncake get failed with code {code}")
        try:
            if code < HEADER_BYTES:
                raise BlockFormatError(
                    f"object truncated: {code} bytes, header alone is {HEADER_BYTES}"
                )
            header = decode_header(page, expect_key=key, signer=self._signer)
            if header.payload_len != payload.nbytes:
                self._count(errors=1)
                return KeyResult(
                    Status.ERROR,
                    f"buffer is {payload.nbytes} bytes but the stored block holds "
                    f"{header.payload_len}",
                )
            if code != HEADER_BYTES + header.payload_len:
                raise BlockFormatError(
                    f"object is {code} bytes, its header says {HEADER_BYTES + header.payload_len}"
                )
            if header.layout != layout:
                self._count(errors=1)
                return KeyResult(
                    Status.ERROR, f"stored block has layout {header.layout!r}, asked for {layout!r}"
                )
            verify_payload(header, parts, self._signer)
        except OtherVersion as exc:  # another build's block: not ours to judge or delete
            return KeyResult(Status.MISS, str(exc))
        except BlockFormatError as exc:
            self._count(errors=1)
            return self._corrupt(client, key, exc)
        return KeyResult(Status.OK)

    def _not_fitting(self, client: Any, key: bytes, nbytes: int) -> KeyResult:
        """A get whose buffers do not add up to the object: the caller asked for the wrong
        size (an error), or the object is not a whole block (corrupt), or it is unreadable
        (its segment is gone: a miss).  An object smaller than the block asked for is read
        whole to tell which (into a buffer no larger than that block); a larger one is
        refused unread, whatever it claims to be."""
        name = self._name(key)
        size = client.get_size(name)
        if size < 0:
            return KeyResult(Status.MISS, f"mooncake get_size failed with code {size}")
        wanted = HEADER_BYTES + nbytes
        if size > wanted:
            return KeyResult(
                Status.ERROR,
                f"buffer is {nbytes} bytes but the stored object holds {size - HEADER_BYTES} "
                "after a header page (another block size, or not a block): not read",
            )
        if size == wanted:  # it fits: the get failed for another reason
            return KeyResult(Status.MISS, "mooncake get failed for an object of the right size")
        whole = bytearray(size)
        got = client.get_into(name, address(memoryview(whole)), size) if size else 0
        if got != size:
            return KeyResult(Status.MISS, f"mooncake get failed with code {got}")
        try:
            if size < HEADER_BYTES:
                raise BlockFormatError(f"object truncated: {size} bytes")
            header = decode_header(
                memoryview(whole)[:HEADER_BYTES], expect_key=key, signer=self._signer
            )
            if header.payload_len == nbytes:
                raise BlockFormatError(
                    f"object truncated: {size} bytes, its header says "
                    f"{HEADER_BYTES + header.payload_len}"
                )
        except OtherVersion as exc:
            return KeyResult(Status.MISS, str(exc))
        except BlockFormatError as exc:
            return self._corrupt(client, key, exc)
        return KeyResult(
            Status.ERROR,
            f"buffer is {nbytes} bytes but the stored block holds {header.payload_len}",
        )

    def _corrupt(self, client: Any, key: bytes, exc: BlockFormatError) -> KeyResult:
        client.batch_remove([self._name(key)], True)
        log.warning("ucm mooncake store: block %s is corrupt (%s); removed", key.hex(), exc)
        return KeyResult(Status.CORRUPT, str(exc))

    # -- the rest --

    def _ask(self, call: Callable[[Any], list[int]], what: str) -> list[int] | None:
        """``call(client)`` answered within ``timeout_s``, or ``None`` (master taken as down)."""
        client = self._link.client
        if client is None:
            return None
        future: Future[list[int]] = self._lookups.submit(call, client)
        try:
            codes = future.result(self.config.timeout_s)
        except FutureTimeout:
            self._link.failed(f"{what} got no answer in {self.config.timeout_s} s")
            return None
        if self._master_down(codes, what):
            return None
        return codes

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        check_keys(keys)
        if not keys:
            return []
        names = [self._name(k) for k in keys]
        found = self._ask(lambda client: client.batch_is_exist(names), "a lookup")
        if found is None:
            self._count(dropped=len(keys))
            return [False] * len(keys)
        return [code == 1 for code in found]

    def remove(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        check_keys(keys)
        if not keys:
            return 0
        names = [self._name(k) for k in keys]
        codes = self._ask(lambda client: client.batch_remove(names, True), "a remove")
        return 0 if codes is None else sum(code == 0 for code in codes)

    def usage(self) -> StoreUsage:
        """What this client put (the cluster's own totals are the master's metrics), and the
        memory this client gives the pool."""
        with self._lock:
            return StoreUsage(
                self._put_blocks,
                self._put_bytes,
                self.config.global_segment_bytes,
                whole_store=False,
            )

    def check_block_bytes(self, nbytes: int) -> None:
        stored = HEADER_BYTES + nbytes
        segment = self.config.global_segment_bytes
        if 0 < segment < stored:
            raise ConfigError(
                "store.global_segment_gb",
                f"{self.config.global_segment_gb} GiB cannot hold one block of {stored} bytes",
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._lookups.shutdown(wait=False)
        self._link.close()


def _mooncake_client_class() -> Callable[[], Any]:
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            "store.kind",
            "the mooncake store needs Mooncake's client: pip install 'ucm-core[mooncake]' "
            f"(and apt-get install libibverbs1 on Debian/Ubuntu); import failed: {exc}",
        ) from None
    return MooncakeDistributedStore  # type: ignore[no-any-return]
