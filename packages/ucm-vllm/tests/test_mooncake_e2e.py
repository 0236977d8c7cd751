"""vLLM on two hosts sharing one Mooncake cluster, with the master killed while one serves.

The hosts are network namespaces on a bridge (ucm.lab.netlab): host m runs the
mooncake_master and a segment server (mooncake_client, the pool's memory, so that blocks
outlive the engine that wrote them); engine A runs on host a, engine B on host b, each a
fresh process.  The reference is vLLM without the connector; every run sends its requests
one at a time and empties vLLM's own prefix cache before each (``fresh_prefix_cache``), so a
hit can only come from the store.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ucm.lab.testing.vllm.engine import (
    assert_same_outputs,
    finish_engine,
    mooncake_store,
    run_engine,
    shared_prefix_prompts,
    start_engine,
)

pytestmark = pytest.mark.engine  # real engines, in fresh processes

pytest.importorskip("vllm")

ENGINE_BLOCK = 32


X = shared_prefix_prompts(3, prefix=1000, tail=100, seed=1)  # stored by A
Y = shared_prefix_prompts(3, prefix=600, tail=80, seed=2)  # never stored
Z = shared_prefix_prompts(1, prefix=800, tail=60, seed=3)  # stored after the restart
# B: hits, then the master dies (requests 2-7), then it is back (8-11): X[0] is lost
B_PROMPTS = [X[0], X[1], X[2], X[0], Y[0], Y[1], Y[2], X[1], Z[0], Z[0], Z[0], X[0]]
KILLED_AT, RESTARTED_AT = 2, 8
# vLLM's own processes (the engine core and its worker apart), as a deployment runs them: a
# store call that blocks holds up one process of the engine, not all of it
SPLIT = {"processes": "split"}


@pytest.fixture(scope="module")
def reference(tiny_model):
    return run_engine(
        {"model": tiny_model, "prompts": B_PROMPTS, "fresh_prefix_cache": True, **SPLIT}
    )


@pytest.fixture(scope="module")
def stored_by_a(mooncake_hosts, tiny_model):
    lab, master, _ = mooncake_hosts
    return run_engine(
        {"model": tiny_model, "prompts": X, "store": mooncake_store(master),
         "fresh_prefix_cache": True, **SPLIT},
        prefix=lab.command("a", []),
    )  # fmt: skip


def test_a_prefix_stored_on_one_host_hits_on_another(
    mooncake_hosts, tiny_model, reference, stored_by_a
):
    lab, master, _ = mooncake_hosts
    assert_same_outputs(_only(reference, [0, 1, 2]), stored_by_a)
    # the 1000-token shared prefix gives 3 store blocks, then one per prompt
    assert stored_by_a["metrics"]["vllm:ucm_dumped_blocks"] >= 3 + len(X)
    warm = run_engine(
        {"model": tiny_model, "prompts": X, "store": mooncake_store(master),
         "fresh_prefix_cache": True, **SPLIT},
        prefix=lab.command("b", []),
    )  # fmt: skip
    assert_same_outputs(_only(reference, [0, 1, 2]), warm)
    for out in warm["outputs"]:  # 4 store blocks of 256 tokens each
        assert out["num_cached_tokens"] >= 1024, out["num_cached_tokens"]
    assert warm["metrics"]["vllm:ucm_loaded_blocks"] >= 3 * 4
    assert warm["metrics"].get("vllm:ucm_load_errors", 0) == 0


def test_a_killed_master_costs_b_nothing_and_a_new_one_is_used(
    mooncake_hosts, tiny_model, reference, stored_by_a, tmp_path
):
    lab, master, _ = mooncake_hosts
    engine = start_engine(_b_pausing(tiny_model, master, tmp_path), prefix=lab.command("b", []))
    try:
        _wait_for(tmp_path / "paused-0", engine)
        master.kill()
        (tmp_path / "resume-0").touch()
        _wait_for(tmp_path / "paused-1", engine)
        master.start()  # empty metadata; the segment server and B register again by themselves
        time.sleep(5)  # "within 5 s"
        (tmp_path / "resume-1").touch()
        run = finish_engine(engine)
    finally:
        if engine.poll() is None:
            engine.kill()
    assert_same_outputs(reference, run)  # every request, in every phase
    outs = run["outputs"]
    assert all(o["num_cached_tokens"] >= 1024 for o in outs[:KILLED_AT])  # hits before
    assert all(o["num_cached_tokens"] == 0 for o in outs[KILLED_AT:RESTARTED_AT])
    # No request waits on the dead master, not even the first after its death (the store
    # heard of it from the connection it holds): what a request costs over the same
    # request served without the connector (full prefill both times).
    dead = range(KILLED_AT, RESTARTED_AT)
    added = [outs[i]["seconds"] - reference["outputs"][i]["seconds"] for i in dead]
    print("added seconds per request with the master dead:", [round(a, 4) for a in added])
    assert max(added) < 2.0, added  # not one waited on the master (timeout_s is 4)
    # The new master: Z's blocks are stored by its first request and hit by a repeat.
    assert any(o["num_cached_tokens"] >= 768 for o in outs[RESTARTED_AT + 1 : -1]), [
        o["num_cached_tokens"] for o in outs[RESTARTED_AT:]
    ]
    assert outs[-1]["num_cached_tokens"] == 0  # X: stored with the old master, lost
    assert run["metrics"].get("vllm:ucm_load_errors", 0) == 0


def test_the_leader_killed_while_b_serves_costs_nothing_and_the_new_one_is_used(
    mooncake_ha_hosts, tiny_model, reference, tmp_path
):
    """Highly available masters (etcd on e, masters on m1 and m2, the pool on p): B stores
    and hits through the leader, the leader is killed, B serves on; once the standby leads,
    B's new dumps land on it and hit.  Every output equals vLLM alone."""
    lab, cluster = mooncake_ha_hosts
    engine = start_engine(_b_pausing(tiny_model, cluster, tmp_path), prefix=lab.command("b", []))
    try:
        _wait_for(tmp_path / "paused-0", engine)
        old_leader = cluster.leader()
        old_leader.kill()
        killed = time.monotonic()
        (tmp_path / "resume-0").touch()
        _wait_for(tmp_path / "paused-1", engine)
        new_leader = cluster.wait_serving(60)
        serving = time.monotonic() - killed
        time.sleep(3)  # B's probes (every 0.5 s) find it
        (tmp_path / "resume-1").touch()
        run = finish_engine(engine)
    finally:
        if engine.poll() is None:
            engine.kill()
    print(f"the standby served {serving:.1f} s after the leader was killed")
    assert new_leader is not old_leader
    assert_same_outputs(reference, run)  # every request, before, during and after
    outs = run["outputs"]
    assert outs[1]["num_cached_tokens"] >= 768  # X's shared prefix, through the old leader
    if sum(o["seconds"] for o in outs[KILLED_AT:RESTARTED_AT]) < 8:  # all before a new leader
        assert all(o["num_cached_tokens"] == 0 for o in outs[KILLED_AT:RESTARTED_AT])
    dead = range(KILLED_AT, RESTARTED_AT)
    added = [outs[i]["seconds"] - reference["outputs"][i]["seconds"] for i in dead]
    print("added seconds per request after the kill:", [round(a, 4) for a in added])
    assert max(added) < 2.0, added  # not one waited on the dead leader (timeout_s is 4)
    # New dumps land on the new leader: Z's blocks, stored by its first request, hit.
    assert any(o["num_cached_tokens"] >= 768 for o in outs[RESTARTED_AT + 1 : -1]), [
        o["num_cached_tokens"] for o in outs[RESTARTED_AT:]
    ]
    assert outs[-1]["num_cached_tokens"] == 0  # X: registered with the old leader, lost
    assert run["metrics"].get("vllm:ucm_load_errors", 0) == 0


