"""Which backend runs where, and the benchmark's CPU path."""

from __future__ import annotations

import json

import pytest
import torch
from ucm.lab.kernels import bench

from ucm.kernels import gather, resolve_backend, triton_available
from ucm.kernels.api import _triton_module


def test_auto_uses_the_fallback_on_cpu_tensors() -> None:
    caches = [torch.zeros(4, 2, 2, 8)]
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert gather(caches, [[1]], torch.empty(1, 32)) == "torch"


def test_forced_triton_without_interpreter_explains_itself(monkeypatch) -> None:
    mod = _triton_module()
    if isinstance(mod, str):
        pytest.skip(f"triton does not import: {mod}")
    monkeypatch.setattr(mod, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gather([torch.zeros(4, 2, 2, 8)], [[1]], torch.empty(1, 32), backend="triton")


def test_triton_available_on_cpu_means_interpreter() -> None:
    mod = _triton_module()
    expected = not isinstance(mod, str) and mod.interpreter_enabled()
    assert triton_available("cpu") == expected


def test_cpu_benchmark_quick_json(capsys) -> None:
    assert bench.main(["--quick", "--json", "--device", "cpu"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert report["device"] == "cpu"
    names = {r["name"] for r in report["results"]}
    assert {"gather", "scatter", "memcpy"} <= names
    for r in report["results"]:
        assert r["gbps"] > 0
