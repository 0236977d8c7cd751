"""The scheduler side: store lookups, load plans, dump plans, delayed frees.

Runs in vLLM's engine-core process.  It only looks the stores up; the workers move the data.
What to look up, load and dump comes from the planners of :mod:`ucm.core.hybrid`: for a
model of full-attention groups they reduce to "the longest stored prefix, every new block";
window groups add their tail at block boundaries.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

import attrs
from ucm.core import (
    BlockRef,
    block_keys,
    placed_extras,
    plan_dump,
    plan_load,
    scoped_keys,
    usable_hit,
    wa_lookup_boundaries,
)
from ucm.vllm.counters import Counters
from ucm.vllm.events import StoredEvents
from ucm.vllm.layout import ModelLayout, adapter_files, adapter_identity
from ucm.vllm.metadata import UCMConnectorMetadata
from ucm.vllm.plan import NULL_BLOCK, Item, Transfer
from ucm.vllm.stores import ConnectorStores

log = logging.getLogger(__name__)

#: how long a finished request whose dumps are not reported done makes vLLM wait for its
#: blocks rather than preempt, and keeps an idle engine stepping (each step asks the
#: workers again)
HOLD_S = 120.0


@attrs.define
class RequestState:
    request: Any  # vllm.v1.request.Request
    chain: list[bytes] = attrs.field(factory=list)  # token-chain keys of the prompt's full blocks
    hit: int = 0  # boundaries of the usable store hit, as of the last lookup
    local: int = 0  # tokens vLLM holds itself, as of the last lookup
    next_dump: int = 0  # boundaries planned for dumps so far
    wa_after: int = 0  # boundaries whose window tails vLLM no longer holds (its own hit)
    dumped: bool = False  # any dump planned: its blocks are freed only when the dumps are done
    loaded_to: int = 0  # tokens the last planned load makes computed; 0 once checked
    load_step: bool = False  # scheduled with a sync load this step: no dumps planned in it
    load_failed: bool = False  # a load of this request failed: it is not loaded again
    counted: bool = False  # its lookup is counted (vLLM may ask again while it waits)
    # computed (or loading) when vLLM reset its prefix cache: its KV may be of other
    # weights, so nothing more of it is loaded or dumped
    stale: bool = False

    def settle_load(self, computed: int, block_tokens: int) -> None:
        """Check the last planned load against the tokens vLLM counts as computed.  Short of
        what the load covered, it failed from there: vLLM recomputes those blocks, and they
        are dumped again."""
        if computed < self.loaded_to:
            self.next_dump = min(self.next_dump, computed // block_tokens)
        self.loaded_to = 0


class SchedulerSide:
    def __init__(
        self,
        layout: ModelLayout,
        stores: ConnectorStores | None,
        load_threshold: int,
        sync_loads: bool = False,
        wa_dump_block_wise: bool = True,
        weights_digest: str = "sampled",
        loads: bool = True,
        events: StoredEvents | None = None,
        on_reset: str = "forget",
        aligned_to: int = 1,
    ) -> None:
        self.layout = layout
        self.loads = loads  # False: the engine cannot compute on loaded KV (what is found is
        # only not dumped again)
        self.weights_digest = weights_digest
        # LoRA adapter identities, with the state of the files they were computed from
        self.adapters: dict[tuple[str, str | None], tuple[tuple[Any, ...], str]] = {}
        self.stores = stores
        self.load_threshold = load_threshold
        self.sync_loads = sync_loads
        self.block_wise = wa_dump_block_wise
        self.enabled = stores is not None
        self.dumps = stores is not None and not stores.read_only
        self.requests: dict[str, RequestState] = {}
        self.pending_loads: list[Transfer] = []
        self.pending_dumps: list[Transfer] = []  # of requests that finished, not yet planned
        self.delayed: list[str] = []
        self.stats = Counters()
        self.events = events
        self.on_reset = on_reset
        # where vLLM takes only hits that end on one of its blocks' boundaries (0.33's
        # routed-experts output): its block size; else 1
        self.aligned_to = aligned_to
        # "" until vLLM resets its prefix cache with ours; then a fresh random epoch in
        # every chain key: blocks stored before are never found again by this engine
        self.epoch = ""
        self.reset_pending = ""  # the reset the next step plan tells the workers of
        self.reset_loads: list[str] = []
        # finished requests whose blocks vLLM keeps until their dumps are reported done,
        # and since when
        self.held: dict[str, float] = {}

    # -- keys and lookups --

    def _cacheable(self, request: Any) -> bool:
        # Prompt embeddings are no token ids: nothing names them cheaply (not stored).
        return getattr(request, "prompt_embeds", None) is None and bool(request.prompt_token_ids)

    def _adapter(self, request: Any) -> str:
        """The identity of the request's LoRA adapter ("" without one), computed again
        only when its files changed (an adapter retrained at the same path and reloaded
        under the same name names other blocks)."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return ""
        cache_key = (lora.lora_name, getattr(lora, "lora_path", None))
        files = adapter_files(lora)
        found = self.adapters.get(cache_key)
        if found is None or found[0] != files:
            found = self.adapters[cache_key] = (files, adapter_identity(lora, self.weights_digest))
        return found[1]

    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            state = RequestState(request)
            self.requests[request.request_id] = state
        if not state.chain and not state.stale and self._cacheable(request):
            ns = self.layout.chain_namespace(
                getattr(request, "cache_salt", None), self._adapter(request), self.epoch
            )
            tokens = list(request.prompt_token_ids)
            bt = self.layout.block_tokens
            # multimodal inputs: each item's hash in the blocks its placeholders fall in
            placed = [
                (f.identifier, f.mm_position.offset, f.mm_position.length)
                for f in getattr(request, "mm_features", None) or ()
            ]
            state.chain = block_keys(ns, tokens, bt, extras=placed_extras(placed, len(tokens), bt))
        return state

    def _ranks(self, replicated: bool) -> range:
        return range(1) if replicated else range(self.layout.world_size)

    def _usable_hit(self, chain: list[bytes], floor: int) -> tuple[int, int]:
        """(Boundaries of the usable hit, window tails included, or 0; the prefix stored for
        every full group and rank, whatever vLLM holds: what a dump need not write again)."""
        assert self.stores is not None
        hybrid = self.layout.hybrid
        found = len(chain)
        for group in self.layout.groups:
            if group.kind != "full":
                continue
            for rank in self._ranks(group.replicated):
                if found == 0:
                    return 0, 0
                keys = scoped_keys(chain[:found], self.layout.scope(group, rank))
                found = min(found, self.stores.of(group).lookup_prefix(keys))
        if found <= floor:
            return 0, found
        bounds = wa_lookup_boundaries(hybrid, found, floor)
        wa_stored: dict[int, list[bool]] = {}
        for g in hybrid.tail_groups:
            group = self.layout.groups[g]
            stored = [False] * floor + [True] * len(bounds)
            for rank in self._ranks(group.replicated):
                keys = scoped_keys([chain[b - 1] for b in bounds], self.layout.scope(group, rank))
                present = self.stores.of(group).lookup(keys) if keys else []
                stored[floor:] = [a and b for a, b in zip(stored[floor:], present)]
            wa_stored[g] = stored
        return usable_hit(hybrid, found, wa_stored, floor=floor), found

    def reset(self) -> bool:
        """vLLM reset its prefix cache with ours (weights updated in place, sleep, the
        reset endpoint): with ``forget`` and ``remove``, this engine never loads a block
        stored before (its chain keys move to a new epoch).  A request already computed,
        or with a load under way, holds KV that may be of the old weights: none of it is
        dumped, and an async load in flight fails (vLLM recomputes it); a request still
        waiting starts over under the new epoch.  True: vLLM counts the reset done."""
        if self.on_reset == "keep" or not self.enabled:
            return True
        self.epoch = secrets.token_hex(8)
        for req_id, state in self.requests.items():
            if state.loaded_to or state.request.num_computed_tokens > 0:
                if state.loaded_to and not self.sync_loads:
                    self.reset_loads.append(req_id)
                state.stale, state.chain, state.hit = True, [], 0
            else:  # nothing computed yet: looked up again, under the new epoch
                self.requests[req_id] = RequestState(
                    state.request, dumped=state.dumped, counted=state.counted
                )
        self.reset_pending = self.on_reset
        if self.events is not None:
            self.events.blocks.forget_all()
        log.info(
            "ucm: vLLM reset its prefix cache: blocks stored before are no longer loaded "
            "by this engine (on_reset: %s)",
            self.on_reset,
        )
        return True

    # -- vLLM hooks --

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.enabled:
            return 0, False
        state = self._state(request)
        if state.loaded_to and _preempted(request):
            # Preempted before a step of its own settled the load: vLLM freed the blocks the
            # load filled, whatever became of it, and the request starts over from a fresh
            # lookup.  (Had the load failed, the blocks it would have dumped again are lost.)
            state.loaded_to = 0
        elif state.loaded_to:
            # Asked again before the planned load was ever scheduled: vLLM gave the request
            # back after the load failed.  Retrying could fail the same way forever.
            state.load_failed = True
            state.settle_load(num_computed_tokens, self.layout.block_tokens)
        if not state.chain or state.load_failed:
            return 0, False
        bt = self.layout.block_tokens
        floor = num_computed_tokens // bt
        if not state.counted:
            state.counted = True
            self.stats.add(
                lookup_requests=1, lookup_tokens=max(0, request.num_tokens - num_computed_tokens)
            )
        try:
            state.hit, stored = self._usable_hit(state.chain, floor)
        except Exception as exc:  # noqa: BLE001 - a failing store means no hit, not an error
            log.warning("ucm: store lookup failed, recomputing: %s", exc)
            self.stats.add(lookup_errors=1)
            state.hit = stored = 0
        state.local = num_computed_tokens
        state.wa_after = max(state.wa_after, floor)
        # Dumps continue from the hit: full blocks below it are stored, and window tails
        # past it are not (or the hit would be longer).  Without window groups, from all
        # the store holds, loaded or not (vLLM may hold that prefix itself): what is
        # stored is not written again.
        state.next_dump = max(
            state.next_dump, state.hit if self.layout.has_windows else max(state.hit, stored)
        )
        hit = external_hit(state.hit * bt, request.num_tokens, num_computed_tokens, self.aligned_to)
        if hit <= 0 or hit < self.load_threshold or not self.loads:
            return 0, False
        return hit, not self.sync_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self.requests[request.request_id]
        plan = plan_load(self.layout.hybrid, state.local, state.hit)
        block_ids = blocks.get_block_ids()
        items = [self._item(state, ref, block_ids, skip=ref.held) for ref in plan.blocks]
        self.pending_loads.append(Transfer(request.request_id, items))
        if self.events is not None:
            self.events.loading(request, items, self.layout.block_tokens)
        state.loaded_to = min(state.local + num_external_tokens, request.num_tokens - 1)
        state.load_step = self.sync_loads
        self.stats.add(lookup_hit_tokens=num_external_tokens)

    def hit_tiers(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The tokens of the request's planned load by the store tier that serves them
        (``Store.tiers``: host memory, disk, remote), by its full-attention blocks; "" for
        tokens whose tier the store could not tell."""
        state = self.requests.get(request.request_id)
        if state is None or not state.chain or num_external_tokens <= 0 or self.stores is None:
            return {}
        bt = self.layout.block_tokens
        start, end = state.local, state.local + num_external_tokens
        keys = range(start // bt, min(-(-end // bt), len(state.chain)))
        try:  # a model with no full-attention group: its tier is unknown too
            group = next(g for g in self.layout.groups if g.kind == "full")
            scoped = scoped_keys([state.chain[k] for k in keys], self.layout.scope(group, 0))
            tiers = self.stores.of(group).tiers(scoped)
        except Exception:  # noqa: BLE001 - a failing store: the tokens' tier is unknown
            return {"": num_external_tokens}
        out: dict[str, int] = {}
        for k, tier in zip(keys, tiers):
            tokens = min(end, (k + 1) * bt) - max(start, k * bt)
            out[tier] = out.get(tier, 0) + tokens
        return out

    def _item(self, state: RequestState, ref: BlockRef, block_ids: Any, skip: int = 0) -> Item:
        """``ref`` with its engine block ids; the first ``skip`` are left alone (0)."""
        ids = block_ids[ref.group]
        engine = [
            ids[j] if j < len(ids) and n >= skip else 0 for n, j in enumerate(ref.engine_blocks)
        ]
        return Item(ref.group, ref.key, state.chain[ref.key], engine)

    def build_connector_meta(self, scheduler_output: Any) -> UCMConnectorMetadata:
        meta = UCMConnectorMetadata(
            loads=self.pending_loads,
            dumps=self.pending_dumps,
            delayed=self.delayed,
            reset=self.reset_pending,
            reset_loads=self.reset_loads,
        )
        self.pending_loads, self.pending_dumps, self.delayed = [], [], []
        self.reset_pending, self.reset_loads = "", []
        meta.preempted = list(getattr(scheduler_output, "preempted_req_ids", None) or ())
        if not self.enabled:
            return meta
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or not state.chain or block_state is None:
                continue
            if state.load_step:
                # The forward pass of a sync load's step may run on blocks that failed to
                # load (on any rank): what it computes is dumped only once vLLM has kept
                # it, from the next step on.
                state.load_step = False
                continue
            computed = state.request.num_computed_tokens
            if state.loaded_to:
                state.settle_load(computed, self.layout.block_tokens)
            if not self.dumps:
                continue
            transfer = self._dump(state, computed + n_scheduled, block_state.get_block_ids(req_id))
            if transfer is not None:
                meta.dumps.append(transfer)
        return meta

    def _dump(self, state: RequestState, computed: int, block_ids: Any) -> Transfer | None:
        """Plan the blocks completed up to ``computed`` tokens and not planned yet.

        Every rank gets the whole plan: each writes its own shard, and for caches replicated
        on every rank, the keys that fall to it (``ModelLayout.writes``).
        """
        plan = plan_dump(
            self.layout.hybrid,
            dumped=state.next_dump,
            computed_tokens=computed,
            chain_blocks=len(state.chain),
            block_wise=self.block_wise,
            wa_after=state.wa_after,
        )
        state.next_dump = plan.dumped
        items = [self._item(state, ref, block_ids) for ref in plan.blocks]
        # A block vLLM has let go of is the null block in ``block_ids`` (window blocks out
        # of the window, in request_finished): its bytes must never go under a valid key.
        items = [it for it in items if NULL_BLOCK not in it.block_ids]
        if not items:
            return None
        state.dumped = True
        if self.events is not None:
            self.events.expect(state.request, items, self.layout.block_tokens)
        return Transfer(state.request.request_id, items)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        """``block_ids``: the request's block ids per KV-cache group."""
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return False, None
        if self.dumps and state.chain and not _aborted(request):
            # Blocks computed in a step whose dumps were held back (a sync load's step).
            transfer = self._dump(state, request.num_computed_tokens, block_ids)
            if transfer is not None:
                self.pending_dumps.append(transfer)
        if not state.dumped:
            return False, None
        # The workers report the request in finished_sending once its dumps are done.
        self.delayed.append(request.request_id)
        self.held[request.request_id] = time.monotonic()
        return True, None

    def sent(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' dumps done: vLLM frees their blocks."""
        for req_id in req_ids:
            self.held.pop(req_id, None)

    def frees_pending(self) -> bool:
        """Whether blocks of finished requests come back once their dumps end: vLLM then
        waits for them rather than preempting a running request."""
        return self._holding()

    def steps_needed(self) -> bool:
        """Whether vLLM should keep stepping with no request: the workers report dumps
        done only in a step, and until they do, vLLM holds the blocks (a reset of its
        prefix cache fails meanwhile)."""
        return self._holding()

    def _holding(self) -> bool:
        """Whether a finished request's blocks wait for its dumps.  Bounded: one held past
        ``HOLD_S`` (a store that never ends its writes) neither makes vLLM wait for its
        blocks nor keeps an idle engine stepping."""
        if not self.held:
            return False
        since = time.monotonic() - HOLD_S
        return any(at > since for at in self.held.values())


def external_hit(stored: int, num_tokens: int, computed: int, aligned_to: int = 1) -> int:
    """The tokens a hit of ``stored`` prompt tokens (whole store blocks) adds to the
    ``computed`` ones vLLM holds.  vLLM computes at least the last prompt token, to sample
    the next one (the hit's last block is still loaded whole); where it takes only hits that
    end on a block boundary (``aligned_to``, its block size), the hit ends on the last one
    before."""
    end = min(stored, num_tokens - 1)
    end -= end % aligned_to
    return max(0, end - computed)


def _aborted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR))


def _preempted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status == RequestStatus.PREEMPTED)
