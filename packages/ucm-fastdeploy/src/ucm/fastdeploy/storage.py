"""``UCMStorage``: FastDeploy's ``KVCacheStorage`` contract over a UCM store.

This is the contract of FastDeploy's mooncake and file backends: the cache transfer manager
copies blocks into host buffers it registered with ``register_buffer(ptr, size)``, names each
K, V (and fp8 scale) part by a string key (``prefix{version}_{hash}_{rank}_key`` and so on),
and moves them with ``batch_set`` / ``batch_get`` given raw pointers and sizes.  The store
reads and writes those buffers in place (no copy).  Return values are FastDeploy's:

* ``batch_set`` / ``set``: per key ``0`` stored, negative failed;
* ``batch_get`` / ``get``: per key the bytes read (``> 0``), negative failed: ``-1`` missing,
  ``-2`` corrupt (and removed), ``-3`` I/O error or a size that does not match the stored
  block, ``-4`` not done within ``storage_timeout_s``;
* ``exists``: ``{key: bool}``; ``query``: how many leading blocks have every part stored.

A string key becomes a store key by digesting it with the namespace, so two namespaces never
share a block (FastDeploy's keys already hold the rank and the model version prefix).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash
from ucm.core import KeyResult, Status, Store, create_store
from ucm.fastdeploy.config import FastDeployConfig, load_config
from ucm.fastdeploy.keys import storage_seed
from ucm.fastdeploy.tensors import check_index, to_torch

log = logging.getLogger(__name__)

TAG = b"fastdeploy-kvstorage/1"
MISSING, CORRUPT, FAILED, TIMED_OUT = -1, -2, -3, -4
_CODES = {Status.MISS: MISSING, Status.CORRUPT: CORRUPT, Status.ERROR: FAILED}
#: keys ``clear`` can remove: the ones this object stored, up to this many (the oldest beyond)
CLEAR_TRACKED = 1 << 20


class _BadTarget(ValueError):
    """A target location or size that cannot be used (reported per key, not raised)."""


class UCMStorage:
    """FastDeploy's ``KVCacheStorage`` backed by a UCM store (see the module docstring).

    Built like FastDeploy's file backend (``namespace``, ``tp_rank``, ``tp_size``); the
    settings come from ``ucm_config`` as for :class:`~ucm.fastdeploy.AttentionStore`.
    """

    def __init__(
        self,
        namespace: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        ucm_config: Mapping[str, Any] | str | os.PathLike[str] | FastDeployConfig | None = None,
        *,
        store: Store | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a string, got {namespace!r}")
        self.namespace = namespace
        self.tp_rank = check_index(tp_rank, "tp_rank")
        self.tp_size = check_index(tp_size, "tp_size")
        if not self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got {tp_rank} of {tp_size}")
        self.settings = load_config(ucm_config, os.environ if environ is None else environ)
        self._owns_store = store is None
        self.store = create_store(self.settings.store) if store is None else store
        self._seed = storage_seed(namespace)
        self._lock = threading.Lock()
        self._buffers: list[tuple[int, int]] = []  # registered (start, end), sorted
        self._written: OrderedDict[bytes, None] = OrderedDict()
        self._forgotten = False  # more keys stored than CLEAR_TRACKED

    # -- buffers --------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, buffer_size: int) -> None:
        """Allow pointers into ``[buffer_ptr, buffer_ptr + buffer_size)`` as targets."""
        ptr = check_index(buffer_ptr, "buffer_ptr")
        size = check_index(buffer_size, "buffer_size")
        if ptr == 0 or size == 0:
            raise ValueError(f"cannot register a null or empty buffer (ptr={ptr}, size={size})")
        with self._lock:
            bisect.insort(self._buffers, (ptr, ptr + size))

    def _pointer_view(self, ptr: int, size: int) -> memoryview:
        with self._lock:
            i = bisect.bisect_right(self._buffers, (ptr, float("inf"))) - 1
            inside = i >= 0 and self._buffers[i][0] <= ptr and ptr + size <= self._buffers[i][1]
        if not inside:
            raise _BadTarget(
                f"[{ptr:#x}, {ptr + size:#x}) is not inside a buffer given to register_buffer"
            )
        return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")

    def _target(self, location: object, size: object) -> memoryview:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise _BadTarget(f"target size must be a positive int, got {size!r}")
        if isinstance(location, bool):
            raise _BadTarget(f"target location must be a pointer or a buffer, got {location!r}")
        if isinstance(location, int):
            return self._pointer_view(location, size)
        if isinstance(location, torch.Tensor) or hasattr(location, "__dlpack__"):
            t = to_torch(location, "target location")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise _BadTarget("a tensor target must be a contiguous CPU tensor")
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        else:
            try:
                view = memoryview(location).cast("B")  # type: ignore[arg-type]
            except TypeError:
                raise _BadTarget(
                    f"target location must be a pointer or a buffer, got {type(location).__name__}"
                ) from None
        if view.nbytes < size:
            raise _BadTarget(f"target holds {view.nbytes} bytes, size says {size}")
        return view[:size]

    def _key(self, key: object) -> bytes:
        if not isinstance(key, str) or not key:
            raise TypeError(f"keys must be non-empty strings, got {key!r}")
        return xxhash.xxh3_128_digest(self._seed + key.encode("utf-8"))

    # -- KVCacheStorage -------------------------------------------------------------------

    def batch_set(
        self,
        keys: Sequence[str],
        target_locations: Sequence[Any] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[int]:
        """Store each target under its key: per key 0 (stored) or negative (failed)."""
        store_keys, views, codes = self._batch("batch_set", keys, target_locations, target_sizes)
        todo = [i for i, c in enumerate(codes) if c == 0]
        if todo:
            try:
                task = self.store.dump([store_keys[i] for i in todo], [views[i] for i in todo], TAG)
                results = self._finish(task)
            except Exception as exc:  # noqa: BLE001 - a failing store never fails the engine
                log.warning("ucm fastdeploy batch_set: %s", exc)
                results = [KeyResult(Status.ERROR, str(exc))] * len(todo)
            stored = []
            for i, r in zip(todo, results):
                codes[i] = 0 if r is not None and r.ok else (TIMED_OUT if r is None else FAILED)
                if codes[i] == 0:
                    stored.append(store_keys[i])
            self._track(stored)
        self._report("batch_set", keys, codes, lambda c: c == 0)
        return codes

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[Any] | None = None,
        target_sizes: Sequence[int] | None = None,
    ) -> list[int]:
        """Fill each target from its key: per key the bytes read (> 0) or negative."""
        store_keys, views, codes = self._batch("batch_get", keys, target_locations, target_sizes)
        todo = [i for i, c in enumerate(codes) if c == 0]
        if todo:
            try:
                task = self.store.load([store_keys[i] for i in todo], [views[i] for i in todo], TAG)
                results = self._finish(task)
            except Exception as exc:  # noqa: BLE001
                log.warning("ucm fastdeploy batch_get: %s", exc)
                results = [KeyResult(Status.ERROR, str(exc))] * len(todo)
            for i, r in zip(todo, results):
                if r is None:
                    codes[i] = TIMED_OUT
                elif r.ok:
                    codes[i] = views[i].nbytes
                else:
                    codes[i] = _CODES.get(r.status, TIMED_OUT)
        self._report("batch_get", keys, codes, lambda c: c > 0)
        return codes

    def set(self, key: str, target_location: Any = None, target_size: Any = None) -> int:
        """One key: 0 stored, negative failed."""
        return self.batch_set([key], [target_location], [target_size])[0]

    def get(self, key: str, target_location: Any = None, target_size: Any = None) -> int:
        """One key: bytes read, or negative."""
        return self.batch_get([key], [target_location], [target_size])[0]

    def exists(self, keys: Sequence[str]) -> dict[str, bool]:
        """``{key: stored}`` (a hint: a later get may still miss)."""
        store_keys = [self._key(k) for k in keys]
        try:
            found = self.store.lookup(store_keys)
        except Exception as exc:  # noqa: BLE001
            log.warning("ucm fastdeploy exists: lookup failed: %s", exc)
            found = [False] * len(store_keys)
        return dict(zip(keys, found))

    def query(
        self,
        k_keys: Sequence[str] | None = None,
        v_keys: Sequence[str] | None = None,
        k_scale_keys: Sequence[str] | None = None,
        v_scale_keys: Sequence[str] | None = None,
        timeout: float = 1.0,
    ) -> int:
        """How many leading blocks have their K and V (and scales, when given) stored."""
        if not k_keys or not v_keys:
            return 0
        parts = [list(k_keys), list(v_keys)]
        if k_scale_keys is not None and v_scale_keys is not None:
            parts += [list(k_scale_keys), list(v_scale_keys)]
        if any(len(p) != len(parts[0]) for p in parts):
            raise ValueError(
                "k_keys, v_keys (and the scale keys) must have the same length, got "
                + ", ".join(str(len(p)) for p in parts)
            )
        found = self.exists([k for p in parts for k in p])
        for i in range(len(parts[0])):
            if not all(found[p[i]] for p in parts):
                return i
        return len(parts[0])

    def delete(self, key: str) -> bool:
        """Remove one key; whether it was stored."""
        try:
            return self.store.remove([self._key(key)]) > 0
        except Exception as exc:  # noqa: BLE001
            log.warning("ucm fastdeploy delete: %s", exc)
            return False

    def clear(self) -> bool:
        """Remove what this object stored.  A UCM store is shared with other processes and
        namespaces, so nothing else is touched; False when some keys were no longer tracked
        (more than CLEAR_TRACKED) or the store failed."""
        with self._lock:
            keys = list(self._written)
            self._written.clear()
            complete = not self._forgotten
            self._forgotten = False
        try:
            removed = self.store.remove(keys) if keys else 0
        except Exception as exc:  # noqa: BLE001
            log.warning("ucm fastdeploy clear: %s", exc)
            return False
        log.info("ucm fastdeploy clear: removed %d of %d blocks stored here", removed, len(keys))
        if not complete:
            log.warning("ucm fastdeploy clear: older blocks were no longer tracked and remain")
        return complete

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> UCMStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------

    def _batch(
        self,
        op: str,
        keys: Sequence[str],
        locations: Sequence[Any] | None,
        sizes: Sequence[Any] | None,
    ) -> tuple[list[bytes], list[memoryview | None], list[int]]:
        """Checked keys and target views; a key whose target is unusable gets FAILED."""
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise TypeError(f"{op}: keys must be a list of strings, got {type(keys).__name__}")
        if locations is None or sizes is None:
            raise ValueError(f"{op}: target_locations and target_sizes are required")
        if not len(keys) == len(locations) == len(sizes):
            raise ValueError(
                f"{op}: {len(keys)} keys, {len(locations)} target_locations and "
                f"{len(sizes)} target_sizes: the lengths must match"
            )
        store_keys = [self._key(k) for k in keys]
        views: list[memoryview | None] = []
        codes: list[int] = []
        for key, loc, size in zip(keys, locations, sizes):
            try:
                views.append(self._target(loc, size))
                codes.append(0)
            except _BadTarget as exc:
                log.error("ucm fastdeploy %s: key %s: %s", op, key, exc)
                views.append(None)
                codes.append(FAILED)
        return store_keys, views, codes

    def _finish(self, task: Any) -> list[Any]:
        """Per-key results; keys not done in time are cancelled and come back as None.

        FastDeploy reuses its buffers as soon as the call returns, so a key already being
        read or written is waited for even past the timeout."""
        try:
            return list(task.wait(self.settings.storage_timeout_s))
        except TimeoutError:
            task.cancel()
            results = task.wait()
            return [None if r.status is Status.CANCELLED else r for r in results]

    def _track(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._written[k] = None
            while len(self._written) > CLEAR_TRACKED:
                self._written.popitem(last=False)
                self._forgotten = True

    @staticmethod
    def _report(op: str, keys: Sequence[str], codes: list[int], good: Any) -> None:
        bad = sum(not good(c) for c in codes)
        if bad:
            log.warning("ucm fastdeploy %s: %d of %d keys failed", op, bad, len(codes))
        else:
            log.debug("ucm fastdeploy %s: %d keys", op, len(codes))
