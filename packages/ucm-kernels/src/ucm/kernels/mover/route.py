"""Which way a batch of blocks moves between an engine's cache and a store: a pure rule.

* :attr:`Route.IN_PLACE`: the store reads and writes the cache's memory itself, each
  block's payload a list of views of it (CPU caches whose blocks are runs of memory), no
  copy of ours at all.  Only where the caller keeps the blocks until the store is done with
  them, and waits for a cancelled read to stop (the store's threads write the cache);
* :attr:`Route.STORE_MEMORY`: we copy straight into room the store reserves in its own host
  memory (:meth:`Store.open_writes`) and out of blocks it lends where they lie
  (:meth:`Store.open_reads`), the store only sealing and checking: one copy.  On a GPU only
  once that memory is registered with its driver (its DMA engine copies asynchronously only
  to and from pinned memory); on the CPU where such a copy is not slower than into our own
  rows;
* :attr:`Route.ROWS`: we gather into host rows of our own and the store writes them (a
  dump), or the store reads into them and we scatter (a load).

A store with no memory of its own to offer answers ``open_writes``/``open_reads`` with None,
and the batch goes through rows after all.
"""

from __future__ import annotations

import enum

import attrs

from ucm.kernels.staging import IN_PLACE_MIN_BYTES


class Route(enum.Enum):
    IN_PLACE = "in place"
    STORE_MEMORY = "the store's memory"
    ROWS = "rows"


@attrs.frozen
class RouteAsk:
    """What decides a batch's route."""

    device: str  # the cache's device type: "cpu" or "cuda"
    nbytes: int  # one block's payload
    contiguous: bool  # each block's payload is a run of the cache's memory (views possible)
    cache_lent: bool  # the store may touch the cache blocks until the transfer ends
    registered: bool  # the store's host memory is registered with the GPU's driver
    zero_copy: bool = True  # routes other than rows allowed at all


def choose_route(ask: RouteAsk) -> Route:
    """The route of a batch (see the module's docstring)."""
    if not ask.zero_copy:
        return Route.ROWS
    if ask.device == "cpu":
        if ask.contiguous and ask.cache_lent:
            return Route.IN_PLACE
        # a block that is a run of memory, or a large one, copies into the store's memory
        # as fast as into a row; a small block gathered from several runs is copied faster
        # by the kernels' one call a step into rows of one allocation
        if ask.contiguous or ask.nbytes >= IN_PLACE_MIN_BYTES:
            return Route.STORE_MEMORY
        return Route.ROWS
    return Route.STORE_MEMORY if ask.registered else Route.ROWS
