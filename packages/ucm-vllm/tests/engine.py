"""Run ``run_engine.py`` in a fresh process (a fresh vLLM, nothing in its own cache)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def run_engine(spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_engine.py"), json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["log"] = proc.stderr + proc.stdout
            return result
    raise AssertionError(f"engine failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


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
    assert len(reference["outputs"]) == len(other["outputs"])
    for ref, out in zip(reference["outputs"], other["outputs"]):
        assert out["tokens"] == ref["tokens"]
        for a, b in zip(ref["logprobs"], out["logprobs"]):
            assert abs(a - b) <= tol, (ref["logprobs"], out["logprobs"])
