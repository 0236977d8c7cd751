"""Stores: where KV blocks live outside the accelerator.

The interface (:mod:`.base`) works on tasks (:mod:`.task`) and payloads (:mod:`.payload`);
each kind is a package with its settings beside its store (:mod:`.posix`, :mod:`.dram`,
:mod:`.tiered`, :mod:`.mooncake`), listed once in :mod:`.kinds`.
"""

from __future__ import annotations

from ucm.core.store.base import Store, StoreUsage
from ucm.core.store.dram import DramStore, SharedMemoryStore
from ucm.core.store.kinds import create_store
from ucm.core.store.payload import Payload
from ucm.core.store.posix import PosixStore
from ucm.core.store.task import KeyResult, Status, Task, first_problem, verified_prefix
from ucm.core.store.tiered import TieredStore

__all__ = [
    "DramStore",
    "KeyResult",
    "Payload",
    "PosixStore",
    "SharedMemoryStore",
    "Status",
    "Store",
    "StoreUsage",
    "Task",
    "TieredStore",
    "create_store",
    "first_problem",
    "verified_prefix",
]
