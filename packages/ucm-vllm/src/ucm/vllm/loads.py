"""A rank's loads: stored blocks read into the paged KV cache, and vLLM's rules about them.

Loads are synchronous or asynchronous (``load_mode``).  A sync load runs in
``start_load_kv``, before the forward pass of the step that scheduled the request: the
blocks are read in pieces of about ``pipeline_chunk_mb``, each piece's verified prefix
scattered into the KV cache while the next ones are read (``pipeline_depth`` pieces in
flight), and blocks that failed go to ``get_block_ids_with_load_errors`` so that vLLM
discards the step's output for the request and recomputes from the first bad block.  An
async load reads on the store's threads and is scattered from ``get_transfer_results``
(between forward passes), after which vLLM schedules the request; with several KV-cache
groups a failure fails the whole load (``failed_recving``), as vLLM maps block ids back to
requests only for one group.

Where the store writes what it reads only from host memory (``Store.reads_from_memory``: the
dram store, the posix store on a local filesystem), the cache is on the CPU and a stored
block is one engine block, a sync load reads straight into the engine's blocks, in one
piece: no host row, no scatter.  The worker's thread, which would otherwise wait with its
core idle, copies beside the store's threads.  Blocks that
fail are load errors like any other, so vLLM recomputes them over whatever the read left
there; a load that times out is cancelled and waited for (a memory copy ends at once), so
no read lands after vLLM has taken its blocks back.

Such a load goes a layer at a time where the store lends its blocks (``layer_wise_loads``):
``start_load_kv`` hands them to the mover's thread and returns, the forward pass waits in
``wait_for_layer_load`` for each layer alone (:meth:`Loads.wait_layer`), and once it ended
(``get_block_ids_with_load_errors``, :meth:`Loads.end_step`) each block is checked and the
failures reported as above.  Only once vLLM was seen waiting for every layer in a step; a
step whose forward pass read a layer without waiting fails its layered loads and turns them
off for good.

The reads, the copies out of lent blocks and the rows are the mover's
(:mod:`ucm.kernels.mover`); this module keeps what is vLLM's: pieces and deadlines, which
loaded blocks count for a request of several groups, what vLLM is told of failures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs
from ucm.core import KeyResult, Status, verified_prefix
from ucm.kernels.mover import Batch, Mover, Read, Route
from ucm.vllm.blocks import RankBlocks, positions, shape
from ucm.vllm.counters import Counters
from ucm.vllm.plan import NULL_BLOCK, Transfer
from ucm.vllm.reports import RankReports, dropped_name
from ucm.vllm.stores import ConnectorStores

log = logging.getLogger(__name__)


@attrs.define
class LoadJob:
    transfer: Transfer
    # the mover's reads, one a store and payload size: (positions in transfer.items, read)
    batches: list[tuple[list[int], Read]]
    started: float
    # why none of its blocks count, whatever the store answers: an earlier piece of the
    # request failed ("after_failed"), vLLM reset its prefix cache ("reset"), the store did
    # not answer within load_timeout_s ("no_answer"); "": they may
    failed: str = ""

    def done(self) -> bool:
        return all(read.done() for _, read in self.batches)


def blocks_used(
    full: Sequence[bool], keys: Sequence[int], results: Sequence[KeyResult | None]
) -> list[bool]:
    """Which loaded blocks of a request count, item by item (``full``: a full-attention
    block, else a window tail; ``keys``: its index in the token chain).

    Full-attention blocks count as a prefix: a key is used only if it and every key before
    it loaded for every group.  Window tails belong to the hit's last boundary: they are
    used only if everything loaded."""
    if all(r is not None and r.ok for r in results):
        return [True] * len(results)
    fulls = [p for p, f in enumerate(full) if f]
    prefix = verified_prefix([results[p] for p in fulls], [keys[p] for p in fulls])
    return [f and k < prefix for f, k in zip(full, keys)]


class Loads:
    """This rank's loads, sync or async, and the blocks vLLM must recompute."""

    def __init__(
        self,
        blocks: RankBlocks,
        stores: ConnectorStores | None,
        mover: Mover,
        stats: Counters,
        reports: RankReports | None,
        *,
        sync: bool,
        single_group: bool,
        timeout_s: float,
        layer_wise: bool = True,
    ) -> None:
        self.blocks = blocks
        self.stores = stores
        self.mover = mover
        self.stats = stats
        self.reports = reports  # None: KV events are off
        self.sync = sync
        self.single_group = single_group
        self.timeout_s = timeout_s
        # pieces of a sync load: their size, how many in flight, the grace of a late one
        self.piece_bytes = mover.settings.step_bytes
        self.depth = mover.settings.depth
        self.grace_s = mover.settings.grace_s
        self.jobs: dict[str, LoadJob] = {}  # async loads in flight, by request
        self.error_blocks: set[int] = set()
        # sync loads read straight into the cache (see on_caches): the store then writes
        # the engine's blocks, so only one whose reads stop at once when cancelled
        self.in_place = False
        # ... and a layer at a time beside the forward pass, once vLLM was seen to wait for
        # every layer's load (wait_layer) in a step: the group's layers by name, the layers
        # waited for since the last step ended, and the loads copying (with their deadlines)
        self.layer_wise = layer_wise  # the setting (layer_wise_loads)
        self.layer_index: dict[str, int] = {}
        self.every_layer: frozenset[int] = frozenset()
        self.layered = False
        self.awaited: set[int] = set()
        self.pending: list[tuple[LoadJob, float]] = []

    def on_caches(self) -> None:
        """The caches are registered: decide whether sync loads read in place."""
        self.in_place = (
            self.sync
            and self.single_group
            and self.blocks.device.type == "cpu"
            and self.stores is not None
            and self.stores.full.reads_from_memory
        )
        if self.in_place and self.layer_wise:
            group = self.blocks.layout.stored_groups[0]
            self.layer_index = {name: i for i, name in enumerate(group.layer_names)}
            self.every_layer = frozenset(self.layer_index.values())

    def start(self, transfers: list[Transfer]) -> None:
        """Async loads start; sync ones run to the end (scattered, or load errors), or,
        layered, are under way when this returns (:meth:`wait_layer`, :meth:`end_step`)."""
        if not self.sync:
            for transfer in transfers:
                self.jobs[transfer.req_id] = self._submit(transfer)
            return
        if not transfers:
            return
        started = time.perf_counter()
        try:
            self._start_sync(transfers)
        finally:
            self.stats.add(load_wait_seconds=time.perf_counter() - started)

    def _start_sync(self, transfers: list[Transfer]) -> None:
        deadline = time.monotonic() + self.timeout_s
        if self.layered:
            whole = []
            for transfer in transfers:
                job = self._submit_layered(transfer)
                if job is None:
                    whole.append(transfer)
                else:
                    self.pending.append((job, deadline))
            transfers = whole
        pieces = [p for t in transfers for p in self._pieces(t)]
        failed: set[str] = set()  # requests with a failed block: nothing after it is used
        ahead = [self._submit(p) for p in pieces[: self.depth]]
        for i in range(len(pieces)):
            job = ahead.pop(0)
            self._wait(job, deadline)
            if job.transfer.req_id in failed:
                job.failed = "after_failed"
            if not self._finish(job) and not job.failed:
                failed.add(job.transfer.req_id)
            if i + self.depth < len(pieces):  # into the rows this piece gave back
                ahead.append(self._submit(pieces[i + self.depth]))

    def wait_layer(self, name: str) -> None:
        """vLLM's forward pass is about to read layer ``name``: wait until the layered loads
        of the step copied it (until their deadline: then they fail, and vLLM discards what
        the step computed from them)."""
        layer = self.layer_index.get(name)
        if layer is None:
            return
        self.awaited.add(layer)
        if self.pending:
            started = time.perf_counter()
            self._wait_layer(layer)
            self.stats.add(load_wait_seconds=time.perf_counter() - started)

    def _wait_layer(self, layer: int) -> None:
        for job, deadline in self.pending:
            if job.failed:
                continue
            for _, read in job.batches:
                assert read.layers is not None
                if read.layers.wait_layer(layer, deadline - time.monotonic()) or read.done():
                    continue  # landed, or the copy ended without it (its results say why)
                job.failed = "no_answer"
                self._late(job)
                break

    def end_step(self) -> None:
        """The step's forward pass ended: its layered loads are checked and settled (a
        load any of whose layers vLLM did not wait for fails: the forward pass may have read
        it before it landed), and whether vLLM waits for every layer is learned."""
        seen, self.awaited = self.awaited, set()
        pending, self.pending = self.pending, []
        waited = bool(self.every_layer) and seen >= self.every_layer
        self.stats.add(layered_loads=len(pending))
        started = time.perf_counter()
        for job, deadline in pending:
            if not job.failed and not waited:
                job.failed = "not_awaited"
            self._wait(job, deadline)
            self._finish(job)
        if pending:
            self.stats.add(load_wait_seconds=time.perf_counter() - started)
        if pending and not waited:  # for good: each such step would be recomputed
            self.layered, self.layer_index, self.every_layer = False, {}, frozenset()
            log.warning("ucm: vLLM did not wait for every layer's load: loads are whole now on")
        elif waited and self.in_place and not self.layered and not pending:
            self.layered = True
            log.info("ucm: sync loads go a layer at a time, beside the forward pass")

    def stop_pending(self, why: str) -> None:
        """Layered loads stop now (the caches are going away), and fail."""
        pending, self.pending = self.pending, []
        for job, _ in pending:
            job.failed = job.failed or why
            self._stop_late(job)
            self._finish(job)

    def fail(self, req_ids: list[str] | None = None, why: str = "reset") -> None:
        """Async loads (``req_ids``, or all) whose reads must not be used: planned before
        vLLM reset its prefix cache (what they read may be KV of other weights), or the
        caches are going away (sleep).  Their reads stop now, so that nothing is scattered;
        vLLM recomputes the blocks."""
        for req_id in list(self.jobs) if req_ids is None else req_ids:
            job = self.jobs.get(req_id)
            if job is not None and not job.failed:
                job.failed = why
                for _, read in job.batches:
                    self.mover.stop_read(read, 0.0)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Async loads done or dropped since the last call: (received, failed)."""
        recving, failed = set(), set()
        for req_id in finished_req_ids:
            job = self.jobs.pop(req_id, None)
            if job is not None:
                # Aborted while loading: nothing is scattered, so its engine blocks are free
                # to go, and vLLM holds them (and the request) until it is reported.  Rows
                # go back once the store lets go of them, loans once their checks end.
                for _, read in job.batches:
                    self.mover.stop_read(read, 0.0)
                recving.add(req_id)
        now = time.perf_counter()
        for req_id, job in list(self.jobs.items()):
            if not (job.failed or job.done()):
                if now - job.started < self.timeout_s:
                    continue
                # the store did not answer in time: the request waits no longer, its reads
                # stop (async reads land in rows or the store's memory, never in its blocks)
                log.warning(
                    "ucm: request %s: the store did not answer in %.1f s (load_timeout_s)",
                    req_id,
                    self.timeout_s,
                )
                job.failed = "no_answer"
            del self.jobs[req_id]
            recving.add(req_id)
            if not self._finish(job) and not self.single_group:
                # vLLM takes per-block errors only for single-group models; otherwise the
                # request is recomputed from its local prefix.
                failed.add(req_id)
        return recving, failed

    def take_errors(self) -> set[int]:
        errors, self.error_blocks = self.error_blocks, set()
        # vLLM maps block ids back to requests only for single-group models; the others
        # report failed requests (failed_recving) instead.
        return errors if self.single_group else set()

    def _wait(self, job: LoadJob, deadline: float) -> None:
        """Wait for a sync load until ``deadline``; stop it if it is late (or failed)."""
        for _, read in job.batches:
            if read.task is not None and not job.failed:
                try:
                    read.task.wait(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    pass
        if job.failed:
            self._stop_late(job)
        elif not job.done():
            self._late(job)

    def _late(self, job: LoadJob) -> None:
        log.warning(
            "ucm: request %s: the store did not answer in %.1f s (load_timeout_s)",
            job.transfer.req_id,
            self.timeout_s,
        )
        self._stop_late(job)

    def _stop_late(self, job: LoadJob) -> None:
        """Stop the reads of a late load.  Reads into rows or out of lent blocks are left
        (the rows go back once the store lets go of them); reads into the engine's blocks
        are waited for, since none may land once vLLM has the blocks back: a store that
        reads from memory stops at once, and one whose reads do not stop within
        ``cancel_grace_s`` is no longer trusted with them (later loads go through rows)."""
        for _, read in job.batches:
            if read.done():
                continue
            in_place = read.route is Route.IN_PLACE
            quiet = self.mover.stop_read(read, self.grace_s if in_place else 0.0)
            if not quiet and in_place and self.in_place:
                self.in_place = False
                log.error(
                    "ucm: request %s: reads into the engine's blocks did not stop in "
                    "%.1f s (cancel_grace_s); from now on loads go through host rows",
                    job.transfer.req_id,
                    self.grace_s,
                )

    def _pieces(self, transfer: Transfer) -> list[Transfer]:
        """``transfer`` cut into runs of items of about ``piece_bytes`` (read in place, one:
        no rows to bound, no scatter to overlap, and the store spreads one batch over its
        threads and the thread that waits)."""
        if self.in_place:
            return [transfer]
        pieces: list[Transfer] = []
        size = 0
        for item in transfer.items:
            if not pieces or size >= self.piece_bytes:
                pieces.append(Transfer(transfer.req_id, []))
                size = 0
            pieces[-1].items.append(item)
            size += self.blocks.item_bytes(item)
        return pieces

    def _batches(self, transfer: Transfer) -> list[tuple[list[int], Batch]]:
        """``transfer`` as the mover's batches, one a store and payload size (with their
        positions in ``transfer.items``)."""
        assert self.stores is not None
        items, stores = transfer.items, self.stores
        batches = positions(items, lambda it: (stores.of(self.blocks.group(it)), shape(it)))
        return [
            (where, self.blocks.batch(store, group, [items[p] for p in where]))
            for (store, (group, _)), where in batches.items()
        ]

    def _submit_layered(self, transfer: Transfer) -> LoadJob | None:
        """The mover's layered reads of ``transfer`` (see :meth:`wait_layer`), or None where
        a batch cannot be read so (then the whole load)."""
        if self.stores is None:
            return None
        job = LoadJob(transfer, [], time.perf_counter())
        for where, batch in self._batches(transfer):
            read = self.mover.start_layered_read(batch, self.timeout_s)
            if read is None:
                for _, started in job.batches:
                    self.mover.stop_read(started, self.grace_s)
                return None
            job.batches.append((where, read))
        return job

    def _submit(self, transfer: Transfer) -> LoadJob:
        """The mover's reads of ``transfer``."""
        job = LoadJob(transfer, [], time.perf_counter())
        if self.stores is None:
            return job
        for where, batch in self._batches(transfer):
            job.batches.append((where, self.mover.start_read(batch, cache_lent=self.in_place)))
        return job

    def _finish(self, job: LoadJob) -> bool:
        """Scatter what can be used (see :func:`blocks_used`; none where ``job.failed``);
        True when every block loaded."""
        items = job.transfer.items
        results: list[KeyResult | None] = [None] * len(items)
        for where, read in job.batches:
            if job.failed:  # nothing is copied; loans and rows end (once: fail() may have)
                if not read.stopped:
                    self.mover.stop_read(read, 0.0)
                continue
            for p, result in zip(where, self.mover.settle_read(read)):  # lent: copied out
                results[p] = result
        use = blocks_used([self.blocks.full(it) for it in items], [it.key for it in items],
                          results)  # fmt: skip
        for where, read in job.batches:  # from our rows; the rows go back
            self.mover.complete_read(read, [use[p] for p in where])
        all_ok = all(r is not None and r.ok for r in results)
        if not all_ok:
            problems = {r.detail or r.status.value for r in results if r and not r.ok} or {
                _FAILED.get(job.failed, "store unavailable")
            }
            log.warning(
                "ucm: request %s: %d of %d blocks failed to load, vLLM recomputes them (%s)",
                job.transfer.req_id,
                use.count(False),
                len(items),
                "; ".join(sorted(problems)),
            )
            for item, used in zip(items, use):
                if not used:
                    self.error_blocks.update(b for b in item.block_ids if b != NULL_BLOCK)
        # until the last copy ended (a layered load is settled after the forward pass)
        ended = [r.layers.ended for _, r in job.batches if r.layers is not None]
        end = max(ended) if ended and all(ended) else time.perf_counter()
        self.stats.add(
            loaded_blocks=use.count(True),
            loaded_bytes=sum(self.blocks.item_bytes(it) for it, u in zip(items, use) if u),
            load_seconds=end - job.started,
        )
        for result, used in zip(results, use):
            if not used:
                self.stats.add_cause("load_errors", _load_error_cause(result, job.failed))
        if self.reports is not None:  # a corrupt block is dropped from the store by its reader
            self.reports.dropped(
                [dropped_name(it.group, it.chain_key) for it, r in zip(items, results)
                 if r is not None and r.status is Status.CORRUPT]
            )  # fmt: skip
        return all_ok


_FAILED = {
    "no_answer": "no answer within load_timeout_s",
    "not_awaited": "vLLM did not wait for every layer's load",
    "after_failed": "an earlier block failed",
    "reset": "planned before a reset of the prefix cache",
}


def _load_error_cause(result: KeyResult | None, failed: str) -> str:
    """Why a block was not loaded: the store's answer, none in time (or no store), an
    earlier block of the request failed (a hit is a prefix), or it was planned before a
    reset of the prefix cache."""
    if result is not None and not result.ok:
        return result.status.value
    if failed:
        return failed
    return "no_answer" if result is None else "after_failed"
