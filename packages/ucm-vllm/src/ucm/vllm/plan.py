"""What moves between the engine and the stores: per request, the blocks of each KV-cache
group to load or dump; per step, the plan the workers carry out (plain data, no vLLM: the
worker side runs on it alone)."""

from __future__ import annotations

from dataclasses import dataclass, field

NULL_BLOCK = 0  # vLLM's block pool reserves block 0; it is never read or written here


#: what a rank reports of a block for KV events (ucm.vllm.events): STORED or DROPPED,
#: with the block's KV-cache group and token-chain key
Report = tuple[str, int, bytes]
STORED, DROPPED = "stored", "dropped"


@dataclass
class Item:
    """One stored block of one KV-cache group: a full-attention block or a window tail.

    ``key``: its index in the request's token chain, ``chain_key`` that key (each rank
    derives its own scoped key from it); ``block_ids``: the engine blocks forming its payload,
    in order, 0 where a block must not be touched (vLLM's null block, or a block vLLM already
    holds, which may be shared with running requests).
    """

    group: int
    key: int
    chain_key: bytes
    block_ids: list[int]


@dataclass
class Transfer:
    """Blocks of one request to load or to dump, full-attention ones in key order first."""

    req_id: str
    items: list[Item]

    def keys(self, group: int) -> list[int]:
        return [item.key for item in self.items if item.group == group]


@dataclass
class StepPlan:
    """What the scheduler side tells the workers each step: the loads and dumps to start,
    requests whose blocks vLLM keeps until their dumps are done, preempted requests.
    vLLM's metadata class (:mod:`ucm.vllm.metadata`) is this plan; the worker side needs
    only the plan."""

    loads: list[Transfer] = field(default_factory=list)
    dumps: list[Transfer] = field(default_factory=list)
    # requests whose blocks vLLM keeps until the workers report their dumps done
    delayed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # vLLM reset its prefix cache with the connector's since the last step (``on_reset``:
    # "forget" or "remove"; "" for none): async loads of these requests, planned before it,
    # fail (vLLM recomputes them), and with "remove" each rank removes what it stored
    reset: str = ""
    reset_loads: list[str] = field(default_factory=list)
