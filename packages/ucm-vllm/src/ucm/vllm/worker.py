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

The copies and the choice of route (in place, the store's memory, host rows) are the
mover's (:mod:`ucm.kernels.mover`), shared with FastDeploy's backend: this side turns vLLM's
step plan into the mover's batches and applies vLLM's rules (which loaded blocks count for a
request of several groups, what vLLM is told of failures, the reports and counters).

Dumps gather the blocks into host rows right after the forward pass that computed them, so
vLLM may reuse the engine blocks at once; the store writes in the background.  Where the
store keeps its blocks in this host's memory (``Store.open_writes``: the dram store) and the
cache is on the CPU, the blocks are gathered straight into the store's slots instead, and
the store only seals and publishes them: one copy, no host row.

On a GPU the same store's memory is registered with the CUDA driver at start-up, so that
its DMA engine copies straight into it: dumps gather into the store's slots, and loads
scatter from blocks the store lends where they lie (``Store.open_reads``), checked on its
threads first.  Where the driver refuses the registration, both go through pinned host
rows.

This side imports no vLLM: it works on the step's plan (:mod:`ucm.vllm.plan`) and
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
from ucm.core import DumpTracker, KeyResult, Status, Store, scoped_keys, verified_prefix
from ucm.kernels.mover import Batch, Caches, Mover, MoverSettings, Read, Route
from ucm.vllm.counters import Counters
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.plan import NULL_BLOCK, Item, Report, StepPlan, Transfer
from ucm.vllm.reports import RankReports, dropped_name
from ucm.vllm.stores import ConnectorStores

log = logging.getLogger(__name__)
LAYOUT_TAG = b"vllm-paged-kv-v1"  # in every block's header: what the payload's bytes are


@attrs.define
class LoadJob:
    transfer: Transfer
    # the mover's reads, one a store and payload size: (positions in transfer.items, read)
    batches: list[tuple[list[int], Read]]
    started: float

    def done(self) -> bool:
        return all(read.done() for _, read in self.batches)


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
        zero_copy: bool = True,
        piece_bytes: int = 16 << 20,
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
        self.caches: dict[int, Caches] = {}
        self._nbytes: dict[tuple[int, int], int] = {}
        self.loads: dict[str, LoadJob] = {}
        # sync loads are read and scattered in pieces of about ``piece_bytes``, so that the
        # reads of one piece overlap the scatter of the previous one
        self.piece_bytes = piece_bytes
        self.mover = Mover(
            MoverSettings(
                zero_copy=zero_copy,
                step_bytes=piece_bytes,
                grace_s=load_timeout_s,
                staging_bytes=staging_bytes,
            )
        )
        self.tracker = DumpTracker()
        self.load_error_blocks: set[int] = set()
        self.delayed: list[str] = []
        self.stats = Counters()
        self._evicted_seen = 0  # the stores' eviction count when last reported
        # sync loads read straight into the cache (register_kv_caches): the store then
        # writes the engine's blocks, so only one whose reads stop at once when cancelled
        self.in_place = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for group in self.layout.stored_groups:
            missing = [n for n in group.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"UCMConnector: no KV cache registered for layers {missing}")
            tensors = tuple(kv_caches[n] for n in group.layer_names)
            self.caches[group.index] = Caches(tensors, null_block=NULL_BLOCK)
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
        device = next(iter(self.caches.values())).device
        self.in_place = (
            self.sync_loads
            and self.single_group
            and device.type == "cpu"
            and self.stores is not None
            and self.stores.full.reads_from_memory
        )
        if device.type == "cuda" and self.stores is not None:
            # the stores' host memory, registered with the GPU's driver at start-up rather
            # than on the first request: copies go straight into and out of it
            for store in (self.stores.full, self.stores.window):
                if store is not None:
                    self.mover.register(store)
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
                self.mover.pool.reserve(nbytes, count)

    def _row_bytes(self, group: int, blocks: int) -> int:
        size = self._nbytes.get((group, blocks))
        if size is None:
            size = self._nbytes[(group, blocks)] = self.caches[group].payload_nbytes(blocks)
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
            for _, read in job.batches:
                if read.task is not None:
                    try:
                        read.task.wait(max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        pass
            if not job.done():
                log.warning(
                    "ucm: request %s: the store did not answer in %.1f s (load_timeout_s)",
                    job.transfer.req_id,
                    self.load_timeout_s,
                )
                self._stop_late(job)
            usable = job.transfer.req_id not in failed
            if not self._finish_load(job, usable) and usable:
                failed.add(job.transfer.req_id)
            if following is not None:
                job = following

    def _stop_late(self, job: LoadJob) -> None:
        """Stop the reads of a late load.  Reads into rows or out of lent blocks are left
        (the rows go back once the store lets go of them); reads into the engine's blocks
        are waited for, since none may land once vLLM has the blocks back: a store that
        reads from memory stops at once, and one whose reads do not stop within
        ``load_timeout_s`` more is no longer trusted with them (later loads go through
        rows)."""
        for _, read in job.batches:
            if read.done():
                continue
            in_place = read.route is Route.IN_PLACE
            quiet = self.mover.stop_read(read, self.load_timeout_s if in_place else 0.0)
            if not quiet and in_place and self.in_place:
                self.in_place = False
                log.error(
                    "ucm: request %s: reads into the engine's blocks did not stop in "
                    "%.1f s more; from now on loads go through host rows",
                    job.transfer.req_id,
                    self.load_timeout_s,
                )

    def _pieces(self, transfer: Transfer) -> list[Transfer]:
        """``transfer`` cut into runs of items of about ``piece_bytes``."""
        pieces: list[Transfer] = []
        size = 0
        for item in transfer.items:
            if not pieces or size >= self.piece_bytes:
                pieces.append(Transfer(transfer.req_id, []))
                size = 0
            pieces[-1].items.append(item)
            size += self._item_bytes(item)
        return pieces

    def _submit_load(self, transfer: Transfer) -> LoadJob:
        """The mover's reads of ``transfer``, one a store and payload size."""
        job = LoadJob(transfer, [], time.perf_counter())
        if self.stores is None:
            return job
        items = transfer.items
        stores = self.stores
        batches = _positions(items, lambda it: (stores.of(self._group(it)), _shape(it)))
        for (store, (group, _)), positions in batches.items():
            batch = self._batch(store, group, [items[p] for p in positions])
            job.batches.append((positions, self.mover.start_read(batch, cache_lent=self.in_place)))
        return job

    def _finish_load(self, job: LoadJob, usable: bool = True) -> bool:
        """Scatter what can be used; True when every block loaded.

        Full-attention blocks count as a prefix: a key is used only if it and every key
        before it loaded for every group.  Window tails belong to the hit's last boundary:
        they are used only if everything loaded.  ``usable=False``: an earlier piece of the
        request failed, so none of these count.
        """
        items = job.transfer.items
        results: list[KeyResult | None] = [None] * len(items)
        for positions, read in job.batches:
            if not usable:  # an earlier piece failed: nothing is copied, loans and rows end
                self.mover.stop_read(read, 0.0)
                continue
            for p, result in zip(positions, self.mover.settle_read(read)):  # lent: copied out
                results[p] = result
        all_ok = all(r is not None and r.ok for r in results)
        full = [p for p, it in enumerate(items) if self._full(it)]
        prefix = verified_prefix([results[p] for p in full], [items[p].key for p in full])
        use = [all_ok or (self._full(it) and it.key < prefix) for it in items]
        for positions, read in job.batches:  # from our rows; the rows go back
            self.mover.complete_read(read, [use[p] for p in positions])
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

    def _batch(
        self, store: Store, group: int, items: list[Item], keys: list[bytes] | None = None
    ) -> Batch:
        """``items`` (of one group and size) as the mover's batch."""
        return Batch(
            self.caches[group],
            [it.block_ids for it in items],
            self._keys(items) if keys is None else keys,
            store,
            LAYOUT_TAG,
            self._item_bytes(items[0]),
        )

    def _group(self, item: Item) -> GroupLayout:
        return self.layout.groups[item.group]

    def _full(self, item: Item) -> bool:
        return self._group(item).kind == "full"

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
        announced = self.report_blocks and self._full(items[0])  # window tails are not
        names = [dropped_name(it.group, it.chain_key) for it in items] if announced else []
        if announced:
            # watched from before the dump: a batch larger than the room evicts its own
            self.reports.dumping(names)
            store.watch_evictions(keys, names)
        try:
            # gathered now, and waited for: the engine may reuse the blocks once this step
            # ends; the store writes behind
            task = self.mover.dump(self._batch(store, group, items, keys))
        except Exception as exc:  # noqa: BLE001 - a failing store never stops serving
            log.warning("ucm: dump for request %s failed: %s", req_id, exc)
            self.stats.add_cause("dump_errors", "unavailable", len(items))
            if announced:
                self.reports.dumped(names, [False] * len(names))
            return
        if announced:
            task.add_done_callback(
                lambda done: self.reports.dumped(
                    names, [r is not None and r.ok for r in done.partial()]
                )
            )
        self.tracker.submit(req_id, task)
        self.stats.add(dumped_bytes=nbytes * len(items))

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
        """An aborted request's load: stopped, nothing scattered; its rows go back once the
        store lets go of them, its loans once their checks end."""
        for _, read in job.batches:
            self.mover.stop_read(read, 0.0)

    def take_load_errors(self) -> set[int]:
        errors, self.load_error_blocks = self.load_error_blocks, set()
        # vLLM maps block ids back to requests only for single-group models; the others
        # report failed requests (failed_recving) instead.
        return errors if self.single_group else set()

    def shutdown(self) -> None:
        self.tracker.flush_all(timeout=10.0)
        self.mover.close()  # before the stores unmap their memory
        if self.stores is not None:
            self.stores.close()


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
