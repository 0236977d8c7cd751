"""``nox -s bench_peer``: time to first token as vLLM's own client measures it.

The client is ``vllm bench serve`` with its ``prefix_repetition`` dataset (prompts built
from random token ids: ``--prefixes`` prefixes of each length, one suffix each), code we did
not write, run unchanged.  Every system is a ``vllm serve`` of its own with the same model,
KV space and CPU threads (``ucm.lab.vllm.bench_systems`` starts them):

  vllm        vLLM alone, its own prefix cache emptied before each run: every prompt is
              computed (cold);
  vllm-floor  vLLM alone, pass 2 on the server that served pass 1: the KV is in the engine
              already, nothing moves (the floor no store can go under);
  ucm-posix, ucm-dram, ucm-tiered, lmcache: pass 1 stores every prompt, the server is
              restarted and warmed up on prompts that are not the run's (as pass 1 warmed
              the floor's), and each run of pass 2 starts with vLLM's own cache emptied
              (``POST /reset_prefix_cache``): every hit comes from the store.  A disk
              store's files (posix, tiered's backing) are read into the page cache before
              each of its runs, the share it still held in the run's ``page_cache_before``
              (the page cache alone does not keep them: ``ucm.lab.page_cache``).

Pass 2 runs ``--rounds`` times per prefix length and concurrency (one request at a time,
then ``--concurrency`` at once), the prompts of each length those of pass 1 (the same
seed).  The floor's server stays up for the whole benchmark and runs the same pass 2 right
before each of another system's runs: a system is set against the floor's runs taken beside
its own, and two systems against each other through their ratios to the floor, since a
shared host's speed moves by more than the gaps measured here between runs minutes apart.
The client's readiness probe and warm-up requests are off: they would compute a prompt of
the run before it is timed.  Reported per length and concurrency: TTFT p50 / p90 / p99 over
every request of the rounds, the ratios to the floor and to LMCache, and the prompt tokens
each system reused a round (``/metrics``: vLLM's own hits and the connector's), which must
be the same for every system but the cold one.  JSON last.

    python -m ucm.lab.vllm.bench_peer [--lengths 512,2048,8192] [--prefixes 8] ...

Its figure (``ucm.lab.vllm.peer_plot``) is drawn from the report's JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from ucm.lab import page_cache
from ucm.lab.vllm.bench_serve import BLOCK_SIZE, MODEL_NAME, cpuinfo, machine
from ucm.lab.vllm.bench_systems import (
    QUIET_ENV,
    System,
    describe,
    make_system,
    remove_host_stores,
    run_each,
)
from ucm.lab.vllm.demo import engine_env
from ucm.lab.vllm.serve_process import ServeProcess, has_vllm_dist
from ucm.lab.vllm.serve_report import PERCENTILES, label

SYSTEMS = ("vllm", "vllm-floor", "ucm-posix", "ucm-dram", "ucm-tiered", "lmcache")
#: added to the seed of the prompts that warm a restarted server up: none is the run's
WARM_UP_SEED = 7919
#: the systems every other is set against
BASELINES = ("vllm-floor", "lmcache")
#: a Llama whose compute is quick on a CPU host for its KV bytes (16 KiB a token in float32):
#: the run measures the stores, not the matmuls; the dtype is chosen by the host (``dtype``)
MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 1024, "max_position_embeddings": 16384, "initializer_range": 0.02,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def dtype(asked: str, flags: set[str]) -> str:
    """The model's dtype: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX),
    else float32 (a bf16 matmul ran 3x slower than float32 there); ``asked`` unless auto."""
    if asked != "auto":
        return asked
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def bench_command(python: str = sys.executable) -> list[str]:
    """``vllm bench serve`` of the environment of ``python``: the command where a
    distribution named ``vllm`` installed it, else the same client from its module
    (``ucm.lab.vllm.vllm_bench_serve``)."""
    if has_vllm_dist(python):
        return [str(Path(python).parent / "vllm"), "bench", "serve"]
    return [python, "-m", "ucm.lab.vllm.vllm_bench_serve"]


#: what vLLM's client imports (23 s of a 28 s run here): imported once by the zygote that
#: forks every client run (``forked_client``)
CLIENT_PRELOAD = ("torch", "vllm", "vllm.benchmarks.serve", "vllm.utils.argparse_utils")


@contextlib.contextmanager
def forked_client() -> Iterator[list[str]]:
    """``bench_command()``, each run a child forked from a process that imported the client
    once (``ucm.lab.testing.zygote``), in the environment the client is run in: the same
    code, run unchanged, without its 23 s of imports a run.  Where the client is the
    ``vllm`` command of a distribution, that command as it is."""
    command = bench_command()
    if command[:2] != [sys.executable, "-m"]:
        yield command
        return
    from ucm.lab.testing.zygote import Zygote

    zygote = Zygote({**os.environ, **QUIET_ENV}, preload=CLIENT_PRELOAD)
    try:
        yield zygote.command(command[2], command[3:])
    finally:
        zygote.close()


def client_args(
    url: str,
    tokenizer: str,
    length: int,
    args: argparse.Namespace,
    concurrency: int,
    result: Path,
) -> list[str]:
    """What ``vllm bench serve`` is given for one run: prompts of ``length``-token prefixes
    (``args.prefixes`` of them, one ``args.suffix``-token suffix each, the same for a seed),
    ``concurrency`` requests in flight, no readiness probe or warm-up, the result (with each
    request's TTFT) saved at ``result``."""
    return [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", MODEL_NAME, "--tokenizer", tokenizer,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(length),
        "--prefix-repetition-suffix-len", str(args.suffix),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output),
        "--num-prompts", str(args.prefixes), "--seed", str(args.seed + length),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
        "--ready-check-timeout-sec", "0", "--num-warmups", "0",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles",
        ",".join(str(p) for p in PERCENTILES),
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name, "--disable-tqdm",
    ]  # fmt: skip


