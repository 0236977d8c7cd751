"""The worker side: load stored blocks into the paged KV cache, dump computed blocks.

Runs in each vLLM worker process, one per tensor-parallel rank; each rank reads and writes
its own shard under its own keys.  Loads are :mod:`ucm.vllm.loads`'; this side registers
the caches, dumps, and reports what finished.

Dumps gather the blocks into host rows right after the forward pass that computed them, so
vLLM may reuse the engine blocks at once; the store writes in the background.  Where the
store keeps its blocks in this host's memory (``Store.open_writes``: the dram store) and the
cache is on the CPU, the blocks are gathered straight into the store's slots instead, and
the store only seals and publishes them: one copy, no host row.

On a GPU the same store's memory is registered with the CUDA driver at start-up, so that
its DMA engine copies straight into it: dumps gather into the store's slots, and loads
scatter from blocks the store lends where they lie (``Store.open_reads``), checked on its
threads first.  Where the driver refuses the registration, both go through pinned host
rows.  The copies and the choice of route (in place, the store's memory, host rows) are the
mover's (:mod:`ucm.kernels.mover`), shared with FastDeploy's backend.

This side imports no vLLM: it works on the step's plan (:mod:`ucm.vllm.plan`) and
torch tensors, so its data path runs wherever torch does (a GPU machine without vLLM).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import torch
from ucm.core import DumpTracker, Store, Task
from ucm.kernels.mover import Mover, MoverSettings
from ucm.vllm.blocks import RankBlocks, positions, shape
from ucm.vllm.counters import Counters
from ucm.vllm.layout import ModelLayout
from ucm.vllm.loads import Loads
from ucm.vllm.plan import Item, Report, StepPlan
from ucm.vllm.reports import RankReports, dropped_name
from ucm.vllm.stores import ConnectorStores

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self,
        layout: ModelLayout,
        stores: ConnectorStores | None,
        num_groups: int,
        sync_loads: bool = False,
        load_timeout_s: float = 10.0,
        layer_wise: bool = True,
        staging_bytes: int = 128 << 20,
        report_blocks: bool = False,
        zero_copy: bool = True,
        digests_on_gpu: bool = True,
        piece_bytes: int = 16 << 20,
        pipeline_depth: int = 2,
        cancel_grace_s: float = 2.0,
        remember_stored: bool = False,
    ) -> None:
        self.layout = layout
        self.stores = stores
        self.mover = Mover(
            MoverSettings(
                zero_copy=zero_copy,
                device_digests=None if digests_on_gpu else False,
                step_bytes=piece_bytes,
                depth=pipeline_depth,
                grace_s=cancel_grace_s,
                staging_bytes=staging_bytes,
            )
        )
        self.blocks = RankBlocks(layout)
        self.stats = Counters()
        # KV events (ucm.vllm.events): the blocks this rank stored or dropped, reported
        # each step
        self.reports = RankReports() if report_blocks else None
        self.loads = Loads(
            self.blocks,
            stores,
            self.mover,
            self.stats,
            self.reports,
            sync=sync_loads,
            single_group=num_groups == 1,
            timeout_s=load_timeout_s,
            layer_wise=layer_wise,
        )
        self.tracker = DumpTracker()
        self.delayed: list[str] = []
        self._evicted_seen = 0  # the stores' eviction count when last reported
        # on_reset "remove": the keys this rank stored since it started or last reset, by
        # store (the dumps still writing them are the tracker's)
        self.remembers_stored = remember_stored
        self.stored: dict[int, tuple[Store, list[bytes]]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.blocks.add_caches(kv_caches)
        if not self.blocks.caches:
            return
        if self.stores is not None:  # a store that cannot hold a block is refused now
            for group in self.layout.stored_groups:
                self.stores.check_block_bytes(group, self.blocks.stored_bytes(group))
        self.loads.on_caches()
        if self.blocks.device.type == "cuda" and self.stores is not None:
            # the stores' host memory, registered with the GPU's driver at start-up rather
            # than on the first request: copies go straight into and out of it
            for store in (self.stores.full, self.stores.window):
                if store is not None:
                    self.mover.register(store)
        # Touch the rows of a typical load now (full-attention blocks of every group),
        # rather than on the first request.
        per_block = [self.blocks.stored_bytes(g) for g in self.layout.stored_groups
                     if g.kind == "full"]  # fmt: skip
        if per_block:
            count = self.mover.settings.staging_bytes // sum(per_block)
            for nbytes in per_block:
                self.mover.pool.reserve(nbytes, count)

    def start_load_kv(self, meta: StepPlan) -> None:
        if meta.reset:
            self._reset(meta)
        self.loads.start(meta.loads)

    def wait_layer(self, layer_name: str) -> None:
        """The forward pass is about to read ``layer_name``'s KV."""
        self.loads.wait_layer(layer_name)

    def _reset(self, meta: StepPlan) -> None:
        """vLLM reset its prefix cache with ours since the last step: loads planned before
        fail; with ``on_reset: remove``, what this rank stored since it started (or last
        reset) is removed from its stores, on a thread of its own once those dumps end."""
        self.loads.fail(meta.reset_loads)
        if meta.reset != "remove" or self.stores is None:
            return
        stored, self.stored = self.stored, {}
        if stored:
            tasks = self.tracker.in_flight()
            threading.Thread(
                target=_remove_after, args=(stored, tasks), name="ucm-reset-remove", daemon=True
            ).start()

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
            mine = [
                it for it in transfer.items if self.layout.writes(self.blocks.group(it), it.key)
            ]
            for (group, _), where in positions(mine, shape).items():
                self._dump(transfer.req_id, group, [mine[p] for p in where])
            self.stats.add(dump_seconds=time.perf_counter() - started)

    def _dump(self, req_id: str, group: int, items: list[Item]) -> None:
        assert self.stores is not None
        store = self.stores.of(self.layout.groups[group])
        keys = self.blocks.keys(items)
        reports = self.reports if self.blocks.full(items[0]) else None  # tails are not
        names = [dropped_name(it.group, it.chain_key) for it in items] if reports else []
        if reports is not None:
            # watched from before the dump: a batch larger than the room evicts its own
            reports.dumping(names)
            store.watch_evictions(keys, names)
        try:
            # gathered now, and waited for: the engine may reuse the blocks once this step
            # ends; the store writes behind
            task = self.mover.dump(self.blocks.batch(store, group, items, keys))
        except Exception as exc:  # noqa: BLE001 - a failing store never stops serving
            log.warning("ucm: dump for request %s failed: %s", req_id, exc)
            self.stats.add_cause("dump_errors", "unavailable", len(items))
            if reports is not None:
                reports.dumped(names, [False] * len(names))
            return
        if reports is not None:
            task.add_done_callback(
                lambda done: reports.dumped(names, [r is not None and r.ok for r in done.partial()])
            )
        self.tracker.submit(req_id, task)
        self.stats.add(dumped_bytes=self.blocks.item_bytes(items[0]) * len(items))
        if self.remembers_stored:
            self.stored.setdefault(id(store), (store, []))[1].extend(keys)

    def take_reports(self) -> list[Report]:
        """What this rank stored or dropped (found corrupt, or evicted) since the last
        call."""
        if self.reports is None:
            return []
        if self.stores is not None:
            self.reports.dropped(self.stores.take_evicted())  # type: ignore[arg-type]
        return self.reports.take()

    # -- completion --

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        recving, failed = self.loads.finished(finished_req_ids)
        counts = self.tracker.counts
        before_ok, before_failed = counts.ok, Counter(counts.failed_by_status)
        self.tracker.reap()
        sending = {r for r in self.delayed if not self.tracker.finish(r)}
        self.delayed = []
        sending |= self.tracker.pop_finished()
        self.stats.add(dumped_blocks=counts.ok - before_ok)
        for status, count in (counts.failed_by_status - before_failed).items():
            self.stats.add_cause("dump_errors", status, count)
        if self.stores is not None:
            evicted = self.stores.evicted_blocks
            self.stats.add(evicted_blocks=evicted - self._evicted_seen)
            self._evicted_seen = evicted
        return sending, recving, failed

    def release_caches(self) -> None:
        """vLLM is about to free or offload the KV cache (sleep): no load in flight may
        scatter into it any more (they fail; vLLM recomputes them).  Dumps gathered their
        blocks in the step that planned them, so none reads the cache after."""
        self.loads.stop_pending("reset")
        self.loads.fail(None)

    def take_load_errors(self) -> set[int]:
        """The engine blocks that failed to load since the last call: asked once the
        step's forward pass ended, which settles the step's layered loads."""
        self.loads.end_step()
        return self.loads.take_errors()

    def shutdown(self) -> None:
        self.loads.stop_pending("reset")
        self.tracker.flush_all(timeout=10.0)
        self.mover.close()  # before the stores unmap their memory
        if self.stores is not None:
            self.stores.close()


#: how long removing what a rank stored before a reset waits for those dumps to end
REMOVE_WAIT_S = 60.0


def _remove_after(stored: dict[int, tuple[Store, list[bytes]]], tasks: list[Task]) -> None:
    """Remove ``stored`` once ``tasks`` (the dumps writing it) end, or after
    ``REMOVE_WAIT_S``; a store that fails is logged, never raised."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    for task in tasks:
        try:
            task.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a dump that failed or is late: remove anyway
            pass
    for store, keys in stored.values():
        try:
            removed = store.remove(keys)
            log.info("ucm: reset: removed %d blocks this rank stored", removed)
        except Exception as exc:  # noqa: BLE001 - a failing store never stops serving
            log.warning("ucm: reset: removing %d blocks failed: %s", len(keys), exc)
