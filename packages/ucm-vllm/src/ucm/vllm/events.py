"""KV events for routers: a ``BlockStored`` once a block is in UCM's store, a ``BlockRemoved``
once this engine found it corrupt and dropped it.

A KV-aware router (llm-d's prefix-cache scorer, Dynamo's router) learns where blocks live
from the KV events vLLM publishes with ``--kv-events-config``.  vLLM publishes its own
cache's events; a connector adds its own: each worker returns what it did in a step
(``build_connector_worker_meta``), vLLM aggregates the workers' returns into one object
for the scheduler (``update_connector_output``), and the scheduler hands events to the
publisher (``take_events``).

A block is in the store only once every rank that writes it has written its shard (each
rank its own shard; of a cache replicated on every rank, one rank each block), so the
workers report the blocks they stored (:class:`StoredReport`) and the scheduler counts the
reports (:class:`StoredBlocks`) until each block's writers are all in.  The event names the
block the way vLLM's own events do (its block hashes, tokens and block size: made by
:class:`StoredEvents` when the dump is planned), so a router matches it against the prompts
it sees.

A block leaves the store when a load finds it corrupt (the rank that read it drops it) or
when this engine's own dumps evict it to make room (the store tells the rank that watched
it: ``Store.watch_evictions``).  That rank reports it dropped, and the scheduler announces
its removal at once: the block is no longer loadable as a whole.

What a router cannot learn from these: blocks evicted by other engines of a shared store
or by a remote pool itself (Mooncake's master), and blocks other engines stored, are not
announced by this engine (docs: vllm.md, KV events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from ucm.core.config import StoreSettings
from ucm.vllm.layout import ModelLayout
from ucm.vllm.plan import DROPPED, Item, Report

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _external

#: blocks waiting for their reports, at most, of dumps and of loads each (the oldest are
#: forgotten: a dump that failed on a rank never reports, a load that went well neither)
PENDING_LIMIT = 100_000

#: (KV-cache group index, the block's token-chain key): one block as the ranks report it
BlockName = tuple[int, bytes]


class StoredReport(KVConnectorWorkerMetadata):
    """What a rank stored or dropped in one step (``build_connector_worker_meta``), and
    what vLLM makes of the ranks' reports (``aggregate``): each rank's :data:`Report` s (a
    block written by two ranks appears twice).  Worker metadata rather than KV-cache
    events: vLLM 0.33 keeps the metadata of a failed worker whose outputs it salvages, and
    drops its events.  Falsy when empty: vLLM then leaves it out."""

    def __init__(self, reports: Iterable[Report] = ()) -> None:
        self.reports: list[Report] = list(reports)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StoredReport:
        return StoredReport([*self.reports, *getattr(other, "reports", ())])

    def __len__(self) -> int:
        return len(self.reports)

    def __repr__(self) -> str:
        return f"StoredReport({len(self.reports)} reports)"


class StoredBlocks:
    """The scheduler's count of the ranks' reports: a block's ``BlockStored`` is released
    once as many ranks as write it (``writers[group]``) reported it stored, its
    ``BlockRemoved`` as soon as one rank reports it dropped.

    ``expect`` is called when a dump is planned, with the events to publish once it is
    stored and once it is gone; ``removable`` when a load is planned; a block reported
    without being expected (planned before a restart, or forgotten) is ignored."""

    def __init__(self, writers: Mapping[int, int], limit: int = PENDING_LIMIT) -> None:
        self.writers = dict(writers)
        self.limit = limit
        # [stored event, removed event, reports]
        self._pending: OrderedDict[BlockName, list[Any]] = OrderedDict()
        self._removable: OrderedDict[BlockName, KVCacheEvent] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def expect(self, name: BlockName, stored: KVCacheEvent, removed: KVCacheEvent) -> None:
        if name[0] not in self.writers or name in self._pending:
            return  # a group not announced, or a block planned twice: one event
        self._pending[name] = [stored, removed, 0]
        while len(self._pending) > self.limit:
            self._pending.popitem(last=False)

    def removable(self, name: BlockName, event: KVCacheEvent) -> None:
        if name[0] not in self.writers:
            return
        self._removable[name] = event
        self._removable.move_to_end(name)
        while len(self._removable) > self.limit:
            self._removable.popitem(last=False)

    def report(self, reports: Iterable[Report]) -> None:
        for kind, group, key in reports:
            name = (group, key)
            if kind == DROPPED:
                removed = self._removable.pop(name, None)
                if removed is not None:
                    self._ready.append(removed)
                continue
            entry = self._pending.get(name)
            if entry is None:
                continue
            entry[2] += 1
            if entry[2] >= self.writers[name[0]]:
                del self._pending[name]
                self._ready.append(entry[0])
                self.removable(name, entry[1])  # announced: its eviction is announced too

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready

    def forget_all(self) -> None:
        """The engine no longer loads any block stored so far (a reset): every block
        announced is announced removed, and the reports still expected are ignored."""
        self._ready.extend(self._removable.values())
        self._removable.clear()
        self._pending.clear()

    @property
    def pending(self) -> int:
        return len(self._pending)


class StoredEvents:
    """The scheduler's half of KV events (:mod:`ucm.vllm.events`): each full-attention block
    planned for a dump, named as vLLM names it, released once every rank stored it; each
    planned for a load, announced removed if a rank finds it corrupt."""

    def __init__(self, layout: ModelLayout, hash_block_size: int, medium: str) -> None:
        self.hash_block_size = hash_block_size
        self.medium = medium
        # the full-attention groups, each with the number of ranks that write a block
        self.blocks = StoredBlocks(
            {g.index: 1 if g.replicated else layout.world_size for g in layout.groups
             if g.kind == "full"}
        )  # fmt: skip

    def _named(
        self, request: Any, items: list[Item], tokens: int
    ) -> list[tuple[Item, list[Any], Any]]:
        """(item, vLLM's hashes of its block, the hash before them) of each full-attention
        item that vLLM's hashes name."""
        per, rest = divmod(tokens, self.hash_block_size)  # vLLM's hashes in one stored block
        if rest or per < 1:
            return []  # a stored block that ends inside one of vLLM's: no hashes name it
        hashes = getattr(request, "block_hashes", ())
        named = []
        for it in items:
            first = it.key * per
            if it.group in self.blocks.writers and first + per <= len(hashes):
                block = [_external(h) for h in hashes[first : first + per]]
                named.append((it, block, _external(hashes[first - 1]) if first else None))
        return named

    def expect(self, request: Any, items: list[Item], tokens: int) -> None:
        """Dumps planned: their ``BlockStored``, released once every writer reports (and
        their ``BlockRemoved``, should one be evicted or dropped after that)."""
        lora = getattr(request, "lora_request", None)
        for it, block, parent in self._named(request, items, tokens):
            self.blocks.expect(
                (it.group, it.chain_key),
                BlockStored(
                    block_hashes=block,
                    parent_block_hash=parent,
                    token_ids=list(request.prompt_token_ids[it.key * tokens :][:tokens]),
                    block_size=self.hash_block_size,
                    lora_id=getattr(lora, "lora_int_id", None),
                    medium=self.medium,
                    lora_name=getattr(lora, "lora_name", None),
                    group_idx=it.group,
                    ownership="ucm",
                ),
                self._removed(it, block),
            )

    def _removed(self, item: Item, block: list[Any]) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=block, medium=self.medium, group_idx=item.group, ownership="ucm"
        )

    def loading(self, request: Any, items: list[Item], tokens: int) -> None:
        """Loads planned: the ``BlockRemoved`` of each, should a rank find it corrupt."""
        for it, block, _ in self._named(request, items, tokens):
            self.blocks.removable((it.group, it.chain_key), self._removed(it, block))


def medium_of(store: StoreSettings) -> str:
    """The tier a block lands in first, as vLLM's event ``medium`` names tiers: host memory
    (``CPU``: a dram store, a tiered store with a dram front), else ``STORAGE``."""
    return "CPU" if store.in_host_memory else "STORAGE"
