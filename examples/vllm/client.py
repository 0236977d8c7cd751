"""Ask a vLLM server with UCM a question about a long document, and show what UCM did.

    python examples/vllm/client.py --base-url http://localhost:8000 [--document FILE]

The document is the prompt's long prefix. Run it against a fresh server: the prefix is
computed and UCM stores its KV. Restart the server (or ask another one on the same store)
and run it again: ``cached tokens`` now counts the prefix, loaded from the store instead of
computed, and the server's UCM counters say how many tokens the store gave.

Start the server with ``--enable-prompt-tokens-details`` to see cached tokens per request.
``--expect-hit`` exits 1 unless the store gave this server some tokens (for scripts).
Needs the ``openai`` package (vLLM depends on it).
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

from openai import OpenAI

#: the server's UCM metrics this prints (Prometheus names; see docs/vllm.md, Metrics)
SHOWN = (
    "vllm:ucm_lookup_hit_tokens_total",
    "vllm:ucm_loaded_blocks_total",
    "vllm:ucm_dumped_blocks_total",
    "vllm:ucm_load_errors_total",
    "vllm:ucm_store_up",
    "vllm:ucm_store_bytes",
)

DOCUMENT = " ".join(
    f"Section {i}: the store keeps the KV cache of every prompt prefix it has seen, so that "
    f"an engine that meets the prefix again loads it rather than computing it."
    for i in range(200)
)


def metrics(base_url: str) -> dict[str, float]:
    """The server's ``vllm:ucm_*`` samples, summed over their labels."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:ucm_"):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://localhost:8000")
    parser.add_argument("--model", help="the served model's name (default: the server's first)")
    parser.add_argument("--document", type=Path, help="a text file: the prompt's long prefix")
    parser.add_argument("--question", default="What does the store keep?")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--expect-hit", action="store_true", help="exit 1 unless the store gave tokens"
    )
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300)
    model = args.model or client.models.list().data[0].id
    document = args.document.read_text() if args.document else DOCUMENT
    answer = client.completions.create(
        model=model,
        prompt=f"{document}\n\nQuestion: {args.question}\nAnswer:",
        max_tokens=args.max_tokens,
        temperature=0,
    )
    usage = answer.usage
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details else None
    print(f"answer: {answer.choices[0].text.strip()!r}")
    print(f"prompt tokens: {usage.prompt_tokens}; cached tokens: {cached}")
    found = metrics(base)
    for name in SHOWN:
        if name in found:
            print(f"{name} {found[name]:g}")
    if args.expect_hit and not found.get("vllm:ucm_lookup_hit_tokens_total"):
        print("no tokens came from the store", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
