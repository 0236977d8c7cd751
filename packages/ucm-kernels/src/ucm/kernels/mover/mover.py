"""The mover: blocks between an engine's paged caches and a store, by the route
:func:`~ucm.kernels.mover.route.choose_route` picks, for every engine adapter.

One batch each way is the unit (a batch: blocks of one payload size, one store, one set of
caches):

* :meth:`Mover.dump` gathers a batch before it returns, so the engine may reuse its blocks
  at once, and hands the store the bytes to write behind the engine's back (into room the
  store reserved in its memory, or from rows of ours);
* :meth:`Mover.start_read` submits a batch's loads; :meth:`Mover.settle_read` copies out
  the blocks the store lends and gives them back; :meth:`Mover.complete_read` scatters the
  blocks the caller chose to use from our rows and gives the rows back;
  :meth:`Mover.stop_read` cancels a read and waits a grace for the store to let go.

Runs of many batches pipelined, a call's stored prefix kept whole, are
:mod:`ucm.kernels.mover.pipeline`'s (``write_run``, ``read_run``).

Integrity at the link's speed: on a GPU, blocks moved through the store's memory are digested
by the device (:mod:`ucm.kernels.digest`) as they are gathered, the store booking the digests
without reading the bytes, and checked on the device as they come back, only the good ones
scattered: no host thread touches a block's bytes (``MoverSettings.device_digests``).

The store's host memory is registered with a GPU's driver the first time a batch could use
it (a store maps its memory with its first block), every store's all or none: where the
driver or a copy refuses it, every batch goes through rows from then on.  Torch only: the
mover runs wherever torch does, with no engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from ucm.core import KeyResult, SlotReads, SlotWrites, Status, Store, Task, store_pool
from ucm.core.digest import compiled

from ucm.kernels.mover.caches import Caches
from ucm.kernels.mover.layers import LayeredCopy, layer_runs
from ucm.kernels.mover.route import Route, RouteAsk, choose_route
from ucm.kernels.mover.rows import RowPool, deferred_payloads, row_buffers
from ucm.kernels.pinning import PinnedRegions, dump_into, host_rows
from ucm.kernels.segments import BlockSegments, block_segments
from ucm.kernels.staging import IN_PLACE_MIN_BYTES, HostStager, TransferHandle

log = logging.getLogger(__name__)


@attrs.frozen
class MoverSettings:
    """How a mover moves blocks; each adapter fills these from its own settings."""

    #: routes other than our rows allowed (in place, the store's memory)
    zero_copy: bool = True
    #: bytes a step of a pipelined run moves (one store call each)
    step_bytes: int = 32 << 20
    #: steps of a pipelined run in flight at once (bounds the rows it holds)
    depth: int = 4
    #: how long a cancelled transfer may take to let go of the caches or rows
    grace_s: float = 2.0
    #: bytes of free rows kept for reuse
    staging_bytes: int = 512 << 20
    #: blocks moved through the store's memory digested and checked by the copy's device
    #: (None: on a GPU), the store booking digests instead of reading every byte; a store
    #: that signs reads them whatever this says (its MAC is computed on the host)
    device_digests: bool | None = None


#: a block whose loan ended before it was copied out (the store took it back)
LOAN_ENDED = KeyResult(Status.ERROR, "the block's loan ran out before it was copied")
#: a block whose bytes, copied out of the store's memory, are not the ones it was stored with
BAD_DIGEST = KeyResult(Status.CORRUPT, "the block fails its digest (checked as it was copied)")
_REFUSED = KeyResult(Status.ERROR, "the copy refused the store's memory")


@attrs.frozen
class Batch:
    """Blocks of one payload size moving between one set of caches and one store: block
    ``block_ids[i]`` (an engine block id, or a list of them) under key ``keys[i]``."""

    caches: Caches
    block_ids: Sequence[Any]
    keys: Sequence[bytes]
    store: Store
    tag: bytes  # the payload's layout, in every block's header
    nbytes: int  # one block's payload

    def __len__(self) -> int:
        return len(self.keys)

    def part(self, start: int, stop: int) -> Batch:
        """Blocks ``[start, stop)`` of this batch."""
        return attrs.evolve(self, block_ids=self.block_ids[start:stop], keys=self.keys[start:stop])


@attrs.define
class Read:
    """One batch's loads in flight: their route and what they land in."""

    batch: Batch
    route: Route
    task: Task | None  # None: the store could not start them (every result None)
    rows: list[torch.Tensor] = attrs.Factory(list)  # ROWS: one a block
    lent: SlotReads | None = None  # STORE_MEMORY: the blocks the store lends
    stopped: bool = False  # cancelled before it was settled (Mover.stop_read)
    layers: LayeredCopy | None = None  # copied in place a layer at a time (layered)

    def done(self) -> bool:
        return self.task is None or self.task.done()

    def results(self) -> list[KeyResult | None]:
        """One a block; None where none came (the store was unavailable, or not done) or
        none counts: stopped, the blocks read into rows or lent are given up (read in place
        by the store, those that landed before the stop are in the caches)."""
        gone = self.stopped and (self.route is not Route.IN_PLACE or self.layers is not None)
        if self.task is None or not self.task.done() or gone:
            return [None] * len(self.batch)
        return list(self.task.wait(0))


