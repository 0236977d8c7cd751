"""The demo: vLLM with UCMConnector, a cold process that stores a long prompt's KV and a
fresh warm process that loads it instead of recomputing the prefill.

    python -m ucm.lab.vllm.demo [--path DIR] [--tokens 4096] [--keep]

The model is the benchmark's mid-size Llama (hidden 2048, 4 layers, 8 KV heads) with dummy
weights, so it needs no download: a 4096-token prompt is 32 MiB of KV and a prefill of
several seconds on a CPU.  Both processes run with the same CPU thread settings.
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
from collections.abc import Sequence
from typing import Any

DEMO_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(DEMO_MODEL, f, indent=2)
    return directory


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # the same threads for every run compared
    env.pop("TRITON_INTERPRET", None)
    return env


def store_settings(store: str) -> dict[str, Any]:
    """A posix store's directory, or a store's settings as JSON (``{"kind": ...}``)."""
    if store.lstrip().startswith("{"):
        settings: dict[str, Any] = json.loads(store)
        return settings
    return {"kind": "posix", "path": store}


def make_llm(model: str, store: str | None, max_len: int) -> Any:
    """The engine every demo and benchmark run uses; ``store=None``: no connector."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": store_settings(store)},
        }
    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        gpu_memory_utilization=0.3,
        seed=0,
        **kwargs,
    )


def random_prompt(tokens: int, seed: int) -> Any:
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return TokensPrompt(prompt_token_ids=[rng.randrange(3, 32000) for _ in range(tokens)])


def serve_once(
    model: str, store: str | None, tokens: int, max_tokens: int = 8
) -> dict[str, object]:
    """One engine process: time to first token of the prompt, the full output, and the time
    to first token of the same prompt again (vLLM's own prefix cache: the floor)."""
    from vllm import SamplingParams

    llm = make_llm(model, store, tokens + 64)
    first_token = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    # Warm the engine up on an unrelated short prompt, so that the timing is the prefill's.
    llm.generate([random_prompt(64, seed=1)], first_token, use_tqdm=False)
    prompt = random_prompt(tokens, seed=0)
    t0 = time.perf_counter()
    first = llm.generate([prompt], first_token, use_tqdm=False)
    ttft = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False)
    full = llm.generate([prompt], params, use_tqdm=False)[0]
    t0 = time.perf_counter()
    llm.generate([prompt], first_token, use_tqdm=False)
    floor = time.perf_counter() - t0
    return {
        "ttft_s": ttft,
        "floor_s": floor,
        "cached_tokens": first[0].num_cached_tokens,
        "prompt_tokens": tokens,
        "output": list(full.outputs[0].token_ids),
    }


def run_child(
    module: str, *args: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``python -m module --role ARGS`` in a fresh process (wrapped in ``prefix``, such as
    ``ip netns exec HOST``; in ``env``, ``engine_env()`` by default); its ``RESULT`` line as
    a dict."""
    cmd = [*prefix, sys.executable, "-m", module, "--role", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or engine_env())
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    sys.stderr.write(proc.stderr[-5000:])
    raise SystemExit(f"the engine process failed (exit {proc.returncode})")


def _child(model: str, store: str, tokens: int) -> dict[str, Any]:
    return run_child(
        "ucm.lab.vllm.demo", "--model", model, "--path", store, "--tokens", str(tokens)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", help="store directory (default: a temporary one)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    parser.add_argument("--keep", action="store_true", help="keep the store directory")
    parser.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        print("RESULT " + json.dumps(serve_once(args.model, args.path, args.tokens)), flush=True)
        return 0
    work = tempfile.mkdtemp(prefix="ucm-vllm-demo-")
    store = args.path or os.path.join(work, "store")
    model = write_model(os.path.join(work, "model"))
    print(
        f"UCM + vLLM demo: {args.tokens}-token prompt, Llama 2048x4 (dummy weights), "
        f"store at {store}"
    )
    try:
        print("cold process: computing the prefill and storing its KV ...", flush=True)
        cold = _child(model, store, args.tokens)
        print(
            f"  time to first token {cold['ttft_s']:.2f} s, {cold['cached_tokens']} tokens reused"
        )
        print("warm process (fresh engine, nothing in vLLM's own cache) ...", flush=True)
        warm = _child(model, store, args.tokens)
        print(
            f"  time to first token {warm['ttft_s']:.2f} s, {warm['cached_tokens']} tokens reused "
            f"from the store"
        )
        same = warm["output"] == cold["output"]
        speedup = cold["ttft_s"] / warm["ttft_s"] if warm["ttft_s"] else float("inf")  # type: ignore[operator]
        print(
            f"warm/cold time to first token: {1 / speedup:.3f} ({speedup:.1f}x faster); "
            f"outputs match: {same}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = same and warm["cached_tokens"] >= 0.9 * args.tokens  # type: ignore[operator]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
