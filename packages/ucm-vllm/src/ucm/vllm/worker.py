"""The worker side: load store blocks into the paged KV cache, dump computed blocks.

Runs in each vLLM worker process, one per tensor-parallel rank; each rank reads and writes
its own shard under its own keys.

Loads are synchronous or asynchronous (``load_mode``).  A sync load runs in
``start_load_kv``, before the forward pass of the step that scheduled the request: every
block is read into one reused staging buffer, the verified prefix is scattered into the KV
cache, and blocks that failed go to ``get_block_ids_with_load_errors`` so that vLLM discards
the step's output for the request and recomputes from the first bad block.  An async load
reads on the store's threads and is scattered from ``get_transfer_results`` (between
forward passes), after which vLLM schedules the request.

Dumps gather the blocks into staging buffers right after the forward pass that computed
them, so vLLM may reuse the engine blocks at once; the store writes in the background.
"""

from __future__ import annotations

import logging
import time

import attrs
import torch
from ucm.core.keys import scoped_keys
from ucm.core.lifecycle import DumpTracker
from ucm.core.store import Store, Task
from ucm.kernels import HostStager, payload_nbytes
from ucm.vllm.buffers import RowPool
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.metadata import Transfer, UCMConnectorMetadata
from ucm.vllm.stats import UCMStats

log = logging.getLogger(__name__)
NULL_BLOCK = 0  # vLLM's block pool reserves block 0; it is never read or written here
LAYOUT_TAG = b"vllm-paged-kv-v1"  # in every block's header: what the payload's bytes are


@attrs.define
class LoadJob:
    transfer: Transfer
    task: Task
    rows: list[list[torch.Tensor]]  # per stored group: one host row per store block
    started: float


# Sync loads are read and scattered in pieces of about this size, so that the reads of one
# piece overlap the scatter of the previous one.
PIECE_BYTES = 16 << 20