def read_result(path: Path) -> dict[str, Any]:
    """The client's figures of one run: TTFT percentiles in seconds, requests done."""
    raw = json.loads(path.read_text())
    out: dict[str, Any] = {
        f"ttft_p{p}_s": raw[f"p{p}_ttft_ms"] / 1e3 for p in PERCENTILES if f"p{p}_ttft_ms" in raw
    }
    out["ttft_mean_s"] = raw.get("mean_ttft_ms", math.nan) / 1e3
    out["completed"] = raw.get("completed", 0)
    out["failed"] = raw.get("failed", raw.get("num_prompts", 0) - out["completed"])
    out["ttfts_s"] = raw.get("ttfts", [])
    return out


#: the counters whose sum is the prompt tokens a server did not compute: vLLM's own prefix
#: cache's hits and the connector's
REUSE_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


#: the connector's seconds of loading (ucm.vllm.counters): a run's time spent in UCM's loads
LOAD_SECONDS = "vllm:ucm_load_seconds_total"
LOAD_WAIT_SECONDS = "vllm:ucm_load_wait_seconds_total"


def reused_tokens(before: Mapping[str, float], after: Mapping[str, float]) -> int:
    """Prompt tokens reused between two reads of a server's counters."""
    return int(sum(after.get(k, 0.0) - before.get(k, 0.0) for k in REUSE_COUNTERS))


def check_reuse(runs: Sequence[Mapping[str, Any]], prefixes: int) -> list[str]:
    """Where a system's reuse is not the floor's: each (length, concurrency) run of a system
    but the cold one against the floor's, the same prompts.  A connector may reuse up to one
    vLLM block a prompt more than vLLM's own cache (it is asked for every token but the last,
    vLLM's cache hits whole blocks only), never less."""
    floor = {
        (r["length"], r["concurrency"]): r["reused_tokens"]
        for r in runs
        if r["system"] == "vllm-floor"
    }
    out = []
    for r in runs:
        if r["system"] in ("vllm", "vllm-floor"):
            continue
        expected = floor.get((r["length"], r["concurrency"]))
        if expected is None:
            continue
        if not expected <= r["reused_tokens"] <= expected + prefixes * BLOCK_SIZE:
            out.append(
                f"{r['system']} reused {r['reused_tokens']} tokens of {r['length']}-token "
                f"prefixes at concurrency {r['concurrency']}, the floor {expected}"
            )
    return out