@attrs.define
class RoomWrite:
    """A batch being gathered into room its store reserved in its memory, the copy maybe
    still running: :meth:`commit` once it is done (the store seals and publishes the blocks
    on its threads), or :meth:`abort`."""

    writes: SlotWrites
    handle: TransferHandle | None  # None: nothing to copy
    digests: torch.Tensor | None = None  # the copied blocks' digests, from the device

    def commit(self) -> Task:
        # a copy that fails to end leaves the room reserved for as long as this process
        # lives: it may still be written, so no other writer may get it
        if self.handle is not None:
            self.handle.wait()
        if self.digests is None:
            return self.writes.commit()
        found = self.digests.numpy().view(np.uint64)  # the int64s' bits: the digests
        if found.size == len(self.writes.views):  # a digest a key, as one array
            return self.writes.commit(found)  # type: ignore[arg-type]
        given = iter(found.tolist())
        placed = (self.writes.addresses() != 0).tolist()
        return self.writes.commit([next(given) if p else None for p in placed])

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        self.writes.abort()


@attrs.define
class CopyOut:
    """Lent blocks being scattered into the caches, checked on the way where the store lent
    them unchecked: :meth:`settle` it before they are given back."""

    lent: SlotReads
    which: list[int]  # the blocks' places in the batch
    handle: TransferHandle | None  # None: nothing to copy
    verdicts: torch.Tensor | None  # per block, whether it passed (None: the store checked)

    def settle(self) -> list[bool]:
        """Wait for the copy; per block, whether it is in the cache.  The blocks that failed
        their digest are dropped from the store when given back."""
        if self.handle is not None:
            self.handle.wait()
        if self.verdicts is None:
            return [True] * len(self.which)
        ok = [bool(v) for v in self.verdicts.tolist()]
        bad = [i for i, good in zip(self.which, ok) if not good]
        if bad:
            log.warning("ucm: %d blocks lent by the store fail their digest: dropped", len(bad))
            self.lent.drop(bad)
        return ok


