"""What the scheduler tells the workers each step (pickled across the process boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Transfer:
    """Store blocks ``first .. first+len(chain)-1`` of one request, to load or to dump.

    ``chain`` holds the token-chain keys (each rank derives its own scoped keys);
    ``block_ids[g][s]`` lists the engine blocks of group ``g`` holding store block ``s``,
    0 where a block must not be touched (vLLM's null block).
    """

    req_id: str
    first: int
    chain: list[bytes]
    block_ids: list[list[list[int]]]


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    dumps: list[Transfer] = field(default_factory=list)
    # requests whose blocks vLLM keeps until the workers report their dumps done
    delayed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
