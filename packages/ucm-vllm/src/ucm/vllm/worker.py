"""The worker side: load store blocks into the paged KV cache, dump computed blocks.

Runs in each vLLM worker process, one per tensor-parallel rank; each rank reads and writes
its own shard under its own keys.  Loads are asynchronous: blocks are read into staging
buffers on the store's threads and scattered into the KV cache from ``get_transfer_results``
(the worker's own thread, between forward passes), after which vLLM schedules the request.
Dumps gather the blocks into staging buffers right after the forward pass that computed
them, so vLLM may reuse the engine blocks at once; the store writes in the background.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import torch
from ucm.core.keys import scoped_keys
from ucm.core.lifecycle import DumpTracker
from ucm.core.store import Store, Task
from ucm.kernels import gather, payload_nbytes, scatter
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.metadata import Transfer, UCMConnectorMetadata
from ucm.vllm.stats import UCMStats

log = logging.getLogger(__name__)
NULL_BLOCK = 0  # vLLM's block pool reserves block 0; it is never read or written here


@attrs.define
class LoadJob:
    transfer: Transfer
    task: Task
    buffers: list[torch.Tensor]  # per stored group: [store blocks, payload bytes]
    started: float


class WorkerSide:
    def __init__(self, layout: ModelLayout, store: Store | None, num_groups: int) -> None:
        self.layout = layout
        self.store = store
        self.single_group = num_groups == 1
        self.caches: dict[int, list[torch.Tensor]] = {}
        self.nbytes: dict[int, int] = {}
        self.loads: dict[str, LoadJob] = {}
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

    def _keys(self, group: GroupLayout, chain: list[bytes]) -> list[bytes]:
        return scoped_keys(chain, self.layout.scope(group, self.layout.rank))

    # -- loads --

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
        for transfer in meta.loads:
            if self.store is None:
                continue
            keys: list[bytes] = []
            views: list[Any] = []
            buffers = []
            for group in self.layout.stored_groups:
                buf = torch.empty(
                    (len(transfer.chain), self.nbytes[group.index]), dtype=torch.uint8
                )
                buffers.append(buf)
                keys += self._keys(group, transfer.chain)
                views += [row.numpy() for row in buf]
            try:
                task = self.store.load(keys, views, self._layout_tag())
            except Exception as exc:  # noqa: BLE001 - a failing store is a miss
                log.warning("ucm: load of request %s failed to start: %s", transfer.req_id, exc)
                task = Task(0)
            self.loads[transfer.req_id] = LoadJob(transfer, task, buffers, time.perf_counter())

    def _layout_tag(self) -> bytes:
        return b"vllm-paged-kv-v1"

    def _finish_load(self, job: LoadJob) -> bool:
        """Scatter the longest verified prefix; True when every block loaded."""
        transfer = job.transfer
        n = len(transfer.chain)
        results = job.task.wait(0) if len(job.task) else []
        groups = self.layout.stored_groups
        ok = [
            bool(results) and all(results[g * n + s].ok for g in range(len(groups)))
            for s in range(n)
        ]
        good = next((s for s, fine in enumerate(ok) if not fine), n)
        for i, group in enumerate(groups):
            if good:
                scatter(
                    self.caches[group.index],
                    transfer.block_ids[i][:good],
                    job.buffers[i][:good],
                    null_block_id=NULL_BLOCK,
                )
        if good < n:
            problems = {r.detail or r.status.value for r in results if not r.ok} or {
                "store unavailable"
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
                if not self.layout.writes(group):
                    continue
                buf = torch.empty(
                    (len(transfer.chain), self.nbytes[group.index]), dtype=torch.uint8
                )
                gather(
                    self.caches[group.index], transfer.block_ids[i], buf, null_block_id=NULL_BLOCK
                )
                try:
                    task = self.store.dump(
                        self._keys(group, transfer.chain),
                        [row.numpy() for row in buf],
                        self._layout_tag(),
                    )
                except Exception as exc:  # noqa: BLE001 - a failing store never stops serving
                    log.warning("ucm: dump for request %s failed: %s", transfer.req_id, exc)
                    self.stats.add(dump_errors=len(transfer.chain))
                    continue
                self.tracker.submit(transfer.req_id, task)
                self.stats.add(dumped_bytes=buf.numel())
            self.stats.add(dump_seconds=time.perf_counter() - started)

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
