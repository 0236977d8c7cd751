"""``nox -s bench_vllm``: what the connector saves and what it costs, as ratios of one run.

1. Time to first token of a 4096-token prompt: cold (a fresh engine, empty store), warm (a
   fresh engine after a restart, so vLLM's own cache is empty), warm again with the page
   cache dropped where the machine allows it; against vLLM's floor (the same prompt again in
   one engine: a local prefix-cache hit) plus a raw cold read of the same stored bytes.
2. Overhead with no reuse: throughput of many distinct prompts with the connector against
   without it.

Every engine runs in its own process with the same CPU thread settings.  With ``--kind
mooncake`` the store is a Mooncake cluster started for the run (a master and a segment
server in other processes; the engines give the pool no memory), and the page-cache and raw
read steps, which are about files, are skipped.

    python -m ucm.lab.vllm.bench [--kind posix|mooncake] [--tokens 4096] [--prompts 16]
                             [--prompt-tokens 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

from ucm.lab.vllm.demo import make_llm, random_prompt, run_child, serve_once, write_model

MODULE = "ucm.lab.vllm.bench"


def drop_page_cache() -> bool:
    """Drop the page cache (needs root and a writable /proc/sys); False when not allowed."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_read_seconds(directory: str) -> tuple[float, int]:
    """Read every file under ``directory`` once, sequentially: the disk's part of a load."""
    files = [os.path.join(d, n) for d, _, names in os.walk(directory) for n in names]
    t0 = time.perf_counter()
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return time.perf_counter() - t0, total


