"""What an asynchronous load costs vLLM's worker with a host dram store on a CPU cache:
from blocks the store lends where they lie (``Store.open_reads``: checked on the store's
threads, then scattered into the cache) against read into host rows and scattered.

8 layers, 256 store blocks loaded in one step, four rounds, best kept: the time from
``start_load_kv`` until ``get_transfer_results`` reports the request.  Run with the
project's venv:

    python worker_load.py STORE_BLOCK_TOKENS ENGINE_BLOCK_TOKENS   (from this folder)

(32 32: each block one engine block; 32 16: two engine blocks of a cache with several
heads; 128 128: 2 MiB blocks.)
"""

import shutil
import time
import uuid

from ucm.core.config import DramStoreConfig
from ucm.core.keys import block_keys
from ucm.core.store import SharedMemoryStore
from ucm.vllm.stores import ConnectorStores
from ucm.vllm.transfers import Item, StepPlan, Transfer
from ucm.vllm.worker import WorkerSide
from worker_dump import CACHES, ENGINE_BLOCKS, LAYOUT, PER, STORE_TOKENS  # the same set-up


def run(lent: bool) -> tuple[float, int, int]:
    path = f"/dev/shm/ucm-worker-load-{uuid.uuid4().hex[:8]}"
    store = SharedMemoryStore(DramStoreConfig(path=path, capacity_gb=2))
    worker = WorkerSide(LAYOUT, ConnectorStores(store, None), 1)
    worker.register_kv_caches(CACHES)
    if not lent:
        worker._lends = lambda items: False  # type: ignore[method-assign]
    chain = block_keys(LAYOUT.chain_namespace("load"), list(range(256 * STORE_TOKENS)),
                       STORE_TOKENS)
    count = min(256, (ENGINE_BLOCKS - 1) // PER)
    items = [Item(0, k, chain[k], list(range(1 + PER * k, 1 + PER * (k + 1))))
             for k in range(count)]
    best = float("inf")
    try:
        worker.wait_for_save(StepPlan(dumps=[Transfer("cold", items)]))
        worker.tracker.flush_all(timeout=60)
        for rnd in range(4):
            req = f"r{rnd}"
            t0 = time.perf_counter()
            worker.start_load_kv(StepPlan(loads=[Transfer(req, items)]))
            done: set[str] = set()
            while req not in done:
                done |= worker.get_transfer_results(set())[1]
                time.sleep(0.0005)
            best = min(best, time.perf_counter() - t0)
            assert not worker.take_load_errors()
        return best, worker._item_bytes(items[0]), count
    finally:
        worker.shutdown()
        shutil.rmtree(path, ignore_errors=True)


for _ in range(2):
    for mode in (False, True):
        took, nbytes, count = run(mode)
        print(f"{'lent' if mode else 'rows':>5}: {count} blocks of {nbytes >> 10} KiB: "
              f"loaded in {took * 1e3:.1f} ms ({nbytes * count / took / 1e9:.2f} GB/s)")
