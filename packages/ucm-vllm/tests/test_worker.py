"""The worker side of UCMConnector on real torch caches and a real posix store, without an
engine: what it does with the metadata the scheduler side sends."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from ucm.core.config import PosixStoreConfig  # noqa: E402
from ucm.core.keys import block_keys  # noqa: E402
from ucm.core.store import PosixStore, Task  # noqa: E402
from ucm.vllm.layout import GroupLayout, ModelLayout  # noqa: E402
from ucm.vllm.metadata import Item, Transfer, UCMConnectorMetadata  # noqa: E402
from ucm.vllm.stores import ConnectorStores  # noqa: E402
from ucm.vllm.worker import WorkerSide  # noqa: E402

LAYER = "model.layers.0.self_attn.attn"
GROUP = GroupLayout(
    index=0,
    layer_names=(LAYER,),
    engine_block_tokens=32,
    kind="full",
    replicated=False,
    descriptor="test",
)
LAYOUT = ModelLayout(fingerprint="m", block_tokens=256, rank=0, world_size=1, groups=(GROUP,))


class GatedStore:
    """A posix store whose dumps start only once ``gate`` is set (a slow or stalled store)."""

    def __init__(self, inner: PosixStore, gate: threading.Event) -> None:
        self.inner = inner
        self.gate = gate
        self.read_only = False

    def dump(self, keys, buffers, layout=b""):
        task = Task(len(keys))

        def dump_one(key, buffer):
            return self.inner.wait(self.inner.dump([key], [buffer], layout))[0]

        def run() -> None:
            self.gate.wait()
            for i, (key, buffer) in enumerate(zip(keys, buffers)):
                # a key of a cancelled task is not dumped: it finishes CANCELLED
                task.run_key(i, lambda k=key, b=buffer: dump_one(k, b))

        threading.Thread(target=run, daemon=True).start()
        return task

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_preemption_does_not_wait_for_dumps(tmp_path):
    # The blocks are copied to host rows when the dump is planned, so the engine may reuse
    # them at once: a preemption has nothing to wait for, and must neither stall the step
    # on a slow store nor cancel dumps that are fine.
    gate = threading.Event()
    inner = PosixStore(PosixStoreConfig(path=str(tmp_path / "store")))
    worker = WorkerSide(LAYOUT, ConnectorStores(GatedStore(inner, gate), None), num_groups=1)
    torch.manual_seed(0)
    worker.register_kv_caches({LAYER: torch.randn(20, 2, 32, 128).to(torch.bfloat16)})
    chain = block_keys(LAYOUT.chain_namespace(None), list(range(512)), 256)
    items = [Item(0, k, chain[k], list(range(1 + 8 * k, 9 + 8 * k))) for k in range(2)]
    worker.wait_for_save(UCMConnectorMetadata(dumps=[Transfer("a", items)]))
    worker.handle_preemptions(UCMConnectorMetadata(preempted=["a"]))
    assert not gate.is_set()  # returned with the store still stalled
    gate.set()
    deadline = time.monotonic() + 30
    while len(worker.tracker) and time.monotonic() < deadline:
        worker.get_transfer_results(set())
        time.sleep(0.01)
    assert worker.tracker.counts.ok == 2 and worker.tracker.counts.failed == 0
    assert inner.lookup_prefix(worker._keys(items)) == 2
    worker.shutdown()
