"""Where the store's threads run in a vLLM worker (``store_cpus``): on the cores vLLM's CPU
binding leaves free near the worker's compute, never on another engine's cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from ucm.core.settings import ConfigError  # noqa: E402
from ucm.vllm.placement import BIND_ENV, store_cpus  # noqa: E402

NODES = {0: frozenset(range(0, 8)), 1: frozenset(range(8, 16))}
ALL = frozenset(range(16))


@pytest.mark.parametrize(
    ("setting", "environ", "computing", "cpu_platform", "expected"),
    [
        # vLLM's automatic binding, rank 1 of two: the free core of its own node
        ("spare", {}, frozenset(range(8, 15)), True, {15}),
        ("spare", {BIND_ENV: "auto"}, frozenset(range(0, 7)), True, {7}),
        # cores named by hand: the others may be another engine's
        ("spare", {BIND_ENV: "0-6"}, frozenset(range(0, 7)), True, None),
        # nothing free, no binding on a GPU, or asked to stay
        ("spare", {}, ALL, True, None),
        ("spare", {}, frozenset(range(0, 7)), False, None),
        ("inherit", {}, frozenset(range(0, 7)), True, None),
        # named: there, on any platform
        ("7,15", {BIND_ENV: "0-6"}, frozenset(range(0, 7)), False, {7, 15}),
    ],
)
def test_store_cpus(setting, environ, computing, cpu_platform, expected):
    assert store_cpus(setting, environ, computing, ALL, NODES, cpu_platform) == expected


def test_named_cpus_the_engine_may_not_use_are_refused():
    with pytest.raises(ConfigError, match="store_cpus: names CPUs 16-17 that this engine"):
        store_cpus("14-17", {}, frozenset({0}), ALL, NODES)


def test_a_worker_bound_by_openmp_puts_the_store_threads_on_the_free_core():
    """A real worker's binding: libgomp pins the main thread when torch loads it
    (``GOMP_CPU_AFFINITY``, as vLLM sets it for its workers), its parent holds every CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    environ = {k: v for k, v in os.environ.items() if k != BIND_ENV}  # vLLM's default: auto
    script = (
        "import json, os, torch\n"
        "from ucm.vllm.placement import worker_store_cpus\n"
        "print(json.dumps([sorted(os.sched_getaffinity(0)),"
        " sorted(worker_store_cpus('spare', True) or [])]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**environ, "GOMP_CPU_AFFINITY": str(cpus[0]), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    computing, spare = json.loads(out.stdout.strip().splitlines()[-1])
    assert computing == [cpus[0]]
    assert spare and cpus[0] not in spare and set(spare) <= set(cpus)