def _b_pausing(model: str, master, pause_dir: Path) -> dict:
    """B's engine on ``master``'s pool, pausing before the kill and before the restart."""
    # A call that waits on the dead master costs its request timeout_s: 4 s, far above the
    # noise of a request's time on a loaded machine (0.2 s seen in CI).
    return {
        "model": model, "prompts": B_PROMPTS, "store": mooncake_store(master, timeout_s=4.0),
        "fresh_prefix_cache": True, **SPLIT, "pause_after": [KILLED_AT, RESTARTED_AT],
        "pause_dir": str(pause_dir),
    }  # fmt: skip


def _only(run: dict, indices: list[int]) -> dict:
    return {**run, "outputs": [run["outputs"][i] for i in indices]}


def _wait_for(path: Path, engine, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if engine.poll() is not None:
            raise AssertionError(f"engine exited with {engine.returncode}: {finish_engine(engine)}")
        assert time.monotonic() < deadline, f"{path.name} not reached in {timeout} s"
        time.sleep(0.1)


def test_a_slow_link_to_the_pool_still_serves_correct_outputs(
    mooncake_hosts, tiny_model, reference
):
    """Host m (master and pool) sends through a 5 Mbit/s token bucket: B's loads and dumps
    are slow, its outputs are still those of vLLM alone.  (No netem in this kernel: no
    latency or loss injected.)"""
    lab, master, _ = mooncake_hosts
    lab.throttle("m", 5_000)
    try:
        run = run_engine(
            {"model": tiny_model, "prompts": [Z[0]] * 3, "store": mooncake_store(master),
             "fresh_prefix_cache": True, **SPLIT},
            prefix=lab.command("b", []),
        )  # fmt: skip
    finally:
        lab.throttle("m", None)
    assert_same_outputs(_only(reference, [RESTARTED_AT] * 3), run)
    assert any(o["num_cached_tokens"] >= 768 for o in run["outputs"][1:]), [
        o["num_cached_tokens"] for o in run["outputs"]
    ]
