"""The core on its own: a cold process stores KV blocks, a fresh process reuses them.

Until an engine adapter drives it, the "model" here is a stand-in: the KV bytes of a
block are a deterministic function of the token prefix that ends there (as real KV is),
generated at a fixed cost per block.  What is real is everything UCM does: prefix keys,
the posix store on disk, verification on load, and reuse across processes.

    python -m ucm.lab.core.demo [--path DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ucm.core.config import PosixStoreConfig
from ucm.core.keys import Namespace, block_keys
from ucm.core.store import PosixStore

BLOCK_TOKENS = 256
BLOCK_BYTES = 1 << 20  # e.g. 256 tokens x 2 layers x 8 heads x 128 dims x K,V x bf16
NAMESPACE = Namespace(model="demo-model@v1:bf16", layout="demo:[2,8,256,2,128]:bf16")


def prompts() -> list[list[int]]:
    """Four prompts: a shared 3072-token system prompt, each with its own 512-token question."""
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(3072)]
    return [system + [rng.randrange(32000) for _ in range(512)] for _ in range(4)]


def compute_kv(key: bytes) -> bytes:
    """The stand-in prefill of one block: bytes determined by the prefix (through its key)."""
    return random.Random(key).randbytes(BLOCK_BYTES)


def run_role(path: str) -> dict[str, Any]:
    store = PosixStore(PosixStoreConfig(path=path))
    rows: list[dict[str, Any]] = []
    for tokens in prompts():
        keys = block_keys(NAMESPACE, tokens, BLOCK_TOKENS)
        t0 = time.perf_counter()
        hit = store.lookup_prefix(keys)
        buffers = [bytearray(BLOCK_BYTES) for _ in keys[:hit]]
        results = store.wait(store.load(keys[:hit], buffers))
        loaded = next((i for i, r in enumerate(results) if not r.ok), hit)
        computed = [compute_kv(k) for k in keys[loaded:]]
        elapsed = time.perf_counter() - t0
        store.wait(store.dump(keys[loaded:], computed))
        # Check what was reused against what the "model" would have computed.
        matches = all(bytes(buffers[i]) == compute_kv(keys[i]) for i in range(loaded))
        rows.append(
            {
                "tokens": len(tokens),
                "blocks": len(keys),
                "reused": loaded,
                "computed": len(keys) - loaded,
                "seconds": elapsed,
                "reused_match": matches,
            }
        )
    store.close()
    return {"pid": os.getpid(), "prompts": rows}


def _child(path: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "ucm.lab.core.demo", "--role", "--path", path],
        check=True,
        capture_output=True,
        text=True,
    )
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", help="store directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the store directory")
    parser.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        print(json.dumps(run_role(args.path)))
        return 0
    path = args.path or tempfile.mkdtemp(prefix="ucm-demo-")
    print(
        f"UCM core demo: store at {path}; "
        f"block = {BLOCK_TOKENS} tokens, {BLOCK_BYTES >> 20} MiB of KV"
    )
    print("(the KV bytes come from a stand-in for a model; the vLLM connector will replace it)\n")
    ok = True
    try:
        for name in ("cold", "warm"):
            report = _child(path)
            print(f"{name} process (pid {report['pid']}):")
            for i, p in enumerate(report["prompts"]):
                print(
                    f"  prompt {i}: {p['tokens']} tokens, {p['blocks']} blocks: "
                    f"{p['reused']} reused from the store, {p['computed']} computed, "
                    f"{p['seconds'] * 1e3:.0f} ms; reused KV identical: {p['reused_match']}"
                )
                ok &= bool(p["reused_match"])
            reused = sum(p["reused"] for p in report["prompts"])
            total = sum(p["blocks"] for p in report["prompts"])
            print(f"  {reused}/{total} blocks reused ({reused * BLOCK_TOKENS} tokens)\n")
        ok &= reused == total
    finally:
        if not args.keep and not args.path:
            shutil.rmtree(path, ignore_errors=True)
    print("OK: the warm process reused every block, and the bytes match" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
