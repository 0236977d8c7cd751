"""``nox -s bench_placement``: what a store's threads cost the forward pass, on the compute
core or on the core vLLM leaves free (``store_cpus``).

A vLLM CPU worker as vLLM starts one: a process whose OpenMP threads, its main thread among
them, are bound to the compute cores (``GOMP_CPU_AFFINITY``), its parent holding every CPU.
Each step runs a forward pass (matrix products of a fixed size, torch on the bound
threads) and then hands the step's KV to the store without waiting for it, as the
connector's ``wait_for_save`` does; the store copies and seals in its own threads while the
next forward runs.  Measured in one run, each case in a fresh worker, rounds alternating:
the steps alone (no store), the store's threads where the worker's start (``inherit``), and
on the free core (``spare``).  Printed: seconds of the steps and their ratio to the steps
alone.

    python -m ucm.lab.vllm.bench_placement [--store dram|posix] [--steps 60] \
        [--step-mib 8] [--block-kib 256] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ucm.lab.vllm.demo import run_child

MODULE = "ucm.lab.vllm.bench_placement"
CASES = ("alone", "inherit", "spare")


def _steps(args: argparse.Namespace, case: str, where: str) -> dict[str, Any]:
    """In the worker: the timed steps of ``case``."""
    import torch
    from ucm.core.store import create_store
    from ucm.core.threads import format_cpus, place_store_threads
    from ucm.vllm.placement import worker_store_cpus

    computing = os.sched_getaffinity(0)
    cpus = None if case == "alone" else worker_store_cpus(case, True)
    place_store_threads(cpus)
    torch.manual_seed(0)
    weights = [torch.randn(args.hidden, args.hidden) for _ in range(4)]
    x = torch.randn(args.tokens, args.hidden)
    block = args.block_kib << 10
    per_step = max(1, (args.step_mib << 20) // block)
    payload = os.urandom(block)
    store = None
    if case != "alone":
        store = create_store({"kind": args.store, "path": where, "capacity_gb": 2})

    def forward() -> None:
        h = x
        for w in weights:
            h = torch.relu(h @ w)

    forward()  # warm up torch and the store's threads
    tasks = []
    if store is not None:
        warm = [i.to_bytes(16, "little") for i in range(per_step)]
        store.wait(store.dump(warm, [payload] * per_step))
    started = time.perf_counter()
    for step in range(args.steps):
        forward()
        if store is not None:
            first = (step + 1) * per_step
            keys = [i.to_bytes(16, "little") for i in range(first, first + per_step)]
            tasks.append(store.dump(keys, [payload] * per_step))  # not waited: wait_for_save
    steps_s = time.perf_counter() - started
    ok = all(r.ok for task in tasks for r in store.wait(task)) if store is not None else True
    if store is not None:
        store.close()
    return {
        "steps_s": steps_s,
        "ok": ok,
        "computing": format_cpus(computing),
        "store_cpus": format_cpus(cpus) if cpus else "as the worker",
        "mib_per_step": per_step * block / (1 << 20),
    }


def _worker(args: argparse.Namespace, case: str, compute_cpu: int) -> dict[str, Any]:
    """``case`` in a fresh process bound as vLLM binds a worker, its store in a folder of
    its own (shared memory for dram), removed afterwards."""
    parent = "/dev/shm" if args.store == "dram" else (args.dir or tempfile.gettempdir())
    where = os.path.join(parent, f"ucm-bench-placement-{os.getpid()}-{time.monotonic_ns()}")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    env.update(GOMP_CPU_AFFINITY=str(compute_cpu), OMP_NUM_THREADS="1")
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in _passed(args).items()]
    try:
        return run_child(MODULE, "--case", case, "--where", where, *passed, env=env)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _passed(args: argparse.Namespace) -> dict[str, Any]:
    names = ("store", "steps", "step_mib", "block_kib", "hidden", "tokens")
    return {name: getattr(args, name) for name in names}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("bench_placement needs two CPUs: one computes, one is left free")
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for round_ in range(args.rounds):
        for case in CASES:
            result = _worker(args, case, cpus[0])
            runs[case].append(result)
            print(f"round {round_ + 1} {case:8s} steps {result['steps_s']:.3f} s", flush=True)
    median = {case: statistics.median(r["steps_s"] for r in runs[case]) for case in CASES}
    return {
        "store": args.store,
        "steps": args.steps,
        "mib_per_step": runs["spare"][0]["mib_per_step"],
        "computing": runs["spare"][0]["computing"],
        "store_cpus_spare": runs["spare"][0]["store_cpus"],
        "all_ok": all(r["ok"] for case in CASES for r in runs[case]),
        "steps_s": median,
        "alone_over_inherit": median["alone"] / median["inherit"],
        "alone_over_spare": median["alone"] / median["spare"],
        "rounds": runs,
    }


def _print(r: dict[str, Any]) -> None:
    print(
        f"\n{r['steps']} steps, {r['mib_per_step']:.0f} MiB dumped to the {r['store']} store "
        f"after each; the worker computes on CPU {r['computing']}"
    )
    print("case                                   steps (median)  steps alone / case")
    rows = [
        ("alone", "no store", 1.0),
        ("inherit", "store threads on the compute core", r["alone_over_inherit"]),
        ("spare", f"store threads on CPU {r['store_cpus_spare']}", r["alone_over_spare"]),
    ]
    for case, label, ratio in rows:
        print(f"{label:38s} {r['steps_s'][case]:8.3f} s        {ratio:.3f}")
    print(f"every dump stored: {r['all_ok']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", choices=["dram", "posix"], default="dram")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-mib", type=int, default=8, help="KV dumped after each step")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024, help="the forward's matrices")
    parser.add_argument("--tokens", type=int, default=256, help="rows of the forward's input")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where posix stores go (default: temp)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    parser.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        print("RESULT " + json.dumps(_steps(args, args.case, args.where)), flush=True)
        return 0
    report = run(args)
    _print(report)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
