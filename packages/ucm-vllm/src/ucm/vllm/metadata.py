"""What the scheduler tells the workers each step (pickled across the process boundary):
the step's plan (:class:`~ucm.vllm.plan.StepPlan`) as vLLM's connector metadata."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.vllm.plan import StepPlan

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class UCMConnectorMetadata(StepPlan, KVConnectorMetadata):
    pass


__all__ = ["UCMConnectorMetadata"]
