"""The connector's metrics, kept by each side (scheduler and workers) without vLLM.

Counters are summed across the workers and the scheduler; gauges come from the scheduler
alone (the store as a whole, sampled) and the newest value wins.  :mod:`ucm.vllm.stats`
exports both to vLLM's log and to Prometheus as ``vllm:ucm_<name>`` (counters get vLLM's
``_total`` suffix).  A counter with causes is one Prometheus counter with a ``cause``
label; in the data that travels from the workers it is one field per cause, ``name:cause``.
"""

from __future__ import annotations

from collections.abc import Iterator

#: counter name -> Prometheus documentation
COUNTERS = {
    "lookup_requests": "Requests looked up in the UCM store",
    "lookup_tokens": "Prompt tokens looked up in the store (those vLLM did not hold itself)",
    "lookup_hit_tokens": "Tokens found in the store beyond what vLLM held, and loaded",
    "lookup_errors": "Store lookups that failed (counted as misses)",
    "loaded_blocks": "Store blocks loaded into the KV cache",
    "loaded_bytes": "Bytes loaded from the store",
    "load_seconds": "Seconds spent loading (store read and scatter)",
    "load_wait_seconds": "Seconds engine steps waited for sync loads: before the forward "
    "pass, in it for layers still being copied, and for their checks after it",
    "load_errors": "Store blocks that failed to load, by cause (vLLM recomputes them)",
    "layered_loads": "Sync loads copied a layer at a time beside the forward pass reading them",
    "dumped_blocks": "Store blocks written (or found already stored)",
    "dumped_bytes": "Bytes handed to the store for writing",
    "dump_seconds": "Seconds spent gathering blocks for dumps (the write itself is async)",
    "dump_errors": "Store blocks whose write failed, by cause",
    "evicted_blocks": "Blocks the engine's workers evicted from the store to make room",
}

#: counters counted by cause -> the causes
CAUSES = {
    # a store's result (miss, corrupt, error, cancelled), no answer within load_timeout_s
    # or no store, a block after one that failed (a hit is a prefix), an async load
    # planned before vLLM reset its prefix cache, or a layered load of a step in which vLLM
    # did not wait for every layer
    "load_errors": (
        "miss",
        "corrupt",
        "error",
        "cancelled",
        "no_answer",
        "after_failed",
        "reset",
        "not_awaited",
    ),
    # a store's result, or the store refused the batch outright
    "dump_errors": ("error", "cancelled", "unavailable"),
}

#: gauge name -> Prometheus documentation
GAUGES = {
    "store_up": "1 while the store answers (a Mooncake master reachable), 0 when it does not",
    "store_bytes": "Bytes in the store (not reported for mooncake: see the master's metrics)",
    "store_blocks": "Blocks in the store (not reported for mooncake)",
    "store_capacity_bytes": "The store's capacity in bytes (absent when it has no limit)",
}


def counter_fields() -> Iterator[str]:
    """Every counter field of the data: plain counters, and ``name:cause`` for each cause."""
    for name in COUNTERS:
        if name in CAUSES:
            yield from (f"{name}:{cause}" for cause in CAUSES[name])
        else:
            yield name


FIELDS = tuple(counter_fields())


class Counters:
    """Every counter field of :data:`FIELDS`, from zero."""

    def __init__(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(FIELDS, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] += value

    def add_cause(self, name: str, cause: str, count: float = 1) -> None:
        """Count ``count`` of counter ``name`` (one of :data:`CAUSES`) under ``cause``."""
        self.data[f"{name}:{cause}"] += count

    def take(self) -> dict[str, float] | None:
        """The counts so far, zeroing them (None when nothing happened)."""
        if not any(self.data.values()):
            return None
        out, self.data = self.data, dict.fromkeys(FIELDS, 0)
        return out