class Mover:
    """Moves batches of blocks between caches and stores; thread-safe (FastDeploy moves
    from several threads, each with a side stream of its own on a GPU)."""

    def __init__(self, settings: MoverSettings | None = None, pool: RowPool | None = None) -> None:
        self.settings = settings or MoverSettings()
        self.pool = pool if pool is not None else RowPool(self.settings.staging_bytes)
        # the stores' host memory, registered with the GPU's driver (_registered)
        self.pinned = PinnedRegions()
        self._pinning = threading.Lock()
        self._stores_seen: set[int] = set()  # stores whose memory was offered to the driver
        self._refused = False  # the driver or a copy refused the stores' memory: rows
        self._stagers = threading.local()  # a side stream per thread on a GPU
        self._copier: Any = None  # the thread of layered reads, started with the first

    def close(self) -> None:
        """Unregister the stores' memory from the GPU's driver (before the stores unmap
        it); layered copies end first."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)  # each ends within a layer's copy once stopped
        with self._pinning:
            self.pinned.close()

    # -- the route -------------------------------------------------------------------------

    def route(self, batch: Batch, *, cache_lent: bool) -> tuple[Route, BlockSegments | None]:
        """The route of ``batch``, and its payloads as views of the caches where it moves
        in place (``cache_lent``: the store may touch the cache blocks until the transfer
        ends)."""
        device = batch.caches.device.type
        # views of the cache change the route only where the store may touch the cache or a
        # block is small (a large one goes to the store's memory either way): a dump's
        # batch of large blocks skips planning them
        zero_copy = self.settings.zero_copy and not self._refused
        views = zero_copy and device == "cpu" and (cache_lent or batch.nbytes < IN_PLACE_MIN_BYTES)
        segments = self._segments(batch) if views else None
        ask = RouteAsk(
            device=device,
            nbytes=batch.nbytes,
            contiguous=segments is not None,
            cache_lent=cache_lent,
            registered=device == "cuda" and not self._refused and self._registered(batch.store),
            zero_copy=zero_copy,
        )
        route = choose_route(ask)
        return route, segments if route is Route.IN_PLACE else None

    def _segments(self, batch: Batch) -> BlockSegments | None:
        """Each block's payload as views of the caches, or None (their layout does not
        allow it, or a block would not be ``nbytes``)."""
        caches = batch.caches
        if caches.device.type != "cpu":
            return None
        try:
            segments = block_segments(caches.checked(), batch.block_ids, **caches.copy_options())
        except (TypeError, ValueError) as exc:  # the copy kernels check and report the same
            log.debug("ucm: payloads as views of the cache not possible (%s)", exc)
            return None
        if segments is None or segments.nbytes != batch.nbytes:
            return None
        return segments

    @property
    def refused(self) -> bool:
        """Whether the driver or a copy refused the stores' memory: every batch goes
        through rows."""
        return self._refused

    def register(self, store: Store) -> bool:
        """Register ``store``'s host memory with the GPU's driver now rather than when a
        batch first could use it; whether it is registered."""
        return torch.cuda.is_available() and self._registered(store)

    def _registered(self, store: Store) -> bool:
        """Whether ``store``'s host memory is registered with the GPU's driver: all of it,
        the first time it has some."""
        with self._pinning:
            if self._refused:
                return False
            if id(store) not in self._stores_seen:
                regions = store.host_memory()
                if not regions:
                    return False
                self._stores_seen.add(id(store))
                fresh = [r for r in regions if not self.pinned.holds(r)]
                if fresh and not self.pinned.register_all(fresh):
                    self._refused = True  # register_all undid every registration
                    return False
            return bool(self.pinned)

    def _refuse(self, what: str, exc: Exception) -> None:
        """A copy refused the stores' memory (on a GPU: not pinned after all): rows from
        now on."""
        log.warning("ucm: cannot copy %s the store's memory (%s): using rows", what, exc)
        self._refused = True

    # -- copies ----------------------------------------------------------------------------

    def stager(self, device: torch.device) -> HostStager:
        """This thread's stager for ``device`` (its own side stream on a GPU)."""
        stagers = self._stagers.__dict__.setdefault("by_device", {})
        if device not in stagers:
            stagers[device] = HostStager(device)
        return stagers[device]  # type: ignore[no-any-return]

    def take_rows(self, batch: Batch) -> list[torch.Tensor]:
        """Rows of ours for the batch (pinned on a GPU: its copies are asynchronous)."""
        return self.pool.take(batch.nbytes, len(batch), pin=batch.caches.device.type == "cuda")

    def gather_rows(self, batch: Batch, rows: Sequence[torch.Tensor]) -> None:
        """Gather the batch's blocks into rows of ours."""
        caches = batch.caches
        stager = self.stager(caches.device)
        stager.dump(caches.checked(), batch.block_ids, rows, **caches.copy_options()).wait()

    def scatter_rows(self, batch: Batch, rows: Sequence[torch.Tensor]) -> None:
        """Scatter rows of ours into the batch's blocks (``rows[i]`` into block i)."""
        caches = batch.caches
        stager = self.stager(caches.device)
        stager.load(caches.checked(), batch.block_ids, rows, **caches.copy_options()).wait()

    def digests_on_device(self, batch: Batch) -> bool:
        """Whether the batch's blocks are digested and checked by the copy's device."""
        on = self.settings.device_digests
        if on is None:
            on = batch.caches.device.type == "cuda"
        return on and batch.nbytes % 8 == 0  # the device sums whole words

    def start_room_write(self, batch: Batch) -> RoomWrite | None:
        """Start gathering the batch straight into room its store reserves in its memory;
        None where it has no room, or the copy refused it (then it goes through rows)."""
        try:
            writes = batch.store.open_writes(list(batch.keys), batch.nbytes, batch.tag)
        except Exception as exc:  # noqa: BLE001 - the dump through rows reports the store
            log.debug("ucm: no room to write in place (%s)", exc)
            return None
        if writes is None:
            return None
        caches = batch.caches
        digests = None
        if writes.takes_digests and self.digests_on_device(batch):
            copied = int(np.count_nonzero(writes.addresses()))  # the keys with room
            digests = torch.zeros(
                copied, dtype=torch.int64, pin_memory=caches.device.type == "cuda"
            )
        try:
            handle = dump_into(
                self.stager(caches.device),
                self.pinned,
                caches.checked(),  # type: ignore[arg-type]
                batch.block_ids,
                writes,
                digests=digests,
                **caches.copy_options(),
            )
        except ValueError as exc:  # the plan refused the room (a GPU: not pinned after all)
            self._refuse("into", exc)
            return None
        return RoomWrite(writes, handle, digests if handle is not None else None)

    def lent(self, batch: Batch) -> SlotReads | None:
        """The batch's stored blocks lent where they lie in its store's memory: checked on
        the store's threads, or unchecked with their stored digests where the copy's device
        checks them (:meth:`digests_on_device`); None where the store lends none."""
        try:
            return batch.store.open_reads(
                list(batch.keys), batch.nbytes, batch.tag, check=not self.digests_on_device(batch)
            )
        except Exception as exc:  # noqa: BLE001 - the load through rows reports the store
            log.debug("ucm: no blocks lent in place (%s)", exc)
            return None

    def start_copy_out(self, batch: Batch, lent: SlotReads, count: int) -> CopyOut | None:
        """Start scattering the first ``count`` lent blocks of the batch into its blocks;
        :meth:`CopyOut.settle` says which are good once it is done.  None where the copy
        refused the store's memory (on a GPU: not pinned after all): rows from now on."""
        return self._copy_out(batch, lent, list(range(count)))

    def _copy_out(self, batch: Batch, lent: SlotReads, which: list[int]) -> CopyOut | None:
        """Start scattering the lent blocks ``which`` into their cache blocks, checked
        against their stored digests on the way where the store lent them unchecked."""
        if not which:
            return CopyOut(lent, which, None, None)
        caches = batch.caches
        ids = [batch.block_ids[i] for i in which]
        try:
            rows = host_rows(self.pinned, lent, which)
            stager = self.stager(caches.device)
            if lent.digests is None:
                handle = stager.load(caches.checked(), ids, rows, **caches.copy_options())
                return CopyOut(lent, which, handle, None)
            expected = [lent.digests[i] for i in which]
            verdicts, handle = stager.load_checked(
                caches.checked(),
                ids,
                rows,
                expected,  # type: ignore[arg-type]
                **caches.copy_options(),
            )
        except ValueError as exc:  # the plan refused the store's memory (a GPU: not pinned)
            self._refuse("out of", exc)
            return None
        return CopyOut(lent, which, handle, verdicts)

    # -- one batch each way -------------------------------------------------------------------

    def dump(self, batch: Batch) -> Task:
        """Gather the batch now (the engine may reuse its blocks once this returns) and have
        the store write it behind: straight into room it reserves in its memory where it
        has some, else from rows of ours (given back once written).  Raises what the store
        raises on starting; rows are given back then."""
        route, _ = self.route(batch, cache_lent=False)
        if route is Route.STORE_MEMORY:
            room = self.start_room_write(batch)
            if room is not None:
                return room.commit()
        rows = self.take_rows(batch)
        try:
            self.gather_rows(batch, rows)
            task = batch.store.dump(list(batch.keys), row_buffers(rows), batch.tag)
        except BaseException:
            self.pool.give(rows)
            raise
        task.add_done_callback(lambda _task: self.pool.give(rows))
        return task

    def start_read(self, batch: Batch, *, cache_lent: bool = False) -> Read:
        """Submit the batch's loads: into the caches themselves (``cache_lent``: the caller
        keeps the blocks until the read is settled or stopped), out of blocks the store
        lends, or into rows of ours.  A store that fails to start gives a read with no
        task (logged): every block fails."""
        route, segments = self.route(batch, cache_lent=cache_lent)
        read = Read(batch, route, None)
        store, keys = batch.store, list(batch.keys)
        try:
            if route is Route.STORE_MEMORY:
                read.lent = self.lent(batch)
                if read.lent is not None:
                    read.task = read.lent.task
                    return read
                read.route = Route.ROWS
            if segments is not None:
                payloads = deferred_payloads(segments, range(len(keys)))
                read.task = store.load(keys, payloads, batch.tag)
                return read
            read.rows = self.take_rows(batch)
            read.task = store.load(keys, row_buffers(read.rows), batch.tag)
        except Exception as exc:  # noqa: BLE001 - a failing store is a miss
            log.warning("ucm: a load of %d blocks failed to start: %s", len(keys), exc)
            self.pool.give(read.rows)
            read.rows = []
        return read

    def start_layered_read(self, batch: Batch, timeout_s: float = 60.0) -> Read | None:
        """Submit the batch's loads straight into its cache blocks a cache tensor at a time
        (:mod:`ucm.kernels.mover.layers`), on the mover's thread: ``read.layers`` says when
        each one landed.  The caller keeps the blocks until the read is settled or stopped;
        ``timeout_s`` bounds a read the store does whole.  None where the batch cannot be
        read so (then :meth:`start_read`)."""
        if not (compiled() and batch.store.lends_blocks) or self._refused:
            return None  # (a store that lends nothing reads in place faster itself)
        route, segments = self.route(batch, cache_lent=True)
        if route is not Route.IN_PLACE or segments is None:
            return None
        layers = layer_runs(segments.part_caches())
        if layers is None or any(n % 8 for n in segments.part_lengths()):
            return None  # (the digest's sums are of whole words)
        copy = LayeredCopy(
            batch.store, list(batch.keys), batch.nbytes, batch.tag, segments, layers,
            BAD_DIGEST, timeout_s,
        )  # fmt: skip
        if self._copier is None:
            self._copier = store_pool(1, "ucm-layers")  # beside the store's threads
        self._copier.submit(copy.run)
        return Read(batch, Route.IN_PLACE, copy.task, layers=copy)

    def settle_read(self, read: Read) -> list[KeyResult | None]:
        """The batch's results once its loads ended (or timed out: None); blocks the store
        lends are copied out, the checked ones, and given back, and a block whose loan ran
        out first is a failure."""
        results = read.results()
        if read.layers is not None:
            return self._settle_layers(read, results)
        if read.lent is None:
            return results
        lent, read.lent = read.lent, None
        ok = [i for i, r in enumerate(results) if r is not None and r.ok]
        try:
            copy = self._copy_out(read.batch, lent, ok)  # the lent blocks, wherever they are
            if copy is None:
                results = [_REFUSED] * len(read.batch)
            else:
                for i, good in zip(ok, copy.settle()):
                    if not good:
                        results[i] = BAD_DIGEST
        finally:  # every loan ends, whatever happened
            held = lent.release()
        return [r if held[i] or r is None else LOAN_ENDED for i, r in enumerate(results)]

    def _settle_layers(self, read: Read, results: list[KeyResult | None]) -> list[KeyResult | None]:
        """A layered read's lent blocks given back once copied: those that failed their
        digest dropped from the store, those whose loan ran out first failures."""
        copy = read.layers
        assert copy is not None
        if not read.done():  # never ended: nothing of it counts, the loans end with it
            read.task.add_done_callback(lambda _task: _give_back(copy.take_lent()))  # type: ignore[union-attr]
            return [None] * len(read.batch)
        lent = copy.take_lent()
        if lent is None:  # read whole by the store, or given back when it was stopped
            return results
        bad = [i for i, r in enumerate(results) if r is BAD_DIGEST]
        if bad:
            log.warning("ucm: %d blocks lent by the store fail their digest: dropped", len(bad))
            lent.drop(bad)
        held = lent.release()
        return [r if held[i] or r is None else LOAN_ENDED for i, r in enumerate(results)]

    def complete_read(self, read: Read, use: Sequence[bool]) -> None:
        """Scatter the blocks to ``use`` from our rows into the caches, and give the rows
        back (read in place or lent, the blocks are in the caches already)."""
        if not read.rows:
            return
        rows, read.rows = read.rows, []
        try:
            used = [i for i, u in enumerate(use) if u and i < len(rows)]
            if used:
                part = attrs.evolve(
                    read.batch,
                    block_ids=[read.batch.block_ids[i] for i in used],
                    keys=[read.batch.keys[i] for i in used],
                )
                self.scatter_rows(part, [rows[i] for i in used])
        finally:
            self.pool.give(rows)

    def stop_read(self, read: Read, grace_s: float) -> bool:
        """Cancel the batch's loads and wait up to ``grace_s`` for the store to let go of
        what they land in; whether it has.  Loans end; rows go back once the store is done
        with them (a late read may still fill them)."""
        quiet = read.task is None or read.task.cancel(wait=grace_s)
        read.stopped = True
        if read.lent is not None:  # given back once their checks end
            read.lent.release()
            read.lent = None
        copy = read.layers
        if copy is not None:  # what it copies out of is given back once it ends
            if quiet:
                _give_back(copy.take_lent())
            elif read.task is not None:
                read.task.add_done_callback(lambda _task: _give_back(copy.take_lent()))
        rows, read.rows = read.rows, []
        if rows:
            if quiet or read.task is None:
                self.pool.give(rows)
            else:
                read.task.add_done_callback(lambda _task: self.pool.give(rows))
        return quiet


def _give_back(lent: SlotReads | None) -> None:
    if lent is not None:
        lent.release()


def wait_until(task: Task, deadline: float) -> bool:
    """Wait for ``task`` until ``deadline`` (monotonic); whether it is done."""
    if task.done():
        return True
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        task.wait(left)
    except TimeoutError:
        return False
    return True
