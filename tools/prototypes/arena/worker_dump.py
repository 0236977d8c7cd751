"""What a dump costs vLLM's worker with a host dram store: gathered straight into the
store's slots (``Store.open_writes``) against gathered into host rows and dumped.

A CPU cache of 8 layers, 256 store blocks dumped in one step, four rounds, best kept: the
time of the step's call (``wait_for_save``) and the time until the store has published
every block.  Run with the project's venv:

    python worker_dump.py STORE_BLOCK_TOKENS ENGINE_BLOCK_TOKENS

(32 32: each block one engine block, a run of the cache's memory; 32 16: two engine blocks
of a cache with several heads, the kernel's general path; 128 128: 2 MiB blocks.)
"""

import shutil
import sys
import time
import uuid

import torch
from ucm.core.config import DramStoreConfig
from ucm.core.keys import block_keys
from ucm.core.store import SharedMemoryStore
from ucm.vllm.layout import GroupLayout, ModelLayout
from ucm.vllm.stores import ConnectorStores
from ucm.vllm.transfers import Item, StepPlan, Transfer
from ucm.vllm.worker import WorkerSide

STORE_TOKENS, ENGINE_TOKENS = (int(a) for a in sys.argv[1:3])
PER = STORE_TOKENS // ENGINE_TOKENS
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(8)]
GROUP = GroupLayout(index=0, layer_names=tuple(LAYERS), engine_block_tokens=ENGINE_TOKENS,
                    kind="full", replicated=False, descriptor="bench")
LAYOUT = ModelLayout(fingerprint="m", block_tokens=STORE_TOKENS, rank=0, world_size=1,
                     groups=(GROUP,))
ENGINE_BLOCKS = 2048
CACHES = {n: torch.randn(ENGINE_BLOCKS, 2, ENGINE_TOKENS, 8, 64).to(torch.bfloat16)
          for n in LAYERS}


def run(in_place: bool) -> tuple[float, float, int, int]:
    path = f"/dev/shm/ucm-worker-dump-{uuid.uuid4().hex[:8]}"
    store = SharedMemoryStore(DramStoreConfig(path=path, capacity_gb=2))
    worker = WorkerSide(LAYOUT, ConnectorStores(store, None), 1)
    worker.register_kv_caches(CACHES)
    if not in_place:
        store.open_writes = lambda *args, **kwargs: None  # type: ignore[method-assign]
    best_stored = best_call = float("inf")
    try:
        for rnd in range(4):
            chain = block_keys(LAYOUT.chain_namespace(f"{rnd}{in_place}"),
                               list(range(256 * STORE_TOKENS)), STORE_TOKENS)
            count = min(256, (ENGINE_BLOCKS - 1) // PER)
            items = [Item(0, k, chain[k], list(range(1 + PER * k, 1 + PER * (k + 1))))
                     for k in range(count)]
            req = f"r{rnd}"
            t0 = time.perf_counter()
            worker.wait_for_save(StepPlan(dumps=[Transfer(req, items)], delayed=[req]))
            best_call = min(best_call, time.perf_counter() - t0)
            done: set[str] = set()
            while req not in done:
                done |= worker.get_transfer_results(set())[0]
                time.sleep(0.0005)
            best_stored = min(best_stored, time.perf_counter() - t0)
        return best_call, best_stored, worker._item_bytes(items[0]), count
    finally:
        worker.shutdown()
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":  # worker_load.py takes the set-up above
    for _ in range(2):
        for mode in (False, True):
            call, stored, nbytes, count = run(mode)
            print(f"{'in place' if mode else 'rows':>8}: {count} blocks of {nbytes >> 10} KiB: "
                  f"step's call {call * 1e3:.1f} ms, all stored {stored * 1e3:.1f} ms "
                  f"({nbytes * count / stored / 1e9:.2f} GB/s)")
