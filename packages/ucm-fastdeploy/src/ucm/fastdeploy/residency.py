"""Which prefix blocks are resident in this pod's GPU memory, as FastDeploy reports them.

FastDeploy calls ``flush_token_index(task_id, token_ids, start_block_idx, reside_in_gpu)``
after a read from the store (``reside_in_gpu=True``: the blocks are now in HBM) and after a
write-back (``False``: the request is done, its blocks may leave HBM at any time).  The
AttentionStore service uses these reports to route requests to the pod that holds a prefix;
here they are kept in a bounded in-process index that a router or a test can ask.  Blocks
are named by the model's prefix chain, so the index does not depend on the shard.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class ResidencyIndex:
    """A bounded set of prefix-chain keys resident in GPU memory (least recently flushed
    forgotten first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._resident: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._resident)

    def mark(self, chain: Sequence[bytes], resident: bool) -> None:
        with self._lock:
            for key in chain:
                if resident:
                    self._resident[key] = None
                    self._resident.move_to_end(key)
                else:
                    self._resident.pop(key, None)
            while len(self._resident) > self.capacity:
                self._resident.popitem(last=False)

    def resident(self, chain: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._resident for key in chain]

    def prefix(self, chain: Sequence[bytes]) -> int:
        """How many leading keys of ``chain`` are resident."""
        flags = self.resident(chain)
        return next((i for i, r in enumerate(flags) if not r), len(flags))
