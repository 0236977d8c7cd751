"""The worker side: load stored blocks into the paged KV cache, dump computed blocks.

Runs in each vLLM worker process, one per tensor-parallel rank; each rank reads and writes
its own shard under its own keys.

Loads are synchronous or asynchronous (``load_mode``).  A sync load runs in
``start_load_kv``, before the forward pass of the step that scheduled the request: the
blocks are read in pieces into reused host rows, each piece's verified prefix is scattered
into the KV cache while the next one is read, and blocks that failed go to
``get_block_ids_with_load_errors`` so that vLLM discards the step's output for the request
and recomputes from the first bad block.  An async load reads on the store's threads and is
scattered from ``get_transfer_results`` (between forward passes), after which vLLM
schedules the request; with several KV-cache groups a failure fails the whole load
(``failed_recving``), as vLLM maps block ids back to requests only for one group.

Where the store only copies from host memory (``Store.reads_from_memory``: the dram store),
the cache is on the CPU and a stored block is one engine block, a sync load reads straight
into the engine's blocks: no host row, no scatter.  Blocks that fail are load errors like
any other, so vLLM recomputes them over whatever the read left there; a load that times out
is cancelled and waited for (a memory copy ends at once), so no read lands after vLLM has
taken its blocks back.

Dumps gather the blocks into host rows right after the forward pass that computed them, so
vLLM may reuse the engine blocks at once; the store writes in the background.  Where the
store keeps its blocks in this host's memory (``Store.open_writes``: the dram store) and the
cache is on the CPU, the blocks are gathered straight into the store's slots instead, and
the store only seals and publishes them: one copy, no host row.

On a GPU the same store's memory is registered with the CUDA driver at start-up
(:class:`~ucm.kernels.PinnedRegions`), so that its DMA engine copies straight into it:
dumps gather into the store's slots, and loads scatter from blocks the store lends where
they lie (``Store.open_reads``), checked on its threads first.  Where the driver refuses
the registration, both go through pinned host rows.

This side imports no vLLM: it works on the step's plan (:mod:`ucm.vllm.transfers`) and
torch tensors, so its data path runs wherever torch does (a GPU machine without vLLM).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch
from ucm.core.keys import scoped_keys
from ucm.core.lifecycle import DumpTracker
from ucm.core.store import KeyResult, Status, Store, Task
from ucm.core.store.reads import SlotReads
from ucm.core.store.writes import SlotWrites
from ucm.kernels import (
    IN_PLACE_MIN_BYTES,
    BlockSegments,
    HostStager,
    PinnedRegions,
    block_segments,
    dump_into,
    payload_nbytes,
)
from ucm.kernels.transfer import RowPool, deferred_payloads, row_buffers, verified_prefix
from ucm.vllm.counters import Counters
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.reports import RankReports, dropped_name
from ucm.vllm.stores import ConnectorStores
from ucm.vllm.transfers import NULL_BLOCK, Item, Report, StepPlan, Transfer

log = logging.getLogger(__name__)
LAYOUT_TAG = b"vllm-paged-kv-v1"  # in every block's header: what the payload's bytes are

# Sync loads are read and scattered in pieces of about this size, so that the reads of one
# piece overlap the scatter of the previous one.
PIECE_BYTES = 16 << 20


@attrs.define
class LoadJob:
    transfer: Transfer
    tasks: list[tuple[list[int], Task]]  # (positions in transfer.items, task) per store
    rows: list[torch.Tensor]  # one host row per item; none when read in place
    started: float
    in_place: bool = False  # read straight into the engine's blocks
    # blocks the stores lend where they lie, copied out by the GPU: (positions, reads)
    lent: list[tuple[list[int], SlotReads]] = attrs.field(factory=list)

    def done(self) -> bool:
        return all(task.done() for _, task in self.tasks)

    def results(self) -> list[KeyResult | None]:
        """Per item; None where no result came (the store was unavailable or timed out)."""
        out: list[KeyResult | None] = [None] * len(self.transfer.items)
        for positions, task in self.tasks:
            if task.done():
                for pos, result in zip(positions, task.wait(0)):
                    out[pos] = result
        return out


class WorkerSide:
    def __init__(
        self,
        layout: ModelLayout,
        stores: ConnectorStores | None,
        num_groups: int,
        sync_loads: bool = False,
        load_timeout_s: float = 10.0,
        staging_bytes: int = 128 << 20,
        report_blocks: bool = False,
    ) -> None:
        self.layout = layout
        # KV events (ucm.vllm.events): the blocks this rank stored or dropped, reported
        # each step
        self.report_blocks = report_blocks
        self.reports = RankReports()
        self.stores = stores
        self.single_group = num_groups == 1
        self.sync_loads = sync_loads
        self.load_timeout_s = load_timeout_s
        self.staging_bytes = staging_bytes
        self.caches: dict[int, list[torch.Tensor]] = {}
        self._nbytes: dict[tuple[int, int], int] = {}
        self.loads: dict[str, LoadJob] = {}
        self.rows = RowPool(staging_bytes)
        self.stager = HostStager()
        self.tracker = DumpTracker()
        self.load_error_blocks: set[int] = set()
        self.delayed: list[str] = []
        self.stats = Counters()
        self._evicted_seen = 0  # the stores' eviction count when last reported
        self.in_place = False  # sync loads read straight into the cache (register_kv_caches)
        # the stores' host memory, registered with the GPU's driver: copies go straight
        # into and out of it (register_kv_caches)
        self.pinned = PinnedRegions()
        self.lending = True  # loads may scatter from blocks the stores lend (_lends)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for group in self.layout.stored_groups:
            missing = [n for n in group.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"UCMConnector: no KV cache registered for layers {missing}")
            self.caches[group.index] = [kv_caches[n] for n in group.layer_names]
        if not self.caches:
            return
        if self.stores is not None:  # a store that cannot hold a block is refused now
            for group in self.layout.stored_groups:
                blocks = (
                    self.layout.hybrid.blocks_per_boundary(group.index)
                    if group.kind == "full"
                    else self.layout.hybrid.tail_blocks[group.index] or 1
                )
                self.stores.check_block_bytes(group, self._row_bytes(group.index, blocks))
        device = next(iter(self.caches.values()))[0].device
        self.stager = HostStager(device)
        self.in_place = (
            self.sync_loads
            and self.single_group
            and device.type == "cpu"
            and self.stores is not None
            and self.stores.full.reads_from_memory
        )
        if device.type == "cuda" and self.stores is not None:
            self._register_host_memory()
        # Touch the rows of a typical load now (full-attention blocks of every group),
        # rather than on the first request.
        full = [g for g in self.layout.stored_groups if g.kind == "full"]
        per_block = {
            g.index: self._row_bytes(g.index, self.layout.hybrid.blocks_per_boundary(g.index))
            for g in full
        }
        if per_block:
            count = self.staging_bytes // sum(per_block.values())
            for nbytes in per_block.values():
                self.rows.reserve(nbytes, count)

    def _register_host_memory(self) -> None:
        """Register the stores' own host memory with the GPU's driver, all or none."""
        assert self.stores is not None
        stores = {id(s): s for s in (self.stores.full, self.stores.window) if s is not None}
        regions = [region for store in stores.values() for region in store.host_memory()]
        if regions:
            self.pinned.register_all(regions)

    def _row_bytes(self, group: int, blocks: int) -> int:
        size = self._nbytes.get((group, blocks))
        if size is None:
            size = self._nbytes[(group, blocks)] = payload_nbytes(self.caches[group], blocks)
        return size

    def _item_bytes(self, item: Item) -> int:
        return self._row_bytes(item.group, len(item.block_ids))

    def _keys(self, items: list[Item]) -> list[bytes]:
        """This rank's store keys of ``items``."""
        rank = self.layout.rank
        return [
            scoped_keys([it.chain_key], self.layout.scope(self._group(it), rank))[0] for it in items
        ]

    # -- loads --

    def start_load_kv(self, meta: StepPlan) -> None:
        if not self.sync_loads:
            for transfer in meta.loads:
                self.loads[transfer.req_id] = self._submit_load(transfer)
            return
        if not meta.loads:
            return
        deadline = time.monotonic() + self.load_timeout_s
        pieces = [p for t in meta.loads for p in self._pieces(t)]
        failed: set[str] = set()  # requests with a failed block: nothing after it is used
        job = self._submit_load(pieces[0])
        for i in range(len(pieces)):
            following = self._submit_load(pieces[i + 1]) if i + 1 < len(pieces) else None
            for _, task in job.tasks:
                try:
                    task.wait(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    task.cancel()
            if not job.done():
                log.warning(
                    "ucm: request %s: the store did not answer in %.1f s (load_timeout_s)",
                    job.transfer.req_id,
                    self.load_timeout_s,
                )
                if job.in_place:
                    self._stop_in_place(job)
                # Reads still in flight may land in these rows later: never reuse them.
                job.rows = []
            usable = job.transfer.req_id not in failed
            if not self._finish_load(job, usable) and usable:
                failed.add(job.transfer.req_id)
            if following is not None:
                job = following

    def _stop_in_place(self, job: LoadJob) -> None:
        """Stop the reads of a late in-place load: they write the engine's blocks, and none
        may land once vLLM has them back.  A store that reads from memory stops at once;
        one whose reads do not stop within ``load_timeout_s`` more is no longer trusted with
        the engine's blocks (the wait is bounded: later loads go through host rows)."""
        until = time.monotonic() + self.load_timeout_s
        stopped = [task.cancel(wait=max(0.0, until - time.monotonic())) for _, task in job.tasks]
        if not all(stopped):
            self.in_place = False
            log.error(
                "ucm: request %s: reads into the engine's blocks did not stop in %.1f s more; "
                "from now on loads go through host rows",
                job.transfer.req_id,
                self.load_timeout_s,
            )

    def _pieces(self, transfer: Transfer) -> list[Transfer]:
        """``transfer`` cut into runs of items of about ``PIECE_BYTES``."""
        pieces: list[Transfer] = []
        size = 0
        for item in transfer.items:
            if not pieces or size >= PIECE_BYTES:
                pieces.append(Transfer(transfer.req_id, []))
                size = 0
            pieces[-1].items.append(item)
            size += self._item_bytes(item)
        return pieces

    def _submit_load(self, transfer: Transfer) -> LoadJob:
        started = time.perf_counter()
        items = transfer.items
        segments = self._segments(items) if self.in_place else None  # sync loads only
        lent = self._open_reads(items) if segments is None and self._lends(items) else None
        rows = [] if segments is not None or lent is not None else self._take_rows(items)
        job = LoadJob(transfer, [], rows, started, in_place=segments is not None)
        if self.stores is None:
            return job
        if lent is not None:
            job.lent = lent
            job.tasks = [(positions, reads.task) for positions, reads in lent]
            return job
        stores = self.stores
        for store, positions in _positions(items, lambda it: stores.of(self._group(it))).items():
            keys = self._keys([items[p] for p in positions])
            buffers: list[object] = (
                row_buffers([rows[p] for p in positions])
                if segments is None
                else deferred_payloads(segments, positions)
            )
            try:
                task = store.load(keys, buffers, LAYOUT_TAG)
            except Exception as exc:  # noqa: BLE001 - a failing store is a miss
                log.warning("ucm: load of request %s failed to start: %s", transfer.req_id, exc)
                continue
            job.tasks.append((positions, task))
        return job

    def _lends(self, items: list[Item]) -> bool:
        """Whether to load ``items`` from blocks the stores lend: on a GPU, where their
        memory is registered; on the CPU, where the scatter from them is not slower than
        from rows (the rule of :meth:`_open_writes`)."""
        if not self.lending:
            return False
        if self.stager.device.type != "cpu":
            return bool(self.pinned)
        if self.stores is None or not self.stores.full.reads_from_memory:
            return False
        return self._in_place_pays(self._item_bytes(items[0]), items)

    def _in_place_pays(self, nbytes: int, items: list[Item]) -> bool:
        """Whether a CPU cache's blocks move between the cache and the store's memory as
        fast as through rows: each a run of the cache's memory, or large
        (:data:`IN_PLACE_MIN_BYTES`)."""
        return nbytes >= IN_PLACE_MIN_BYTES or self._segments(items) is not None

    def _open_reads(self, items: list[Item]) -> list[tuple[list[int], SlotReads]] | None:
        """The stored blocks of ``items`` lent where they lie in the stores' registered
        memory, per store and size; None (nothing lent) unless every store lends them."""
        assert self.stores is not None
        stores = self.stores
        lent: list[tuple[list[int], SlotReads]] = []
        by_store = _positions(items, lambda it: (stores.of(self._group(it)), self._item_bytes(it)))
        for (store, nbytes), positions in by_store.items():
            try:
                reads = store.open_reads(
                    self._keys([items[p] for p in positions]), nbytes, LAYOUT_TAG
                )
            except Exception as exc:  # noqa: BLE001 - the load that follows reports the store
                log.debug("ucm: no blocks lent in place (%s)", exc)
                reads = None
            if reads is None:
                for _, taken in lent:
                    taken.release()
                return None
            lent.append((positions, reads))
        return lent

    def _copy_lent(self, job: LoadJob, results: list[KeyResult | None]) -> list[KeyResult | None]:
        """Scatter the checked blocks the stores lent into the engine's blocks, then give
        them back; ``results`` with a block whose loan ran out first made a failure."""
        items = job.transfer.items
        ok = [p for p, r in enumerate(results) if r is not None and r.ok]
        views = {
            p: view for positions, reads in job.lent for p, view in zip(positions, reads.views)
        }
        try:
            self._scatter(
                [items[p] for p in ok],
                lambda at: self.pinned.rows([views[ok[i]] for i in at]),  # type: ignore[misc]
            )
        except ValueError as exc:  # the plan refused the store's memory (a GPU: not pinned)
            log.warning("ucm: cannot copy out of the store's memory (%s): using rows", exc)
            self.lending = False
            results = [KeyResult(Status.ERROR, str(exc))] * len(items)
        finally:  # every loan ends, whatever happened
            held = [True] * len(items)
            for positions, reads in job.lent:
                for p, kept in zip(positions, reads.release()):
                    held[p] = kept
            job.lent = []
        return [r if held[p] or r is None else _LOAN_ENDED for p, r in enumerate(results)]

    def _segments(self, items: list[Item]) -> BlockSegments | None:
        """The engine blocks of ``items`` as store payloads (one group's, one engine block
        each, none the null block), or None: then they go through host rows."""
        group = items[0].group
        if any(it.group != group for it in items):
            return None
        try:
            segments = block_segments(
                self.caches[group], [it.block_ids for it in items], null_block_id=NULL_BLOCK
            )
        except (TypeError, ValueError) as exc:  # the staged path checks and reports the same
            log.debug("ucm: in-place load not possible (%s)", exc)
            return None
        if segments is None or segments.nbytes != self._item_bytes(items[0]):
            return None
        return segments

    def _take_rows(self, items: list[Item]) -> list[torch.Tensor]:
        rows: list[torch.Tensor | None] = [None] * len(items)
        for nbytes, positions in _positions(items, self._item_bytes).items():
            for pos, row in zip(positions, self.rows.take(nbytes, len(positions))):
                rows[pos] = row
        return rows  # type: ignore[return-value]

    def _finish_load(self, job: LoadJob, usable: bool = True) -> bool:
        """Scatter what can be used; True when every block loaded.

        Full-attention blocks count as a prefix: a key is used only if it and every key
        before it loaded for every group.  Window tails belong to the hit's last boundary:
        they are used only if everything loaded.  ``usable=False``: an earlier piece of the
        request failed, so none of these count.
        """
        items = job.transfer.items
        results = job.results() if usable else [None] * len(items)
        if job.lent:
            results = self._copy_lent(job, results)
        all_ok = all(r is not None and r.ok for r in results)
        full = [p for p, it in enumerate(items) if self._full(it)]
        prefix = verified_prefix([results[p] for p in full], [items[p].key for p in full])
        use = [all_ok or (self._full(it) and it.key < prefix) for it in items]
        if not job.in_place:  # else the blocks are in the cache already
            used = [p for p, u in enumerate(use) if u and p < len(job.rows)]
            self._scatter([items[p] for p in used], lambda at: [job.rows[used[i]] for i in at])
            self.rows.give(job.rows)
        if not all_ok:
            problems = {r.detail or r.status.value for r in results if r and not r.ok} or {
                "store unavailable" if usable else "an earlier block failed"
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
                    self.load_error_blocks.update(b for b in item.block_ids if b != NULL_BLOCK)
        self.stats.add(
            loaded_blocks=use.count(True),
            loaded_bytes=sum(self._item_bytes(it) for it, u in zip(items, use) if u),
            load_seconds=time.perf_counter() - job.started,
        )
        for result, used in zip(results, use):
            if not used:
                self.stats.add_cause("load_errors", _load_error_cause(result, usable))
        if self.report_blocks:  # a corrupt block is dropped from the store by its reader
            self.reports.dropped(
                [dropped_name(it.group, it.chain_key) for it, r in zip(items, results)
                 if r is not None and r.status is Status.CORRUPT]
            )  # fmt: skip
        return all_ok

    def _group(self, item: Item) -> GroupLayout:
        return self.layout.groups[item.group]

    def _full(self, item: Item) -> bool:
        return self._group(item).kind == "full"

    def _scatter(
        self,
        items: list[Item],
        rows_of: Callable[[list[int]], torch.Tensor | list[torch.Tensor]],
    ) -> None:
        """Scatter ``items`` into the cache, one call per group and size, from the host
        rows ``rows_of(positions)`` gives for those positions of ``items``."""
        handles = [
            self.stager.load(
                self.caches[group],
                [items[p].block_ids for p in positions],
                rows_of(positions),
                null_block_id=NULL_BLOCK,
            )
            for (group, _), positions in _positions(items, _shape).items()
        ]
        for handle in handles:
            handle.wait()  # the rows go back (to the pool or the store); the forward pass reads

    # -- dumps --

    def handle_preemptions(self, meta: StepPlan) -> None:
        """Before the forward pass that may reuse the preempted requests' blocks: nothing
        to wait for.  Every dump gathered its blocks into host rows in the step that
        planned it, so the engine may reuse them already; the writes go on, and a resumed
        request that looks its prefix up before they land recomputes what is missing."""

    def wait_for_save(self, meta: StepPlan) -> None:
        self.delayed += meta.delayed
        if self.stores is None:
            return
        for transfer in meta.dumps:
            started = time.perf_counter()
            mine = [it for it in transfer.items if self.layout.writes(self._group(it), it.key)]
            for (group, _), positions in _positions(mine, _shape).items():
                self._dump(transfer.req_id, group, [mine[p] for p in positions])
            self.stats.add(dump_seconds=time.perf_counter() - started)

    def _dump(self, req_id: str, group: int, items: list[Item]) -> None:
        assert self.stores is not None
        store = self.stores.of(self.layout.groups[group])
        nbytes = self._item_bytes(items[0])
        keys = self._keys(items)
        # Gathered now, and waited for: the engine may reuse the blocks once this step ends.
        writes = self._open_writes(store, keys, nbytes, items)
        rows: list[torch.Tensor] = []
        if writes is not None and not self._gather_into(writes, group, items):
            writes = None
        if writes is None:
            rows = self.rows.take(nbytes, len(items))
            self.stager.dump(
                self.caches[group], [it.block_ids for it in items], rows, null_block_id=NULL_BLOCK
            ).wait()
        announced = self.report_blocks and self._full(items[0])  # window tails are not
        names = [dropped_name(it.group, it.chain_key) for it in items] if announced else []
        if announced:
            # watched from before the dump: a batch larger than the room evicts its own
            self.reports.dumping(names)
            store.watch_evictions(keys, names)
        try:
            task = (
                writes.commit()
                if writes is not None
                else store.dump(keys, row_buffers(rows), LAYOUT_TAG)
            )
        except Exception as exc:  # noqa: BLE001 - a failing store never stops serving
            log.warning("ucm: dump for request %s failed: %s", req_id, exc)
            self.stats.add_cause("dump_errors", "unavailable", len(items))
            self.rows.give(rows)
            if announced:
                self.reports.dumped(names, [False] * len(names))
            return
        if rows:
            task.add_done_callback(lambda _task: self.rows.give(rows))
        if announced:
            task.add_done_callback(
                lambda done: self.reports.dumped(
                    names, [r is not None and r.ok for r in done.partial()]
                )
            )
        self.tracker.submit(req_id, task)
        self.stats.add(dumped_bytes=nbytes * len(items))

    def _open_writes(
        self, store: Store, keys: list[bytes], nbytes: int, items: list[Item]
    ) -> SlotWrites | None:
        """Room in the store's own memory for the blocks, where it has some and the copy
        into it is not slower than into rows (on the CPU), or the GPU's driver has it
        registered (a GPU copies asynchronously only into pinned memory); None: they go
        through host rows."""
        if self.stager.device.type == "cpu":
            if not self._in_place_pays(nbytes, items):
                return None
        elif not self.pinned:
            return None
        try:
            return store.open_writes(keys, nbytes, LAYOUT_TAG)
        except Exception as exc:  # noqa: BLE001 - the dump that follows reports the store
            log.debug("ucm: no room to write in place (%s)", exc)
            return None

    def _gather_into(self, writes: SlotWrites, group: int, items: list[Item]) -> bool:
        """Gather the blocks straight into the store's room (one copy, no host row); False
        (the room given back) where the copy refused it: they go through rows."""
        ids = [it.block_ids for it in items]
        try:
            handle = dump_into(
                self.stager, self.pinned, self.caches[group], ids, writes, null_block_id=NULL_BLOCK
            )
        except ValueError as exc:  # the plan refused the room (a GPU: not pinned after all)
            log.warning("ucm: cannot copy into the store's memory (%s): using rows", exc)
            return False
        if handle is not None:
            # a copy that fails to end leaves the room reserved for as long as this process
            # lives: it may still be written, so no other writer may get it
            handle.wait()
        return True

    def take_reports(self) -> list[Report]:
        """What this rank stored or dropped (found corrupt, or evicted) since the last
        call."""
        if self.stores is not None:
            self.reports.dropped(self.stores.take_evicted())  # type: ignore[arg-type]
        return self.reports.take()

    # -- completion --

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        recving, failed = set(), set()
        for req_id in finished_req_ids:
            job = self.loads.pop(req_id, None)
            if job is not None:
                # Aborted while loading: nothing is scattered, so its engine blocks are free
                # to go, and vLLM holds them (and the request) until it is reported.
                self._drop_load(job)
                recving.add(req_id)
        for req_id, job in list(self.loads.items()):
            if not job.done():
                continue
            del self.loads[req_id]
            recving.add(req_id)
            if not self._finish_load(job) and not self.single_group:
                # vLLM takes per-block errors only for single-group models; otherwise the
                # request is recomputed from its local prefix.
                failed.add(req_id)
        counts = self.tracker.counts
        before_ok, before_failed = counts.ok, Counter(counts.failed_by_status)
        self.tracker.reap()
        sending = {r for r in self.delayed if not self.tracker.finish(r)}
        self.delayed = []
        sending |= self.tracker.pop_finished()
        self.stats.add(dumped_blocks=counts.ok - before_ok)
        for status, count in (counts.failed_by_status - before_failed).items():
            self.stats.add_cause("dump_errors", status, count)
        self._count_evictions()
        return sending, recving, failed

    def _count_evictions(self) -> None:
        if self.stores is None:
            return
        evicted = self.stores.evicted_blocks
        self.stats.add(evicted_blocks=evicted - self._evicted_seen)
        self._evicted_seen = evicted

    def _drop_load(self, job: LoadJob) -> None:
        quiet = all([task.cancel() for _, task in job.tasks])  # a list: cancel every task
        for _, reads in job.lent:  # given back once their checks end
            reads.release()
        job.lent = []
        if quiet:
            self.rows.give(job.rows)
        # else reads in flight may still land in these rows: they are never reused

    def take_load_errors(self) -> set[int]:
        errors, self.load_error_blocks = self.load_error_blocks, set()
        # vLLM maps block ids back to requests only for single-group models; the others
        # report failed requests (failed_recving) instead.
        return errors if self.single_group else set()

    def shutdown(self) -> None:
        self.tracker.flush_all(timeout=10.0)
        self.pinned.close()  # before the stores unmap their memory
        if self.stores is not None:
            self.stores.close()


_LOAN_ENDED = KeyResult(Status.ERROR, "the block's loan ran out before it was copied")


def _load_error_cause(result: KeyResult | None, usable: bool) -> str:
    """Why a block was not loaded: the store's answer, none in time (or no store), or an
    earlier block of the request failed (a hit is a prefix)."""
    if result is not None and not result.ok:
        return result.status.value
    return "no_answer" if result is None and usable else "after_failed"


def _shape(item: Item) -> tuple[int, int]:
    """Items of one group and payload size: one kernel call moves them all."""
    return item.group, len(item.block_ids)


def _positions(items: list[Item], key: Callable[[Item], Hashable]) -> dict[Any, list[int]]:
    """Positions of ``items`` by ``key``, in order."""
    out: dict[Any, list[int]] = defaultdict(list)
    for pos, item in enumerate(items):
        out[key(item)].append(pos)
    return out