def throughput(model: str, store: str | None, prompts: int, tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    llm = make_llm(model, store, tokens + 64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([random_prompt(64, seed=1)], params, use_tqdm=False)
    batch = [random_prompt(tokens, seed=100 + i) for i in range(prompts)]
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": prompts * (tokens + 16)}


def _stores(kind: str, work: str, running: ExitStack) -> tuple[str, str]:
    """The two stores of a run (reuse, then no reuse), as ``--store`` arguments."""
    if kind == "posix":
        return os.path.join(work, "store"), os.path.join(work, "store2")
    from ucm.lab.mooncake import LocalMaster, SegmentServer

    master = running.enter_context(LocalMaster())
    running.enter_context(SegmentServer(master.address, 2048))
    settings = {"kind": "mooncake", "master": master.address, "global_segment_gb": 0}
    return (
        json.dumps({**settings, "key_prefix": "bench/"}),
        json.dumps({**settings, "key_prefix": "bench2/"}),
    )


def _ttft(model: str, store: str | None, tokens: int) -> dict[str, Any]:
    args = ["--what", "ttft", "--model", model, "--tokens", str(tokens)]
    return run_child(MODULE, *args, *(["--store", store] if store else []))


def _tput(model: str, store: str | None, prompts: int, tokens: int) -> dict[str, Any]:
    args = ["--what", "throughput", "--model", model, "--prompts", str(prompts),
            "--prompt-tokens", str(tokens)]  # fmt: skip
    return run_child(MODULE, *args, *(["--store", store] if store else []))


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="ucm-bench-vllm-", dir=os.path.expanduser("~"))
    model = write_model(os.path.join(work, "model"))
    report: dict[str, Any] = {"prompt_tokens": args.tokens, "store_kind": args.kind}
    with ExitStack() as running:
        running.callback(shutil.rmtree, work, ignore_errors=True)
        store, store2 = _stores(args.kind, work, running)
        files = args.kind == "posix"
        print(f"[1/6] cold engine, {args.tokens}-token prompt ...", flush=True)
        cold = _ttft(model, store, args.tokens)
        print("[2/6] warm engine (fresh process) ...", flush=True)
        warm = _ttft(model, store, args.tokens)
        print("[3/6] warm engine, page cache dropped ...", flush=True)
        dropped = files and drop_page_cache()
        warm_cold_disk = _ttft(model, store, args.tokens) if dropped else None
        print("[4/6] raw read of the stored bytes ...", flush=True)
        raw_dropped = files and drop_page_cache()
        raw_s, raw_bytes = raw_read_seconds(store) if files else (0.0, 0)
        print("[5/6] throughput without the connector ...", flush=True)
        plain = _tput(model, None, args.prompts, args.prompt_tokens)
        print("[6/6] throughput with the connector (no reuse) ...", flush=True)
        with_ucm = _tput(model, store2, args.prompts, args.prompt_tokens)
    floor = cold["floor_s"]
    report.update(
        cold_ttft_s=cold["ttft_s"],
        warm_ttft_s=warm["ttft_s"],
        warm_cached_tokens=warm["cached_tokens"],
        warm_over_cold=warm["ttft_s"] / cold["ttft_s"],
        page_cache_dropped=dropped,
        warm_dropped_ttft_s=warm_cold_disk["ttft_s"] if warm_cold_disk else None,
        warm_dropped_over_cold=(warm_cold_disk["ttft_s"] / cold["ttft_s"])
        if warm_cold_disk
        else None,
        floor_s=floor,
        raw_read_s=raw_s,
        raw_read_bytes=raw_bytes,
        raw_read_cold=raw_dropped,
        outputs_match=warm["output"] == cold["output"],
        throughput_ratio=plain["seconds"] / with_ucm["seconds"],
        throughput_plain_tok_s=plain["tokens"] / plain["seconds"],
        throughput_ucm_tok_s=with_ucm["tokens"] / with_ucm["seconds"],
    )
    best_warm = report["warm_dropped_ttft_s"] or report["warm_ttft_s"]
    report["warm_over_floor_plus_raw"] = best_warm / (floor + raw_s)
    return report


def _print(r: dict[str, Any]) -> None:
    if r["store_kind"] == "posix":
        where = (
            f"stored KV read raw: {r['raw_read_bytes'] >> 20} MiB in {r['raw_read_s']:.3f} s "
            f"({'cold' if r['raw_read_cold'] else 'page cache'})"
        )
    else:
        where = "store: a Mooncake cluster (a master and a segment server of this run)"
    print(f"\nprompt: {r['prompt_tokens']} tokens; {where}")
    print(f"  cold time to first token            {r['cold_ttft_s']:8.3f} s")
    print(
        f"  warm (fresh engine)                 {r['warm_ttft_s']:8.3f} s  "
        f"warm/cold {r['warm_over_cold']:.4f}  ({r['warm_cached_tokens']} tokens from the store)"
    )
    if r["warm_dropped_ttft_s"] is not None:
        print(
            f"  warm, page cache dropped            {r['warm_dropped_ttft_s']:8.3f} s  "
            f"warm/cold {r['warm_dropped_over_cold']:.4f}"
        )
    elif r["store_kind"] == "posix":
        print("  warm, page cache dropped            not allowed on this machine")
    print(f"  vLLM floor (local prefix-cache hit) {r['floor_s']:8.3f} s")
    if r["store_kind"] == "posix":
        print(f"  warm / (floor + raw read)           {r['warm_over_floor_plus_raw']:8.2f}")
    print(f"  outputs match                       {r['outputs_match']}")
    print(
        f"no reuse: {r['throughput_plain_tok_s']:.0f} tok/s without, "
        f"{r['throughput_ucm_tok_s']:.0f} tok/s with the connector: "
        f"ratio {r['throughput_ratio']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kind",
        choices=["posix", "mooncake"],
        default="posix",
        help="the store: posix in a temporary directory (default), or a Mooncake cluster "
        "started for the run",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="prompt of the reuse test")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts, overhead test")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="their length")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    parser.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--what", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        if args.what == "ttft":
            result = serve_once(args.model, args.store, args.tokens)
        else:
            result = throughput(args.model, args.store, args.prompts, args.prompt_tokens)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    report = run(args)
    _print(report)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
