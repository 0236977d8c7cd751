"""Drive an OpenAI-compatible server with a multi-round workload, as its users would.

Each user asks its rounds in turn, the next once the answer to the last has arrived; all
users share a limit on requests started per second and on requests in flight.  Every
request streams, so the time to its first token is measured where a user sees it: the
first chunk of the answer arriving at the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import attrs
from ucm.lab.vllm.multiround import MultiRoundWorkload


@attrs.frozen
class Record:
    """One request as the client saw it."""

    user: int
    round: int
    prompt_tokens: int
    started_s: float  # since the run began
    ttft_s: float | None  # None: the request failed
    latency_s: float | None
    cached_tokens: int
    error: str | None = None


class StartLimiter:
    """At most ``rate`` starts per second, evenly spaced."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.next = time.monotonic()
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        async with self.lock:
            now = time.monotonic()
            if self.next > now:
                await asyncio.sleep(self.next - now)
            self.next = max(now, self.next) + self.interval


async def one_request(
    client: Any, url: str, model: str, prompt: list[int], answer_tokens: int
) -> tuple[float, float, int]:
    """(time to first token, latency, cached prompt tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    cached = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or cached)
    latency = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, latency, cached


async def drive(
    url: str,
    model: str,
    workload: MultiRoundWorkload,
    rounds: Sequence[int],
    *,
    max_in_flight: int,
    timeout_s: float = 600.0,
) -> list[Record]:
    """Every user's ``rounds`` against the server at ``url``; a record per request."""
    import httpx

    limiter = StartLimiter(workload.request_rate)
    in_flight = asyncio.Semaphore(max_in_flight)
    records: list[Record] = []
    began = time.monotonic()
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def user(u: int) -> None:
            for r in rounds:
                prompt = workload.prompt(u, r)
                await limiter.wait()
                async with in_flight:
                    started = time.monotonic() - began
                    try:
                        ttft, latency, cached = await one_request(
                            client, url, model, prompt, workload.answer_tokens
                        )
                        records.append(Record(u, r, len(prompt), started, ttft, latency, cached))
                    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                        error = f"{type(exc).__name__}: {exc}"
                        records.append(Record(u, r, len(prompt), started, None, None, 0, error))

        await asyncio.gather(*(user(u) for u in range(workload.users)))
    return sorted(records, key=lambda rec: (rec.round, rec.started_s))
