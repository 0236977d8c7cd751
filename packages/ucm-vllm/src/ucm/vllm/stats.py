"""Connector statistics: counters summed across workers, logged and exported to Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

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


@dataclass
class UCMStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> UCMStats:
        for name in FIELDS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in FIELDS)

    def take(self) -> UCMStats | None:
        """A copy of the counters so far, and zeroes them (None when nothing happened)."""
        if self.is_empty():
            return None
        out = UCMStats(data=dict(self.data))
        self.reset()
        return out


class UCMPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: self._counter_cls(
                name=f"vllm:ucm_{name}",
                documentation=doc,
                labelnames=labelnames,
            )
            for name, doc in FIELDS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self.counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)
