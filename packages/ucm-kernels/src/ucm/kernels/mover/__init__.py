"""The mover: one engine-neutral way to move KV blocks between an engine's paged caches and
a store, which every engine adapter drives.

- :mod:`.route`: which way a batch goes (in place, the store's memory, our rows): pure;
- :mod:`.caches`: an engine's cache tensors as the mover takes them;
- :mod:`.rows`: our host rows, kept and reused, and the payloads a store moves;
- :mod:`.mover`: :class:`Mover`, one batch each way (a dump gathered now, a read submitted,
  settled, completed or stopped);
- :mod:`.pipeline`: a run of many batches in steps, the stored prefix kept whole.
"""

from ucm.kernels.mover.caches import Caches
from ucm.kernels.mover.mover import (
    BAD_DIGEST,
    LOAN_ENDED,
    Batch,
    CopyOut,
    Mover,
    MoverSettings,
    Read,
    RoomWrite,
    wait_until,
)
from ucm.kernels.mover.pipeline import Ahead, read_run, write_run
from ucm.kernels.mover.route import Route, RouteAsk, choose_route
from ucm.kernels.mover.rows import RowPool, deferred_payloads, row_buffers

__all__ = [
    "BAD_DIGEST",
    "LOAN_ENDED",
    "Ahead",
    "Batch",
    "Caches",
    "CopyOut",
    "Mover",
    "MoverSettings",
    "Read",
    "Route",
    "RoomWrite",
    "RouteAsk",
    "RowPool",
    "choose_route",
    "deferred_payloads",
    "read_run",
    "row_buffers",
    "wait_until",
    "write_run",
]
