"""Run ``ucm.lab.testing.vllm.run_engine`` in a fresh process (a fresh vLLM, nothing in its
own cache): a child of the tests' zygote, which imported vLLM once (``ucm.lab.testing.zygote``),
under a ``prefix`` too (``ip netns exec HOST``: the child joins the host's namespaces)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ucm.lab.testing.zygote import forked


def run_engine(
    spec: dict[str, Any], timeout: float = 600, prefix: Sequence[str] = ()
) -> dict[str, Any]:
    """Run an engine to the end; ``prefix`` wraps the command (``ip netns exec HOST``)."""
    return finish_engine(start_engine(spec, prefix), timeout)


def start_engine(spec: dict[str, Any], prefix: Sequence[str] = ()) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "ucm.lab.testing.vllm.run_engine", json.dumps(spec)]
    return subprocess.Popen(
        [*prefix, *forked(command)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def finish_engine(proc: subprocess.Popen[str], timeout: float = 600) -> dict[str, Any]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"engine ran past {timeout} s:\n{stderr[-6000:]}") from None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["log"] = stderr + stdout
            return result
    raise AssertionError(f"engine failed (exit {proc.returncode}):\n{stderr[-6000:]}")


def mooncake_store(master: Any, **settings: Any) -> dict[str, Any]:
    """The store setting of an engine on the pool of ``master`` (a ``LocalMaster``, or a
    ``HaCluster``: its masters through etcd): the engines give the pool no memory, the
    blocks live in the segment server."""
    from ucm.lab.mooncake import HaCluster

    if isinstance(master, HaCluster):  # the client finds the leader through etcd
        where = {"master": master.url, "cluster_id": master.cluster_id}
    else:
        where = {"master": master.address}
    return {"kind": "mooncake", **where, "global_segment_gb": 0, "timeout_s": 1.0,
            **settings}  # fmt: skip


def shared_prefix_prompts(
    n: int = 3, prefix: int = 1000, tail: int = 100, seed: int = 0
) -> list[list[int]]:
    """``n`` prompts that share a ``prefix``-token system prompt, each with its own tail."""
    rng = random.Random(seed)
    base = [rng.randrange(10, 1000) for _ in range(prefix)]
    return [base + [rng.randrange(10, 1000) for _ in range(tail)] for _ in range(n)]


def assert_same_outputs(
    reference: dict[str, Any], other: dict[str, Any], tol: float = 1e-3
) -> None:
    """The oracle of reuse: the same tokens, logprobs within ``tol``.

    Only for runs whose requests went one at a time: vLLM CPU's numerics move with the shape
    of the batch, so batched runs differ by ~0.05 in logprobs even without a connector
    (use ``assert_close_outputs`` for those).
    """
    assert not reference.get("together") and not other.get("together"), (
        "an exact comparison needs runs whose requests went one at a time"
    )
    assert len(reference["outputs"]) == len(other["outputs"])
    for ref, out in zip(reference["outputs"], other["outputs"]):
        assert out["tokens"] == ref["tokens"]
        for a, b in zip(ref["logprobs"], out["logprobs"]):
            assert abs(a - b) <= tol, (ref["logprobs"], out["logprobs"])


#: how far batching alone moves a logprob here (0.055 seen), with room to spare
BATCH_TOLERANCE = 0.15


def assert_close_outputs(
    reference: dict[str, Any], other: dict[str, Any], tol: float = BATCH_TOLERANCE
) -> None:
    """The comparison for runs whose requests were batched differently.

    Logprobs agree within ``tol``; tokens agree wherever the reference's greedy pick was
    decisive.  Where the reference's two best candidates lie within ``2 * tol`` of each
    other, batching noise may pick the other one: from that token on the two sequences
    follow different contexts and are no longer compared.
    """
    assert len(reference["outputs"]) == len(other["outputs"])
    for ref, out in zip(reference["outputs"], other["outputs"]):
        assert len(ref["tokens"]) == len(out["tokens"])
        for i, (want, got) in enumerate(zip(ref["tokens"], out["tokens"])):
            close_call = ref["margins"][i] <= 2 * tol
            if want != got:
                assert close_call, (i, ref, out)
                break
            assert abs(ref["logprobs"][i] - out["logprobs"][i]) <= tol, (i, ref, out)
