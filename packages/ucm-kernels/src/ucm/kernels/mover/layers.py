"""Loads into a CPU cache a layer at a time, beside the forward pass that reads them.

An engine that waits for each layer's KV right before that layer's attention (vLLM's
``wait_for_layer_load``) need not wait for a whole load before its forward pass starts: the
first layers compute while the last ones are copied.  One thread of the mover asks the
store to lend the blocks where they lie, unchecked, with the digests they were stored with
(``Store.open_reads(check=False)``), and copies the first cache tensor's part of every
block, then the second's, and so on (a cache tensor a layer), summing each part's words
where it landed (:func:`ucm.core.digest.copy_layer`).  The engine's thread only hands the
batch over: pinning the blocks and planning the copies happen beside its forward pass too.
A block's parts' sums add up to its payload's, so a block is checked once its last layer
landed, over the very bytes the engine reads, and a block that fails is a failure when the
read is settled: after the forward pass, whose output for it the engine then discards
(vLLM: a load error, recomputed).

Only where each block's payload is views of the caches (the in-place route), the copies
are compiled (numpy's would hold the forward pass's core and its GIL) and the store may lend
blocks (``Store.lends_blocks``); elsewhere a load is whole.  Where it lends none of a batch
after all (a signed store, whose MACs are checked on its own threads; a tiered store whose
memory lacks a block), the thread has the store read them in place, whole, and every layer
lands at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
from ucm.core import KeyResult, SlotReads, Status, Store, Task
from ucm.core.digest import copy_layer, finish

from ucm.kernels.mover.rows import deferred_payloads
from ucm.kernels.segments import BlockSegments

_OK = KeyResult(Status.OK)
_CANCELLED = KeyResult(Status.CANCELLED)
_NO_ANSWER = KeyResult(Status.ERROR, "the store did not answer in time")


def layer_runs(part_caches: Sequence[int] | None) -> list[range] | None:
    """Each cache tensor's parts of a block's payload, as runs of parts, in order; None
    where a tensor's parts are not one run (or the payload has parts of no tensor)."""
    if not part_caches:
        return None
    runs: list[range] = []
    start = 0
    for p in range(1, len(part_caches) + 1):
        if p == len(part_caches) or part_caches[p] != part_caches[start]:
            runs.append(range(start, p))
            start = p
    if len({part_caches[run.start] for run in runs}) != len(runs):
        return None
    return runs


class LayeredCopy:
    """A batch's blocks read into its cache blocks a layer at a time (see the module's
    docstring): :meth:`run` on the mover's thread, :meth:`wait_layer` on the engine's.
    ``task``: one result per block, once the copy ended."""

    def __init__(
        self,
        store: Store,
        keys: list[bytes],
        nbytes: int,
        tag: bytes,
        segments: BlockSegments,
        layers: list[range],
        bad_digest: KeyResult,
        timeout_s: float,
    ) -> None:
        self.task = Task(len(keys))
        self._store, self._keys, self._nbytes, self._tag = store, keys, nbytes, tag
        self._segments = segments
        self._layers = layers
        self._bad = bad_digest
        self._timeout_s = timeout_s  # of a whole read, where the store lends none
        self._landed = 0  # layers copied into every block
        self._ended = threading.Condition()
        self.ended = 0.0  # time.perf_counter() when the copy ended (0: not yet)
        #: the blocks the store lent, set on the mover's thread before the task ends
        self.lent: SlotReads | None = None

    @property
    def layers(self) -> int:
        return len(self._layers)

    def wait_layer(self, layer: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until layer ``layer`` of every block landed (or
        the copy ended without it); whether it landed.  A layer the blocks do not have
        has."""
        if layer >= len(self._layers):
            return True
        with self._ended:
            self._ended.wait_for(lambda: self._landed > layer or self.task.done(), timeout)
            return self._landed > layer

    def take_lent(self) -> SlotReads | None:
        """The lent blocks, for the caller to give back (once the task ended)."""
        lent, self.lent = self.lent, None
        return lent

    def run(self) -> None:
        """Read every layer, then check the blocks (on the mover's thread)."""
        try:
            self.task.try_keys(range(len(self._keys)), self._read)
        finally:  # no waiter waits past the end of the copy, whatever ended it
            with self._ended:
                self.ended = time.perf_counter()
                self._ended.notify_all()

    def _land(self, layers: int) -> None:
        with self._ended:
            self._landed = layers
            self._ended.notify_all()

    def _read(self) -> list[KeyResult | None]:
        lent = self._store.open_reads(self._keys, self._nbytes, self._tag, check=False)
        if lent is not None and (lent.digests is None or not lent.task.done()):
            lent.release()  # checked by the store: read whole instead
            lent = None
        if lent is None:
            return self._whole()
        self.lent = lent
        results: list[KeyResult | None] = list(lent.task.wait(0))
        at = lent.addresses()  # (0: no view)
        copied = [i for i, r in enumerate(results) if r and r.ok and at[i]]
        starts = self._segments.part_addresses()
        lengths = np.array(self._segments.part_lengths(), np.uint64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        dsts = starts[copied]
        slots = at[copied]
        sums = np.zeros(len(copied), np.uint64)
        for done, layer in enumerate(self._layers):
            if self.task.cancelled:  # the engine takes its blocks back: not a byte more
                for i in copied:
                    results[i] = _CANCELLED
                return results
            copy_layer(dsts, slots, offsets, lengths, layer, sums)
            self._land(done + 1)
        digests = lent.digests
        assert digests is not None
        for i, total in zip(copied, sums.tolist()):
            results[i] = _OK if finish(total, self._nbytes) == digests[i] else self._bad
        return results

    def _whole(self) -> list[KeyResult | None]:
        """The store lends none of the blocks: it reads them into place itself, and every
        layer lands at once."""
        payloads = deferred_payloads(self._segments, range(len(self._keys)))
        load = self._store.load(self._keys, payloads, self._tag)
        self.task.add_part(load)  # a cancel stops it, and waits for it to let go
        try:
            results: list[KeyResult | None] = list(load.wait(self._timeout_s))
        except TimeoutError:  # the store's reads from memory stop at once
            load.cancel(wait=self._timeout_s)
            return [_NO_ANSWER] * len(self._keys)
        self._land(len(self._layers))
        return results
