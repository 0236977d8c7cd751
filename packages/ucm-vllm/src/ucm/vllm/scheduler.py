"""The scheduler side: store lookups, load plans, dump plans, delayed frees.

Runs in vLLM's engine-core process.  It only reads the store (``lookup_prefix``); the
workers move the data.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
from ucm.core.keys import block_keys, scoped_keys
from ucm.core.store import Store
from ucm.vllm.layout import ModelLayout
from ucm.vllm.metadata import Transfer, UCMConnectorMetadata
from ucm.vllm.stats import UCMStats

log = logging.getLogger(__name__)


@attrs.define
class RequestState:
    request: Any  # vllm.v1.request.Request
    chain: list[bytes] = attrs.field(factory=list)  # token-chain keys of the prompt's full blocks
    stored: int = 0  # leading store blocks known to be in the store
    local: int = 0  # tokens vLLM holds itself (block-aligned), as of the last lookup
    next_dump: int = 0  # first store block not yet planned for a dump
    dumped: bool = False  # any dump planned: its blocks are freed only when the dumps are done
    loaded_to: int = 0  # tokens the last planned load makes computed; 0 once checked
    load_step: bool = False  # scheduled with a sync load this step: no dumps planned in it


class SchedulerSide:
    def __init__(
        self,
        layout: ModelLayout,
        store: Store | None,
        load_threshold: int,
        sync_loads: bool = False,
    ) -> None:
        self.layout = layout
        self.store = store
        self.load_threshold = load_threshold
        self.sync_loads = sync_loads
        self.enabled = store is not None and not any(g.kind == "window" for g in layout.groups)
        self.dumps = self.enabled and not (store is not None and store.read_only)
        self.requests: dict[str, RequestState] = {}
        self.pending_loads: list[Transfer] = []
        self.pending_dumps: list[Transfer] = []  # of requests that finished, not yet planned
        self.delayed: list[str] = []
        self.stats = UCMStats()

    # -- keys --

    def _cacheable(self, request: Any) -> bool:
        # Inputs that are not token ids would need their own key material.
        return not (
            getattr(request, "mm_features", None)
            or getattr(request, "lora_request", None)
            or getattr(request, "prompt_embeds", None) is not None
        )

    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            state = RequestState(request)
            self.requests[request.request_id] = state
        if not state.chain and self._cacheable(request):
            ns = self.layout.chain_namespace(getattr(request, "cache_salt", None))
            state.chain = block_keys(ns, list(request.prompt_token_ids), self.layout.block_tokens)
        return state

    def _stored_prefix(self, chain: list[bytes]) -> int:
        """Leading blocks stored for every group and rank (all must be there to load)."""
        assert self.store is not None
        found = len(chain)
        for group in self.layout.stored_groups:
            ranks = [0] if group.replicated else range(self.layout.world_size)
            for rank in ranks:
                if not found:
                    return 0
                keys = scoped_keys(chain[:found], self.layout.scope(group, rank))
                found = min(found, self.store.lookup_prefix(keys))
        return found

    # -- vLLM hooks --

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.enabled:
            return 0, False
        state = self._state(request)
        if not state.chain:
            return 0, False
        try:
            state.stored = self._stored_prefix(state.chain)
        except Exception as exc:  # noqa: BLE001 - a failing store means no hit, not an error
            log.warning("ucm: store lookup failed, recomputing: %s", exc)
            state.stored = 0
        state.next_dump = max(state.next_dump, state.stored)
        state.local = num_computed_tokens
        hit = state.stored * self.layout.block_tokens - num_computed_tokens
        if self.sync_loads:
            # vLLM must compute at least the last prompt token to sample the next one (an
            # async load gets the same from vLLM once it completes).
            hit = min(hit, request.num_tokens - 1 - num_computed_tokens)
        if hit <= 0 or hit < self.load_threshold:
            return 0, False
        return hit, not self.sync_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self.requests[request.request_id]
        bt = self.layout.block_tokens
        local = state.local
        # Whole store blocks covering the external tokens (vLLM asked for whole blocks; if it
        # ever trims the count, the last block is still loaded whole and its tail recomputed).
        first = local // bt
        end = min(-(-(local + num_external_tokens) // bt), len(state.chain))
        block_ids = blocks.get_block_ids()
        per_group = []
        for group in self.layout.stored_groups:
            k = group.blocks_per_store_block(bt)
            ids = block_ids[group.index]
            # Engine blocks that vLLM already holds (the local hit) are left alone: they
            # may be shared with running requests.
            skip = local // group.engine_block_tokens
            per_group.append(
                [
                    [ids[j] if skip <= j < len(ids) else 0 for j in range(s * k, (s + 1) * k)]
                    for s in range(first, end)
                ]
            )
        self.pending_loads.append(
            Transfer(request.request_id, first, state.chain[first:end], per_group)
        )
        state.loaded_to = min(local + num_external_tokens, request.num_tokens - 1)
        state.load_step = self.sync_loads
        self.stats.add(lookup_hit_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> UCMConnectorMetadata:
        meta = UCMConnectorMetadata(
            loads=self.pending_loads, dumps=self.pending_dumps, delayed=self.delayed
        )
        self.pending_loads, self.pending_dumps, self.delayed = [], [], []
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
                if computed < state.loaded_to:
                    # The load failed from here and vLLM recomputes: dump what it computes.
                    state.next_dump = min(state.next_dump, computed // self.layout.block_tokens)
                state.loaded_to = 0
            if not self.dumps:
                continue
            transfer = self._dump(state, computed + n_scheduled, block_state.get_block_ids(req_id))
            if transfer is not None:
                meta.dumps.append(transfer)
        return meta

    def _dump(self, state: RequestState, computed: int, block_ids: Any) -> Transfer | None:
        """Plan the store blocks completed up to ``computed`` tokens and not planned yet."""
        bt = self.layout.block_tokens
        end = min(computed // bt, len(state.chain))
        if end <= state.next_dump:
            return None
        per_group = []
        for group in self.layout.stored_groups:
            k = group.blocks_per_store_block(bt)
            ids = block_ids[group.index]
            per_group.append([list(ids[s * k : (s + 1) * k]) for s in range(state.next_dump, end)])
        transfer = Transfer(
            state.request.request_id, state.next_dump, state.chain[state.next_dump : end], per_group
        )
        state.next_dump = end
        state.dumped = True
        return transfer

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
        return True, None


def _aborted(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return bool(request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR))
