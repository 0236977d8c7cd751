"""Connector statistics: counters summed across workers, logged and exported to Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ucm.vllm.counters import FIELDS

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class UCMStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

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
