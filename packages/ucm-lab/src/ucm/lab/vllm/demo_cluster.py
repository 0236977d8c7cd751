"""The cluster demo: two vLLM hosts sharing KV through one Mooncake Store cluster.

    python -m ucm.lab.vllm.demo_cluster [--tokens 4096]

Three hosts are made as network namespaces on a bridge (root and iproute2 needed): host m
runs a ``mooncake_master`` and a segment server (the pool's memory), host a runs an engine
that computes a long prompt's prefill and stores its KV, host b a fresh engine that loads it
over the network instead.  Prints A's cold and B's warm time to first token and B's hit
tokens, then stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from ucm.lab.vllm.demo import run_child, write_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    args = parser.parse_args(argv)
    from ucm.lab.mooncake import LocalMaster, SegmentServer
    from ucm.lab.netlab import NetLab, unavailable

    reason = unavailable()
    if reason:
        raise SystemExit(f"the cluster demo makes hosts as network namespaces: {reason}")
    work = tempfile.mkdtemp(prefix="ucm-cluster-demo-")
    model = write_model(os.path.join(work, "model"))
    try:
        with NetLab(["m", "a", "b"]) as lab:
            m = lab.namespace("m")
            master = LocalMaster(lab.address("m"), netns=m, log_path=f"{work}/master.log")
            with master:
                segment = SegmentServer(
                    master.address, 1024, lab.address("m"), netns=m, log_path=f"{work}/seg.log"
                )
                with segment:
                    # the engines give the pool no memory: it is on host m
                    store = {"kind": "mooncake", "master": master.address, "global_segment_gb": 0}
                    print(
                        f"UCM + vLLM cluster demo: master and 1 GiB of pool on host m "
                        f"({lab.address('m')}), engines on hosts a ({lab.address('a')}) and b "
                        f"({lab.address('b')}); {args.tokens}-token prompt, Llama 2048x4"
                    )
                    cold = _engine(lab, "a", model, store, args.tokens)
                    print(
                        f"host a, cold: time to first token {cold['ttft_s']:.2f} s, "
                        f"{cold['cached_tokens']} tokens reused; KV stored in the cluster"
                    )
                    warm = _engine(lab, "b", model, store, args.tokens)
                    print(
                        f"host b, warm (fresh engine): time to first token {warm['ttft_s']:.2f} s, "
                        f"{warm['cached_tokens']} tokens loaded from the cluster"
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = warm["output"] == cold["output"]
    ratio = warm["ttft_s"] / cold["ttft_s"]
    print(f"warm/cold time to first token: {ratio:.3f} ({1 / ratio:.1f}x); outputs match: {same}")
    ok = same and warm["cached_tokens"] >= 0.9 * args.tokens
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def _engine(lab, host: str, model: str, store: dict, tokens: int) -> dict:
    print(f"starting an engine on host {host} ...", flush=True)
    return run_child(
        "ucm.lab.vllm.demo", "--model", model, "--path", json.dumps(store), "--tokens", str(tokens),
        prefix=lab.command(host, []),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
