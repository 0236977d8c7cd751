"""The connector's counters, kept by each side (scheduler and workers) without vLLM: summed
across workers and exported by :mod:`ucm.vllm.stats`."""

from __future__ import annotations

#: name -> Prometheus documentation; every field is a counter.
FIELDS = {
    "lookup_hit_tokens": "Tokens found in the UCM store beyond what vLLM held",
    "loaded_blocks": "Store blocks loaded into the KV cache",
    "loaded_bytes": "Bytes loaded from the store",
    "load_seconds": "Seconds spent loading (store read and scatter)",
    "load_errors": "Store blocks that failed to load (missing, corrupt or unreadable)",
    "dumped_blocks": "Store blocks written (or found already stored)",
    "dumped_bytes": "Bytes handed to the store for writing",
    "dump_seconds": "Seconds spent gathering blocks for dumps (the write itself is async)",
    "dump_errors": "Store blocks whose write failed",
}


class Counters:
    """Every counter of :data:`FIELDS`, from zero."""

    def __init__(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(FIELDS, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] += value

    def take(self) -> dict[str, float] | None:
        """The counts so far, zeroing them (None when nothing happened)."""
        if not any(self.data.values()):
            return None
        out, self.data = self.data, dict.fromkeys(FIELDS, 0)
        return out
