"""Connector statistics: counters summed across workers, gauges from the scheduler, logged
with vLLM's stats and exported to Prometheus (see :mod:`ucm.vllm.counters` for the names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ucm.vllm.counters import CAUSES, COUNTERS, FIELDS, GAUGES

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
        for name in GAUGES:  # sampled: the newer wins
            if name in other.data:
                self.data[name] = other.data[name]
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM logs: the counters that moved, and the gauges."""
        moved = {name: self.data[name] for name in FIELDS if self.data[name]}
        return {**moved, **{name: self.data[name] for name in GAUGES if name in self.data}}

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in FIELDS) and not any(
            name in self.data for name in GAUGES
        )


def metric_name(name: str) -> str:
    """The Prometheus name of counter or gauge ``name`` (counters gain ``_total`` when
    exposed)."""
    return f"vllm:ucm_{name}"


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
                name=metric_name(name),
                documentation=doc,
                labelnames=[*labelnames, "cause"] if name in CAUSES else labelnames,
            )
            for name, doc in COUNTERS.items()
        }
        self.gauges = {
            name: self._gauge_cls(
                name=metric_name(name),
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for name, doc in GAUGES.items()
        }
        # Every counter's series from zero, so that a dashboard or an alert sees a rate of
        # 0 rather than no data before the first error.
        for labels in per_engine_labelvalues.values():
            for name, counter in self.counters.items():
                for cause in CAUSES.get(name, [None]):
                    counter.labels(*labels, *([cause] if cause else []))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for field in FIELDS:
            value = transfer_stats_data.get(field, 0)
            if value:
                name, _, cause = field.partition(":")
                self.counters[name].labels(*labels, *([cause] if cause else [])).inc(value)
        for name, gauge in self.gauges.items():
            if name in transfer_stats_data:
                gauge.labels(*labels).set(transfer_stats_data[name])
