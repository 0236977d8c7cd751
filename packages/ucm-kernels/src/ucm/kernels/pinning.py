"""Host memory that a store owns, registered with the CUDA driver as pinned memory.

A GPU's DMA engine copies asynchronously only to and from page-locked memory.  torch's
pinned allocations are; memory another party mapped is not: the host dram store's arena, a
file in ``/dev/shm`` that every process on the host maps.  A copy between the GPU and it
would be staged by the driver through a pinned buffer of its own, and synchronous.  Once the
arena is registered (``cudaHostRegister``), a device block is copied straight into the
store's slot and out of it, with no staging row and no copy on the store's threads.

Registering locks the pages in memory, the arena's whole size at once, and takes time (the
driver walks every page): it is done once, at start-up, and undone before the memory is
unmapped.  A registration the driver refuses (a locked-memory limit, an old driver) is
logged, and the copies go through pinned rows as before.

The store hands out a block's memory as a memoryview; :meth:`PinnedRegions.rows` turns
those into slices of one tensor over the registered region, so that blocks lying one after
another in it move in one DMA copy (:class:`~ucm.kernels.HostStager` merges such runs)
rather than one copy each: a copy call costs microseconds of the driver's time, as long as
a 256 KiB block takes to cross the link.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ucm.core import address_of

from ucm.kernels.row_table import RowTable

if TYPE_CHECKING:
    from ucm.core import SlotReads, SlotWrites

    from ucm.kernels.staging import HostStager, TransferHandle

log = logging.getLogger(__name__)

#: cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context of the
#: process, and mapped into the device's address space (a kernel may read it in place)
_FLAGS = 0x01 | 0x02


class PinnedRegions:
    """Host memory regions registered with the CUDA driver, until :meth:`close`."""

    def __init__(self) -> None:
        self._addresses: list[int] = []
        self._regions: list[torch.Tensor] = []  # one uint8 tensor over each region

    def register(self, region: memoryview) -> bool:
        """Register ``region`` (writable, mapped until :meth:`close`); whether the driver
        took it.  False where there is no GPU."""
        if not torch.cuda.is_available() or region.nbytes == 0:
            return False
        whole = torch.frombuffer(region, dtype=torch.uint8)  # type: ignore[call-overload]
        address = whole.data_ptr()
        try:
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(address, region.nbytes, _FLAGS)
            )
        except (RuntimeError, torch.cuda.CudaError) as exc:
            log.warning(
                "ucm: cannot register %d MiB of the store's host memory with the GPU "
                "driver (%s): copies go through pinned rows",
                region.nbytes >> 20,
                exc,
            )
            return False
        self._addresses.append(address)
        self._regions.append(whole)
        return True

    def register_all(self, regions: Sequence[memoryview]) -> bool:
        """Register every region, or none (the driver refused one: those taken are undone);
        whether they are registered.  Logs how much, and how long it took."""
        started = time.perf_counter()
        if not all(self.register(region) for region in regions):
            self.close()
            return False
        log.info(
            "ucm: %.1f GiB of the store's host memory registered with the GPU driver in "
            "%.2f s: blocks are copied straight into and out of it",
            sum(r.nbytes for r in regions) / 2**30,
            time.perf_counter() - started,
        )
        return True

    def rows(self, views: list[memoryview]) -> torch.Tensor | list[torch.Tensor]:
        """``views`` (writable, of one size, inside the registered regions) as host rows
        for :class:`~ucm.kernels.HostStager`: one ``[len(views), nbytes]`` tensor where
        they lie one after another in rising order (one check and one copy for the batch,
        not one a row: a row's costs tens of microseconds of Python, longer than a 256 KiB
        block takes to cross the link), else uint8 slices of the regions' tensors (rows
        that follow each other still share a storage, and move in one copy).  Where nothing
        is registered (no GPU, or the driver refused), plain tensors over the views: a CPU
        copies into them as well, a GPU refuses them (not pinned)."""
        if not views:
            return []
        if not self._regions:
            return [torch.frombuffer(view, dtype=torch.uint8) for view in views]  # type: ignore[call-overload]
        nbytes = views[0].nbytes
        addresses = [address_of(view) for view in views]
        whole, first = self._region_of(addresses[0], nbytes)
        last = addresses[-1] - whole.data_ptr()
        if (
            all(view.nbytes == nbytes for view in views)
            and last == first + (len(views) - 1) * nbytes
            and all(b - a == nbytes for a, b in zip(addresses, addresses[1:]))
        ):
            return whole[first : first + len(views) * nbytes].view(len(views), nbytes)
        out = []
        for address, view in zip(addresses, views):
            region, offset = self._region_of(address, view.nbytes)
            out.append(region[offset : offset + view.nbytes])
        return out

    def table(self, addresses: np.ndarray, nbytes: int) -> RowTable | None:
        """Rows of ``nbytes`` at ``addresses`` (a store's :meth:`~ucm.core.SlotWrites.
        addresses`, every one a row) as one table over the registered region holding them
        all: made with numpy, no object a row.  None where nothing is registered or the rows
        lie in several regions (then :meth:`rows`); ``ValueError`` where a row lies outside
        every region."""
        if not self._regions:
            return None
        at = np.asarray(addresses, dtype=np.uint64).reshape(-1)
        for whole in self._regions:
            start = whole.data_ptr()
            inside = (at >= start) & (at <= start + whole.numel() - nbytes)
            if inside.all():
                return RowTable.of(whole, (at - np.uint64(start)).astype(np.int64), nbytes)
            if inside.any():
                return None  # (a region each: the copies take them row by row)
        for address in at.tolist():
            self._region_of(address, nbytes)  # raises, naming the row
        return None

    def _region_of(self, address: int, nbytes: int) -> tuple[torch.Tensor, int]:
        """The registered region holding ``nbytes`` at ``address``, and their offset in it."""
        for whole in self._regions:
            offset = address - whole.data_ptr()
            if offset >= 0 and offset + nbytes <= whole.numel():
                return whole, offset
        raise ValueError(f"{nbytes} bytes at {address:#x} lie outside the registered regions")

    def holds(self, view: memoryview) -> bool:
        """Whether ``view`` lies inside a registered region."""
        try:
            self._region_of(address_of(view), view.nbytes)
        except ValueError:
            return False
        return True

    @property
    def regions(self) -> tuple[torch.Tensor, ...]:
        """The registered regions, a uint8 tensor over each."""
        return tuple(self._regions)

    def __len__(self) -> int:
        return len(self._addresses)

    def close(self) -> None:
        """Unregister every region (before it is unmapped)."""
        addresses, self._addresses = self._addresses, []
        self._regions = []
        for address in addresses:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))
            except (RuntimeError, torch.cuda.CudaError) as exc:
                log.warning("ucm: cannot unregister host memory from the GPU driver: %s", exc)


def dump_into(
    stager: HostStager,
    pinned: PinnedRegions,
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[Any],
    writes: SlotWrites,
    **options: Any,
) -> TransferHandle | None:
    """Start gathering ``block_ids[i]`` of ``caches`` into the room a store reserved for
    key ``i`` (``writes.views[i]``; a key without a view has nothing to write); the copy's
    handle, None where there is nothing to copy.  ``options`` go to
    :meth:`HostStager.dump`.  Where the copy cannot start, the room goes back
    (``writes.abort()``) and the exception propagates: ``ValueError`` where the copy refused
    the store's memory (on a GPU: not registered after all)."""
    at = np.flatnonzero(writes.addresses()).tolist()  # the keys with room
    if not at:
        return None
    try:
        return stager.dump(
            caches, [block_ids[i] for i in at], host_rows(pinned, writes, at), **options
        )
    except BaseException:
        writes.abort()
        raise


def host_rows(
    pinned: PinnedRegions, lent: SlotWrites | SlotReads, which: list[int]
) -> torch.Tensor | list[torch.Tensor] | RowTable:
    """The views ``which`` of a store's room or loan as host rows for a
    :class:`~ucm.kernels.HostStager`: one table over the registered region on a GPU host
    (:meth:`PinnedRegions.table`), else tensors (:meth:`PinnedRegions.rows`)."""
    if pinned.regions and which:  # the views as numbers: no object a row
        sizes = lent.view_bytes()[which]
        nbytes = int(sizes[0])
        if nbytes and (sizes == nbytes).all():  # a view each, of one size
            table = pinned.table(lent.addresses()[which], nbytes)
            if table is not None:
                return table
    return pinned.rows([lent.views[i] for i in which])  # type: ignore[misc]