def pool(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One row of ``runs`` (rounds of one system, length and concurrency): the TTFT
    percentiles of all their requests together (linear, as vLLM's client computes them);
    where a run kept no request's TTFT, the median of the runs' own percentiles."""
    first = runs[0]
    row: dict[str, Any] = {
        "system": first["system"], "length": first["length"],
        "concurrency": first["concurrency"], "rounds": len(runs),
        "reused_tokens": first.get("reused_tokens", 0),
    }  # fmt: skip
    ttfts = [t for r in runs for t in r.get("ttfts_s") or ()]
    whole = all(r.get("ttfts_s") for r in runs)
    for p in PERCENTILES:
        key = f"ttft_p{p}_s"
        if whole:
            row[key] = float(np.percentile(ttfts, p))
        else:
            row[key] = statistics.median(r[key] for r in runs)
    if whole:
        row["ttfts_s"] = ttfts
    return row


def _group(runs: Sequence[Mapping[str, Any]], **match: Any) -> list[Mapping[str, Any]]:
    return [r for r in runs if all(r.get(k) == v for k, v in match.items())]


def rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A pooled row (:func:`pool`) per system, length and concurrency, in the order met."""
    keys = dict.fromkeys((r["system"], r["length"], r["concurrency"]) for r in runs)
    return [pool(_group(runs, system=s, length=n, concurrency=c)) for s, n, c in keys]


def _floor_beside(runs: Sequence[Mapping[str, Any]], system: str, length: int, c: int):
    """The floor's row of the runs taken beside ``system``'s (any of its runs of that
    length and concurrency where none was)."""
    near = _group(runs, system="vllm-floor", length=length, concurrency=c, beside=system)
    return pool(near or _group(runs, system="vllm-floor", length=length, concurrency=c))


def ratios(runs: Sequence[Mapping[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Each system's TTFT percentiles over ``baseline``'s of the same length and
    concurrency.  Against the floor, over the floor's runs taken beside the system's (each
    round runs the floor's server, then the system's); against another system, where both
    were run beside the floor, the ratio of their ratios to it, so that the machine's speed
    in between cancels out."""
    out = []
    for r in rows(runs):
        n, c = r["length"], r["concurrency"]
        b_runs = _group(runs, system=baseline, length=n, concurrency=c)
        if r["system"] == baseline or not b_runs:
            continue
        if baseline == "vllm-floor":
            b = _floor_beside(runs, r["system"], n, c)
        elif r["system"] == "vllm-floor":  # the floor's runs beside the baseline's
            r, b = _floor_beside(runs, baseline, n, c), pool(b_runs)
        else:
            mine = _group(runs, system="vllm-floor", length=n, concurrency=c, beside=r["system"])
            theirs = _group(runs, system="vllm-floor", length=n, concurrency=c, beside=baseline)
            b = pool(b_runs)
            if mine and theirs:
                r, b = _over(r, pool(mine)), _over(b, pool(theirs))
        row: dict[str, Any] = {"system": r["system"], "length": n, "concurrency": c}
        for p in PERCENTILES:
            key = f"ttft_p{p}_s"
            row[key] = r[key] / b[key] if b.get(key) else math.nan
        out.append(row)
    return out


def _over(row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, **{f"ttft_p{p}_s": row[f"ttft_p{p}_s"] / base[f"ttft_p{p}_s"]
                      for p in PERCENTILES}}  # fmt: skip


def markdown(runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per system, length and concurrency: TTFT percentiles over its rounds, the
    ratios to the floor and to LMCache (:func:`ratios`), the tokens reused a round."""
    against = {
        b: {(r["system"], r["length"], r["concurrency"]): r for r in ratios(runs, b)}
        for b in BASELINES
    }
    head = (
        "| prefix | in flight | system | TTFT p50 | p90 | p99 | / floor (p50, p90, p99) "
        "| / LMCache (p50, p90, p99) | reused tokens |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(rows(runs), key=lambda r: (r["length"], r["concurrency"],
                    SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 99)):  # fmt: skip
        cells = []
        for baseline in BASELINES:
            ratio = against[baseline].get((r["system"], r["length"], r["concurrency"]))
            cells.append("" if ratio is None else ", ".join(
                f"{ratio[f'ttft_p{p}_s']:.2f}" for p in PERCENTILES))  # fmt: skip
        lines.append(
            f"| {r['length']} | {r['concurrency']} | {label(r['system'])} "
            + "".join(f"| {r[f'ttft_p{p}_s']:.3f} s " for p in PERCENTILES)
            + f"| {cells[0]} | {cells[1]} | {r['reused_tokens']} |"
        )
    return head + "\n".join(lines) + "\n"


def kv_space_gib(model: Mapping[str, Any], torch_dtype: str, tokens: int) -> int:
    """GiB of KV space for ``tokens`` tokens of ``model`` (and a fifth more, whole GiB):
    what the floor's engine must hold for pass 2 to hit everything in its own cache."""
    per_token = (
        2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"]
        * (4 if torch_dtype == "float32" else 2)
    )  # fmt: skip
    return max(1, math.ceil(1.2 * per_token * tokens / (1 << 30)))


def serve_args(args: argparse.Namespace, torch_dtype: str, tokenizer: str) -> list[str]:
    """What every system's ``vllm serve`` is given."""
    longest = max(args.lengths) + args.suffix + args.output
    return [
        "--served-model-name", MODEL_NAME, "--load-format", "dummy", "--tokenizer", tokenizer,
        "--dtype", torch_dtype, "--enforce-eager", "--block-size", str(BLOCK_SIZE),
        "--seed", "0", "--max-model-len", str(longest),
        "--enable-prompt-tokens-details", "--shutdown-timeout", "30",
    ]  # fmt: skip


Launcher = Callable[..., ServeProcess]


@attrs.frozen
class Starters:
    """How a run starts its servers and vLLM's client (the tests fork both from a process
    that imported vLLM already)."""

    server: Launcher = ServeProcess
    client: Sequence[str] = attrs.field(factory=bench_command)


@attrs.frozen
class Bench:
    """What every server and client of one benchmark shares."""

    args: argparse.Namespace
    common: list[str]  # every server's arguments
    env: dict[str, str]  # every server's environment
    work: str  # the run's folder
    model: str
    tokenizer: str
    starters: Starters

    def start(self, system: System, phase: int) -> ServeProcess:
        """``system``'s server, ready (``phase``: 0 before a restart, 1 after)."""
        log = os.path.join(self.work, f"{system.name}-{phase}.log")
        server = self.starters.server(self.model, [*self.common, *system.serve_args], log,
                                      env=self.env, python=system.python)  # fmt: skip
        try:
            return server.wait_ready()
        except RuntimeError:
            server.kill()
            raise

    def client(
        self,
        server: ServeProcess,
        length: int,
        concurrency: int,
        result: Path,
        args: argparse.Namespace | None = None,
    ) -> dict[str, Any]:
        """One run of vLLM's client against ``server`` (its prompts from ``args``, the
        benchmark's by default); its figures."""
        result.unlink(missing_ok=True)
        asked = client_args(server.url, self.tokenizer, length, args or self.args, concurrency,
                            result)  # fmt: skip
        done = subprocess.run([*self.starters.client, *asked], capture_output=True, text=True,
                              env={**os.environ, **QUIET_ENV}, timeout=3600)  # fmt: skip
        if done.returncode != 0 or not result.is_file():
            raise RuntimeError(
                f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        figures = read_result(result)
        if figures["failed"]:
            raise RuntimeError(f"{figures['failed']} requests failed:\n{done.stdout[-3000:]}")
        return figures


def run_system(system: System, bench: Bench, floor: ServeProcess | None = None) -> dict[str, Any]:
    """Pass 1 (where the system keeps something), the restart (where it has a store), then
    pass 2: ``args.rounds`` runs at every concurrency and length, each after a run of
    ``floor`` (the floor's server, up for the whole benchmark) where one is given; the runs,
    or why the system did not start."""
    args = bench.args
    ran = describe(system, bench.common)
    runs: list[dict[str, Any]] = []
    if system.sidecar is not None:
        try:
            system.sidecar.start()
        except (RuntimeError, TimeoutError) as exc:
            return {"system": system.name, "ran": ran, "refused": str(exc)[-600:]}
    server = None
    try:
        server = start_system(system, bench)
        for concurrency in args.concurrency:
            for length in args.lengths:
                for _ in range(args.rounds):
                    if floor is not None:
                        runs.append(_timed(bench, floor, "vllm-floor", length, concurrency,
                                           beside=system.name))  # fmt: skip
                    if not system.floor:
                        server.reset_prefix_cache()
                    # a disk store on a warm page cache: its files read in before the run
                    warmth = page_cache.warm(system.disk) if system.disk else None
                    runs.append(_timed(bench, server, system.name, length, concurrency))
                    if warmth is not None:
                        runs[-1]["page_cache_before"] = warmth.cached_before
                cached = runs[-1].get("page_cache_before")
                print(
                    f"  {system.name}: {length}-token prefixes, {concurrency} in flight: "
                    f"TTFT p50 {runs[-1]['ttft_p50_s']:.3f} s (last round; UCM's loads "
                    f"{1000 * runs[-1]['ucm_load_s'] / bench.args.prefixes:.1f} ms a request, "
                    f"steps waited "
                    f"{1000 * runs[-1]['ucm_load_wait_s'] / bench.args.prefixes:.1f} ms"
                    + ("" if cached is None else f"; its files {cached:.0%} in the page cache "
                       "before they were read in")
                    + ")",
                    file=sys.stderr,
                )  # fmt: skip
    except RuntimeError as exc:
        return {"system": system.name, "ran": ran, "refused": str(exc)[-600:], "runs": runs}
    finally:
        if server is not None:
            server.stop()
        if system.sidecar is not None:
            system.sidecar.stop()
    return {"system": system.name, "ran": ran, "runs": runs}


def start_system(system: System, bench: Bench) -> ServeProcess:
    """``system``'s server ready for pass 2: pass 1 run on it (where it keeps something),
    restarted and warmed up (where it has a store)."""
    keeps = system.name != "vllm"
    server = bench.start(system, 0)
    try:
        if keeps:
            for length in bench.args.lengths:
                bench.client(server, length, 1, Path(bench.work, "pass1.json"))
            print(f"  {system.name}: pass 1 done", file=sys.stderr)
        if keeps and not system.floor:
            server.stop()
            server = bench.start(system, 1)
            _warm_up(bench, server)
    except BaseException:
        server.stop()
        raise
    return server


def _timed(
    bench: Bench,
    server: ServeProcess,
    name: str,
    length: int,
    concurrency: int,
    beside: str | None = None,
) -> dict[str, Any]:
    """One timed run of pass 2 on ``server`` (system ``name``): its figures and the prompt
    tokens it reused; ``beside``: the system whose run follows (a floor's run)."""
    before = server.metrics()
    result = Path(bench.work, f"{name}-{length}-{concurrency}.json")
    figures = bench.client(server, length, concurrency, result)
    after = server.metrics()

    def grew(metric: str) -> float:
        return after.get(metric, 0.0) - before.get(metric, 0.0)

    run = {"system": name, "length": length, "concurrency": concurrency, **figures,
           "reused_tokens": reused_tokens(before, after), "ucm_load_s": grew(LOAD_SECONDS),
           "ucm_load_wait_s": grew(LOAD_WAIT_SECONDS)}  # fmt: skip
    if beside is not None:
        run["beside"] = beside
    return run


def _warm_up(bench: Bench, server: ServeProcess) -> None:
    """A restarted server's first requests pay for first use (the engine's kernels on new
    shapes, the store's first reads into this process), which the floor's server paid in
    pass 1: two prompts of each length that are not the run's (another seed), asked twice,
    the second time from the store, before anything is timed."""
    args = bench.args
    warm = argparse.Namespace(**{**vars(args), "seed": args.seed + WARM_UP_SEED, "prefixes": 2})
    for length in args.lengths:
        for again in (False, True):
            if again:
                server.reset_prefix_cache()
            bench.client(server, length, 1, Path(bench.work, "warm-up.json"), warm)


def run_systems(bench: Bench, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Every system of ``names`` run (:func:`run_system`), beside the floor's server where
    the floor is one of them; what each ran, its runs, or why it did not start.  The run's
    folder and host stores are removed after."""
    floor: ServeProcess | None = None
    try:
        others = list(names)
        if "vllm-floor" in names and len(names) > 1:
            # the floor's server serves pass 2 beside every other system's (see --rounds)
            print("[vllm-floor]", file=sys.stderr)
            floor_system = make_system("vllm-floor", bench.work, bench.args.block_tokens, 0)
            floor = start_system(floor_system, bench)
            others = [n for n in names if n != "vllm-floor"]
        results = run_each(others, bench.work, bench.args,
                           lambda system: run_system(system, bench, floor))  # fmt: skip
        if floor is not None:
            results["vllm-floor"] = {"ran": describe(floor_system, bench.common)}
    finally:
        if floor is not None:
            floor.stop()
        shutil.rmtree(bench.work, ignore_errors=True)
        remove_host_stores()
    return results


def _setting(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``--ucm-setting``: the value as JSON where it parses, else a
    string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None, starters: Starters | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--lengths", type=_csv_ints, default=[512, 2048, 8192],
                   help="prefix lengths in tokens")  # fmt: skip
    p.add_argument("--prefixes", type=int, default=8, help="prompts of each length")
    p.add_argument("--suffix", type=int, default=64, help="tokens after each prefix")
    p.add_argument("--output", type=int, default=4, help="tokens generated per request")
    p.add_argument("--concurrency", type=_csv_ints, default=[1, 4],
                   help="requests in flight in pass 2 (a run for each)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of pass 2 a system, length and concurrency, each beside one of "
                        "the floor's")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="auto: bfloat16 where the CPU has AVX512-BF16 or AMX, else float32",
    )  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=BLOCK_SIZE, help="UCM's block_tokens")
    p.add_argument("--lmcache-chunk-tokens", type=int, default=BLOCK_SIZE)
    p.add_argument("--store-cpus", default="spare", help="UCM's store_cpus")
    p.add_argument(
        "--ucm-setting", dest="ucm_settings", action="append", type=_setting, default=[],
        metavar="NAME=VALUE",
        help="another of UCM's settings, its value in JSON (or a string), for every UCM "
        "system: --ucm-setting layer_wise_loads=false",
    )  # fmt: skip
    p.add_argument("--lmcache-python", default=None,
                   help="the interpreter of an environment with LMCache")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument(
        "--fork-client", action=argparse.BooleanOptionalAction, default=True,
        help="start each run of vLLM's client as a fork of a process that imported it once "
        "(--no-fork-client: a new interpreter each run, 23 s of imports here)",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.ucm_settings = dict(args.ucm_settings)
    names = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    _, flags = cpuinfo()
    torch_dtype = dtype(args.dtype, flags)
    tokens = args.prefixes * sum(length + args.suffix + args.output for length in args.lengths)
    settings = {
        "lengths": args.lengths, "prefixes": args.prefixes, "suffix": args.suffix,
        "output": args.output, "concurrency": args.concurrency, "seed": args.seed,
        "rounds": args.rounds,
        "dtype": torch_dtype, "model": MODEL, "block_size": BLOCK_SIZE,
        "ucm_block_tokens": args.block_tokens, "lmcache_chunk_tokens": args.lmcache_chunk_tokens,
        "ucm_settings": args.ucm_settings,
        "systems": names, "machine": machine(),
        "cpu": sorted(flags & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "kv_space_gib": kv_space_gib(MODEL, torch_dtype, tokens),
    }  # fmt: skip
    print(json.dumps(settings, indent=1), file=sys.stderr)
    from ucm.lab.testing.vllm.models import make_word_tokenizer

    work = tempfile.mkdtemp(prefix="ucm-bench-peer-")
    model = os.path.join(work, "model")
    os.makedirs(model)
    Path(model, "config.json").write_text(json.dumps({**MODEL, "torch_dtype": torch_dtype}))
    tokenizer = str(make_word_tokenizer(os.path.join(work, "tokenizer"), MODEL["vocab_size"]))
    common = serve_args(args, torch_dtype, tokenizer)
    env = {
        **engine_env(), **QUIET_ENV, "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(settings["kv_space_gib"]),
    }  # fmt: skip
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if starters is None:
            forked = args.fork_client and stack.enter_context(forked_client())
            starters = Starters(client=forked) if forked else Starters()
        bench = Bench(args, common, env, work, model, tokenizer, starters)
        results = run_systems(bench, names)
    raw = [run for r in results.values() for run in r.get("runs", [])]
    runs = rows(raw)
    report = {
        "settings": settings,
        "runs": runs,
        "rounds": raw,
        "refused": {n: r["refused"] for n, r in results.items() if "refused" in r},
        "ran": {n: r["ran"] for n, r in results.items() if "ran" in r},
        **{f"against_{b}": ratios(raw, b) for b in BASELINES},
        "reuse_differs": check_reuse(raw, args.prefixes),
        "seconds": time.monotonic() - started,
    }
    print("\n" + markdown(raw), file=sys.stderr)
    for line in report["reuse_differs"]:
        print(f"reuse differs: {line}", file=sys.stderr)
    for name, why in report["refused"].items():
        print(f"{name}: refused to start: {why}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 1 if report["reuse_differs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
