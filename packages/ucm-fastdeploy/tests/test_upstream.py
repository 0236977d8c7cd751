"""FastDeploy's own cache transfer manager drives UCM's backends, on the CPU.

FastDeploy is not installable here and none of its code is in this repository, so this test
runs where ``FASTDEPLOY_SRC`` names a FastDeploy source tree (a clone of
PaddlePaddle/FastDeploy) and is skipped elsewhere.  It copies three of its files unchanged,
``fastdeploy/cache_manager/cache_transfer_manager.py``, ``cache_tasks.py`` and
``cache_data.py``, over the stand-in in ``fastdeploy_standin/`` for what they import (the
compiled ops, with CPU versions of the two on the storage path; the engine's IPC; config and
logging).  UCM's import hook replaces FastDeploy's ``AttentionStore`` and ``FileStore`` as
the ``.pth`` line does in a deployment.  Then FastDeploy's own code runs as it is: the
manager's ``__init__`` with its command line (``parse_args``), ``_init_storage`` and
``_init_storage_buffer``, and ``write_back_storage_task`` / ``read_storage_task``, the
methods its ``do_data_transfer`` loop hands each storage task to.

The calls those methods make are replayed without FastDeploy by the other tests;
docs/fastdeploy.md lists them with their lines in FastDeploy's file.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
from pathlib import Path

import paddle
import pytest
from ucm.fastdeploy import AttentionStore, UCMStorage, hook
from ucm.lab.testing.fastdeploy import block_bytes, random_caches, tokens, zeros_like

SRC = os.environ.get("FASTDEPLOY_SRC", "")
UPSTREAM = ("cache_transfer_manager.py", "cache_tasks.py", "cache_data.py")
STANDIN = Path(__file__).parent / "fastdeploy_standin"

pytestmark = pytest.mark.skipif(
    not SRC
    or not all((Path(SRC) / "fastdeploy" / "cache_manager" / f).is_file() for f in UPSTREAM),
    reason="FASTDEPLOY_SRC does not name a FastDeploy source tree",
)

LAYERS, HEADS, BLOCK, DIM, GPU_BLOCKS = 3, 2, 4, 8, 16
MODEL = "ERNIE-4.5-0.3B-Paddle"  # FastDeploy's namespace: the model folder's name


class FastDeploy:
    """FastDeploy's modules, imported from the stand-in with the upstream files copied in."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.model = tmp_path / MODEL
        self.model.mkdir()
        self.ctm = importlib.import_module("fastdeploy.cache_manager.cache_transfer_manager")
        self.ctm.logger = logging.getLogger("fastdeploy.cache_transfer")  # set in its __main__
        self.tasks = importlib.import_module("fastdeploy.cache_manager.cache_tasks")
        self.status = importlib.import_module("fastdeploy.cache_manager.cache_data").CacheStatus
        self.ops = importlib.import_module("fastdeploy.cache_manager.ops")
        self.managers: list = []

    def manager(self, backend: str, caches: tuple[list, list], rank: int = 0):
        """A cache transfer manager process, started with FastDeploy's arguments once the
        model runner has made the caches."""
        k, v = caches
        for i in range(LAYERS):
            self.ops.set_data_ipc(k[i], f"key_caches_{i}_rank{rank}.device0")
            self.ops.set_data_ipc(v[i], f"value_caches_{i}_rank{rank}.device0")
        shape = f"{GPU_BLOCKS},{HEADS},{BLOCK},{DIM}"
        argv = ["cache_transfer_manager", "--rank", str(rank), "--mp_num", "1"]
        argv += ["--num_layers", str(LAYERS), "--num_cpu_blocks", "0", "--max_model_len", "64"]
        argv += ["--key_cache_shape", shape, "--value_cache_shape", shape]
        argv += ["--kvcache_storage_backend", backend, "--model_path", str(self.model)]
        self.monkeypatch.setattr(sys, "argv", argv)
        m = self.ctm.CacheTransferManager(self.ctm.parse_args())
        self.managers.append(m)
        return m

    def write(self, m, task_id, prompt, keys, block_ids):
        m.write_back_storage_task(
            self.tasks.WriteStorageTask(
                task_id=task_id, keys=keys, token_ids=prompt, gpu_block_ids=block_ids
            )
        )
        return m.cache_task_queue.done.pop()

    def read(self, m, task_id, prompt, keys, block_ids, start=0):
        m.read_storage_task(
            self.tasks.ReadStorageTask(
                task_id=task_id,
                keys=keys,
                token_ids=prompt,
                gpu_block_ids=block_ids,
                start_read_block_idx=start,
            )
        )
        return m.cache_task_queue.done.pop()


