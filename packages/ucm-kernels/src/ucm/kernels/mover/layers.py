"""Loads into a CPU cache a layer at a time, beside the forward pass that reads them.

An engine that waits for each layer's KV right before that layer's attention (vLLM's
``wait_for_layer_load``) need not wait for a whole load before its forward pass starts: the
first layers compute while the last ones are copied.  The store lends its blocks where they
lie, unchecked, with the digests they were stored with (``Store.open_reads(check=False)``);
one thread of the mover copies the first cache tensor's part of every block, then the
second's, and so on (a cache tensor a layer), summing each part's words where it landed
(:func:`ucm.core.digest.copy_sums`).  A block's parts' sums add up to its payload's, so a
block is checked once its last layer landed, over the very bytes the engine reads, and a
block that fails is a failure when the read is settled: after the forward pass, whose
output for it the engine then discards (vLLM: a load error, recomputed).

Only where each block's payload is views of the caches (the in-place route), the copies are
compiled (numpy's would hold the forward pass's core), and the store lends blocks unchecked
(a signed store checks its MACs on its own threads): elsewhere a load is whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import attrs
import numpy as np
from ucm.core import KeyResult, SlotReads, Status, Task, address_of
from ucm.core.digest import copy_sums, finish

from ucm.kernels.segments import BlockSegments

_OK = KeyResult(Status.OK)
_CANCELLED = KeyResult(Status.CANCELLED)


@attrs.frozen
class _Pieces:
    """One layer's part of every copied block: uint64 addresses and lengths, each part's
    first word in its block's payload, and its block (its place among the copied ones)."""

    dsts: np.ndarray
    srcs: np.ndarray
    lengths: np.ndarray
    firsts: np.ndarray
    blocks: np.ndarray


class LayeredCopy:
    """A batch's lent blocks copied into its cache blocks a layer at a time (see the
    module's docstring): :meth:`run` on the mover's thread, :meth:`wait_layer` on the
    engine's.  ``task``: one result per block of the batch, those not copied (not lent)
    settled already."""

    def __init__(
        self,
        task: Task,
        layers: list[_Pieces],
        copied: list[int],
        expected: list[int],
        nbytes: int,
        bad_digest: KeyResult,
    ) -> None:
        self.task = task
        self._layers = layers
        self._copied = copied  # the batch's places of the blocks copied
        self._expected = expected  # their stored digests
        self._nbytes = nbytes
        self._bad = bad_digest
        self._landed = 0  # layers copied into every block
        self._ended = threading.Condition()
        self.ended = 0.0  # time.perf_counter() when the copy ended (0: not yet)

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

    def run(self) -> None:
        """Copy every layer, then check the blocks (on the mover's thread)."""
        try:
            self.task.try_keys(self._copied, self._copy)
        finally:  # no waiter waits past the end of the copy, whatever ended it
            with self._ended:
                self.ended = time.perf_counter()
                self._ended.notify_all()

    def _copy(self) -> list[KeyResult | None]:
        sums = np.zeros(len(self._copied), np.uint64)
        for pieces in self._layers:
            if self.task.cancelled:  # the engine takes its blocks back: not a byte more
                return [_CANCELLED] * len(self._copied)
            got = copy_sums(pieces.dsts, pieces.srcs, pieces.lengths, pieces.firsts)
            np.add.at(sums, pieces.blocks, got)  # modulo 2**64, as the digest's sum
            with self._ended:
                self._landed += 1
                self._ended.notify_all()
        return [
            _OK if finish(int(total), self._nbytes) == want else self._bad
            for total, want in zip(sums.tolist(), self._expected)
        ]


def plan_layers(
    segments: BlockSegments,
    part_caches: Sequence[int],
    lent: SlotReads,
    nbytes: int,
    bad_digest: KeyResult,
) -> LayeredCopy | None:
    """The copy of the blocks ``lent`` (unchecked, its task done) into ``segments``, a cache
    tensor (``part_caches``: each part's) at a time; None where a part is not whole words
    (the digest's sums are of words)."""
    assert lent.digests is not None
    results = lent.task.wait(0)
    copied = [i for i, r in enumerate(results) if r.ok and lent.views[i] is not None]
    starts, lengths = segments.part_addresses()
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    if bool((lengths % 8).any()) or int(lengths.sum()) != nbytes:
        return None
    slots = np.array([address_of(lent.views[i]) for i in copied], np.uint64)  # type: ignore[arg-type]
    places = np.arange(len(copied), dtype=np.intp)
    caches = np.asarray(part_caches)
    pieces = []
    for cache in range(int(caches.max()) + 1):
        cols = np.flatnonzero(caches == cache)
        pieces.append(
            _Pieces(
                dsts=starts[copied][:, cols].ravel(),
                srcs=(slots[:, None] + offsets[cols]).ravel(),
                lengths=np.tile(lengths[cols], len(copied)),
                firsts=np.tile(offsets[cols] // np.uint64(8), len(copied)),
                blocks=np.repeat(places, len(cols)),
            )
        )
    task = Task(len(results))
    settled = sorted(set(range(len(results))) - set(copied))
    task.set_results(settled, [results[i] for i in settled])
    expected = [int(lent.digests[i]) for i in copied]  # type: ignore[arg-type]
    return LayeredCopy(task, pieces, copied, expected, nbytes, bad_digest)