class WorkerSide:
    def __init__(
        self,
        layout: ModelLayout,
        store: Store | None,
        num_groups: int,
        sync_loads: bool = False,
        load_timeout_s: float = 10.0,
        staging_bytes: int = 128 << 20,
    ) -> None:
        self.layout = layout
        self.store = store
        self.single_group = num_groups == 1
        self.sync_loads = sync_loads
        self.load_timeout_s = load_timeout_s
        self.staging_bytes = staging_bytes
        self.caches: dict[int, list[torch.Tensor]] = {}
        self.nbytes: dict[int, int] = {}
        self.loads: dict[str, LoadJob] = {}
        self.rows = RowPool(staging_bytes)
        self.stager = HostStager()
        self.tracker = DumpTracker()
        self.load_error_blocks: set[int] = set()
        self.delayed: list[str] = []
        self.stats = UCMStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for group in self.layout.stored_groups:
            missing = [n for n in group.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"UCMConnector: no KV cache registered for layers {missing}")
            caches = [kv_caches[n] for n in group.layer_names]
            self.caches[group.index] = caches
            k = group.blocks_per_store_block(self.layout.block_tokens)
            self.nbytes[group.index] = payload_nbytes(caches, k)
        if self.caches:
            self.stager = HostStager(next(iter(self.caches.values()))[0].device)
            unit = sum(self.nbytes.values())
            for group in self.layout.stored_groups:
                self.rows.reserve(self.nbytes[group.index], self.staging_bytes // unit)

    def _keys(self, group: GroupLayout, chain: list[bytes]) -> list[bytes]:
        return scoped_keys(chain, self.layout.scope(group, self.layout.rank))

    # -- loads --

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
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
            try:
                job.task.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                job.task.cancel()
                log.warning(
                    "ucm: request %s: the store did not answer in %.1f s (load_timeout_s)",
                    job.transfer.req_id,
                    self.load_timeout_s,
                )
                # Reads still in flight may land in these rows later: never reuse them.
                job = LoadJob(job.transfer, Task(0), [], job.started)
            usable = job.transfer.req_id not in failed
            if not self._finish_load(job, usable) and usable:
                failed.add(job.transfer.req_id)
            if following is not None:
                job = following

    def _pieces(self, transfer: Transfer) -> list[Transfer]:
        """``transfer`` cut into runs of store blocks of about ``PIECE_BYTES``."""
        n = len(transfer.chain)
        step = max(1, PIECE_BYTES // max(1, sum(self.nbytes.values())))
        if n <= step:
            return [transfer]
        return [
            Transfer(
                transfer.req_id,
                transfer.first + a,
                transfer.chain[a : a + step],
                [ids[a : a + step] for ids in transfer.block_ids],
            )
            for a in range(0, n, step)
        ]

    def _submit_load(self, transfer: Transfer) -> LoadJob:
        n = len(transfer.chain)
        started = time.perf_counter()
        rows = [self.rows.take(self.nbytes[g.index], n) for g in self.layout.stored_groups]
        if self.store is None:
            return LoadJob(transfer, Task(0), rows, started)
        keys = [k for g in self.layout.stored_groups for k in self._keys(g, transfer.chain)]
        views = [row.numpy() for group_rows in rows for row in group_rows]
        try:
            task = self.store.load(keys, views, LAYOUT_TAG)
        except Exception as exc:  # noqa: BLE001 - a failing store is a miss
            log.warning("ucm: load of request %s failed to start: %s", transfer.req_id, exc)
            task = Task(0)
        return LoadJob(transfer, task, rows, started)

    def _finish_load(self, job: LoadJob, usable: bool = True) -> bool:
        """Scatter the longest verified prefix; True when every block loaded.

        ``usable=False``: an earlier block of the request failed, so none of these count.
        """
        transfer = job.transfer
        n = len(transfer.chain)
        results = job.task.wait(0) if len(job.task) and usable else []
        groups = self.layout.stored_groups
        ok = [
            bool(results) and all(results[g * n + s].ok for g in range(len(groups)))
            for s in range(n)
        ]
        good = next((s for s, fine in enumerate(ok) if not fine), n)
        if good:
            handles = [
                self.stager.load(
                    self.caches[group.index],
                    transfer.block_ids[i][:good],
                    job.rows[i][:good],
                    null_block_id=NULL_BLOCK,
                )
                for i, group in enumerate(groups)
            ]
            for handle in handles:
                handle.wait()  # the rows go back to the pool, and the forward pass reads
        for group_rows in job.rows:
            self.rows.give(group_rows)
        if good < n:
            problems = {r.detail or r.status.value for r in results if not r.ok} or {
                "store unavailable" if usable else "an earlier block failed"
            }
            log.warning(
                "ucm: request %s: %d of %d blocks failed to load, vLLM recomputes them (%s)",
                transfer.req_id,
                n - good,
                n,
                "; ".join(sorted(problems)),
            )
            for i in range(len(groups)):
                for ids in transfer.block_ids[i][good:]:
                    self.load_error_blocks.update(b for b in ids if b != NULL_BLOCK)
        nbytes = sum(self.nbytes[g.index] for g in groups)
        self.stats.add(
            loaded_blocks=good * len(groups),
            loaded_bytes=good * nbytes,
            load_errors=(n - good) * len(groups),
            load_seconds=time.perf_counter() - job.started,
        )
        return good == n

    # -- dumps --

    def handle_preemptions(self, meta: UCMConnectorMetadata) -> None:
        """Before the forward pass that may reuse the preempted requests' blocks."""
        if meta.preempted:
            # Gathers copy synchronously, so the engine blocks are free to reuse already;
            # waiting the writes lets the resumed request find its prefix in the store.
            self.tracker.flush(meta.preempted, timeout=10.0)

    def wait_for_save(self, meta: UCMConnectorMetadata) -> None:
        self.delayed += meta.delayed
        if self.store is None:
            return
        for transfer in meta.dumps:
            started = time.perf_counter()
            for i, group in enumerate(self.layout.stored_groups):
                if self.layout.writes(group):
                    self._dump(transfer, i, group)
            self.stats.add(dump_seconds=time.perf_counter() - started)

    def _dump(self, transfer: Transfer, i: int, group: GroupLayout) -> None:
        assert self.store is not None
        rows = self.rows.take(self.nbytes[group.index], len(transfer.chain))
        # Waited here: the engine may reuse the blocks once this step ends.
        self.stager.dump(
            self.caches[group.index], transfer.block_ids[i], rows, null_block_id=NULL_BLOCK
        ).wait()
        try:
            task = self.store.dump(
                self._keys(group, transfer.chain), [r.numpy() for r in rows], LAYOUT_TAG
            )
        except Exception as exc:  # noqa: BLE001 - a failing store never stops serving
            log.warning("ucm: dump for request %s failed: %s", transfer.req_id, exc)
            self.stats.add(dump_errors=len(transfer.chain))
            self.rows.give(rows)
            return
        task.add_done_callback(lambda _task: self.rows.give(rows))
        self.tracker.submit(transfer.req_id, task)
        self.stats.add(dumped_bytes=sum(r.numel() for r in rows))

    # -- completion --

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        for req_id in finished_req_ids:
            job = self.loads.pop(req_id, None)  # aborted while loading: never scatter
            if job is not None:
                job.task.cancel()
        recving, failed = set(), set()
        for req_id, job in list(self.loads.items()):
            if not job.task.done():
                continue
            del self.loads[req_id]
            recving.add(req_id)
            if not self._finish_load(job) and not self.single_group:
                # vLLM takes per-block errors only for single-group models; otherwise the
                # request is recomputed from its local prefix.
                failed.add(req_id)
        before_ok, before_failed = self.tracker.counts.ok, self.tracker.counts.failed
        self.tracker.reap()
        sending = {r for r in self.delayed if not self.tracker.finish(r)}
        self.delayed = []
        sending |= self.tracker.pop_finished()
        self.stats.add(
            dumped_blocks=self.tracker.counts.ok - before_ok,
            dump_errors=self.tracker.counts.failed - before_failed,
        )
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        errors, self.load_error_blocks = self.load_error_blocks, set()
        return errors

    def shutdown(self) -> None:
        self.tracker.flush_all(timeout=10.0)
        if self.store is not None:
            self.store.close()