@pytest.fixture
def fastdeploy(tmp_path, store_path, monkeypatch):
    root = tmp_path / "fastdeploy-src"
    shutil.copytree(STANDIN, root)
    for name in UPSTREAM:
        shutil.copy(
            Path(SRC) / "fastdeploy" / "cache_manager" / name, root / "fastdeploy" / "cache_manager"
        )
    config = tmp_path / "ucm.yaml"
    config.write_text(f"store:\n  kind: posix\n  path: {store_path}\n")
    monkeypatch.setenv("UCM_CONFIG_FILE", str(config))
    # FastDeploy gives the AttentionStore no model version; name these weights
    monkeypatch.setenv("AS_MODEL_VERSION", "upstream-test-weights")
    monkeypatch.syspath_prepend(str(root))
    hook.install(["attention_store", "file"])
    default_dtype = paddle.get_default_dtype()  # the manager sets paddle's default dtype
    fd = None
    try:
        fd = FastDeploy(tmp_path, monkeypatch)
        yield fd
    finally:
        for m in fd.managers if fd else []:
            m.storage_backend.close()
        paddle.set_default_dtype(default_dtype)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, hook._Finder)]
        for name in [n for n in sys.modules if n == "fastdeploy" or n.startswith("fastdeploy.")]:
            del sys.modules[name]


def _same_blocks(dst, src, dst_ids, src_ids):
    for layer, (d, s) in enumerate(zip(dst, src)):
        for a, b in zip(dst_ids, src_ids):
            assert block_bytes(d, a) == block_bytes(s, b), f"layer {layer} block {a} <- {b}"


def test_attention_store_write_back_then_a_fresh_manager_reads(fastdeploy):
    fd = fastdeploy
    k, v = random_caches(1, layers=LAYERS, blocks=GPU_BLOCKS)
    prompt = tokens(5 * BLOCK + 2)  # five full blocks and a partial one
    keys = [f"hash{i}" for i in range(5)]  # the prefix cache manager's block hashes
    table = [9, 2, 14, 5, 11]

    m = fd.manager("attention_store", (k, v))
    assert type(m.storage_backend) is AttentionStore
    assert m.storage_backend.config.namespace == MODEL
    assert m.storage_backend.config.bytes_per_shard_layer_per_block == HEADS * BLOCK * DIM * 2
    assert fd.write(m, "req-1", prompt, keys, table) == (
        fd.status.GPU2STORAGE,
        "req-1",
        keys,
        table,
    )
    assert m.storage_backend.resident_blocks(prompt) == 0  # flush_token_index(..., False)
    # the same prompt again: query matches all five, nothing is written
    assert fd.write(m, "req-1b", prompt, keys, table) == (fd.status.GPU2STORAGE, "req-1b", keys, [])

    k2, v2 = zeros_like(k), zeros_like(v)
    fresh = fd.manager("attention_store", (k2, v2))
    new_ids = [4, 6, 8, 10, 12]
    got = fd.read(fresh, "req-2", prompt, keys, new_ids)
    assert got == (fd.status.STORAGE2GPU, "req-2", keys, new_ids)
    _same_blocks(k2, k, new_ids, table)
    _same_blocks(v2, v, new_ids, table)
    assert fresh.storage_backend.resident_blocks(prompt) == 5  # flush_token_index(..., True)


def test_attention_store_read_past_block_zero_gets_match_minus_start_blocks(fastdeploy):
    """read_storage_task cuts token_ids to the match counted from start, then reads from
    start: of the 3 blocks matched from block 2, only 1 is covered.  docs/fastdeploy.md
    describes this and the one-line fix in FastDeploy."""
    fd = fastdeploy
    k, v = random_caches(2, layers=LAYERS, blocks=GPU_BLOCKS)
    prompt = tokens(5 * BLOCK, seed=2)
    keys = [f"hash{i}" for i in range(5)]
    m = fd.manager("attention_store", (k, v))
    fd.write(m, "req-1", prompt, keys, [0, 1, 2, 3, 4])

    k2, v2 = zeros_like(k), zeros_like(v)
    fresh = fd.manager("attention_store", (k2, v2))
    got = fd.read(fresh, "req-2", prompt, keys[2:], [7, 8, 9], start=2)
    assert got == (fd.status.STORAGE2GPU, "req-2", keys[2:], [7])
    _same_blocks(k2, k, [7], [2])


def test_file_backend_is_ucm_storage_through_fastdeploys_host_buffers(fastdeploy):
    fd = fastdeploy
    k, v = random_caches(3, layers=LAYERS, blocks=GPU_BLOCKS)
    prompt = tokens(4 * BLOCK, seed=3)
    keys = [f"hash{i}" for i in range(4)]
    table = [3, 1, 4, 15]

    m = fd.manager("file", (k, v))
    assert type(m.storage_backend) is UCMStorage
    assert m.storage_backend.namespace == MODEL
    # FastDeploy copies the blocks into its registered write buffer, then batch_set
    assert fd.write(m, "req-1", prompt, keys, table) == (
        fd.status.GPU2STORAGE,
        "req-1",
        keys,
        table,
    )

    k2, v2 = zeros_like(k), zeros_like(v)
    fresh = fd.manager("file", (k2, v2))
    # two more blocks asked for than stored: query matches the four, batch_get reads them
    new_ids = [0, 2, 5, 7, 8, 9]
    got = fd.read(fresh, "req-2", prompt, [*keys, "hash4", "hash5"], new_ids)
    assert got == (fd.status.STORAGE2GPU, "req-2", [*keys, "hash4", "hash5"], new_ids[:4])
    _same_blocks(k2, k, new_ids[:4], table)
    _same_blocks(v2, v, new_ids[:4], table)
    untouched = [b for b in range(GPU_BLOCKS) if b not in new_ids[:4]]
    for t in k2 + v2:
        for b in untouched:
            assert block_bytes(t, b) == bytes(len(block_bytes(t, b)))
