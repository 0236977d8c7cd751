"""Host staging: gather into host buffers (dump) and scatter from them (load) on a GPU.

A dump must not hold up the forward pass, so the copy runs on a side stream: at submit time
it records an event on the caller's current stream and waits for that event only (the KV it
copies was written by work queued before the dump, and nothing queued after it is waited
for), then gathers and copies to the pinned host buffers, and records a completion event.
The caller polls or waits on the returned :class:`TransferHandle`.

Two ways to reach host memory:

* ``direct=False`` (default): the kernel gathers into a device scratch buffer and one DMA
  copy per call moves it into the pinned host buffers.  The DMA engine runs at the link's
  full speed, and the scratch pass costs a few percent at HBM speed.
* ``direct=True``: the Triton kernel reads or writes the pinned host buffers itself (mapped
  host memory, the same address on the device under unified addressing), skipping the
  scratch buffer.  Whether it beats the DMA path depends on the machine: the benchmark
  measures both.  Not available with scales.

The host buffers are written by the store's I/O threads straight from where the copy left
them: no extra host copy.  They must be pinned (:func:`alloc_host_buffers`); a pageable
buffer would make the "asynchronous" copy synchronous, so it is refused.

Integrity without host threads: a dump can have each block's digest computed on the device
from the gathered rows (``digests=``), and :meth:`HostStager.load_checked` sums a load's rows
on the device once they crossed the link and scatters only those whose digest is the stored
one (:mod:`ucm.kernels.digest`).

Host rows given as a :class:`~ucm.kernels.row_table.RowTable` (a store's slots wherever they
lie, as one table of offsets) go through the device's scratch whatever the route: the rows
move between it and the table by :func:`~ucm.kernels.row_table.copy_rows` (one kernel launch
for rows scattered over the store's memory, where a tensor a row cost the host tens of
microseconds each and the driver a copy call each).

On the CPU (no GPU, or CPU caches) the same calls run synchronously and return a handle that
is already done.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import attrs
import numpy as np
import torch

from ucm.kernels.api import Backend, execute
from ucm.kernels.digest import as_int64, row_digests
from ucm.kernels.row_table import RowTable, copy_rows
from ucm.kernels.spec import PayloadLayout
from ucm.kernels.validate import (
    GATHER,
    SCATTER,
    CheckedCaches,
    TransferPlan,
    build_plan,
    check_caches,
    rebind_buffers,
)

#: On the CPU, blocks this size or larger move as fast into rows that lie apart (a store's
#: slots) as into rows of one allocation.  Below it, a block whose payload is not a run of
#: the cache's memory per cache tensor is copied by one kernel call per block and cache
#: tensor, against one per step into rows of one allocation: those rows are faster (256
#: blocks of 512 KiB, 8 layers: 30 ms into rows, 190 ms apart); above it the rows apart are
#: (4 MiB: 2.2 times faster, no fresh row memory).
IN_PLACE_MIN_BYTES = 1 << 20


def alloc_host_buffers(
    layout: PayloadLayout | int, count: int, *, pin: bool | None = None
) -> torch.Tensor:
    """``[count, nbytes]`` uint8 host buffers, pinned when a GPU is there (``pin=None``)."""
    nbytes = layout.nbytes if isinstance(layout, PayloadLayout) else int(layout)
    if count < 1 or nbytes < 1:
        raise ValueError(f"count and nbytes must be positive, got {count} and {nbytes}")
    if pin is None:
        pin = torch.cuda.is_available()
    return torch.empty((count, nbytes), dtype=torch.uint8, pin_memory=bool(pin))


class TransferHandle:
    """Completion of one staged copy.

    Keeps the scratch buffer and the tensors the copy uses alive until it is done.
    """

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        keep: tuple = (),
        device: torch.device | None = None,
    ) -> None:
        self._event = event
        self._keep = keep
        self._device = device

    @property
    def event(self) -> torch.cuda.Event | None:
        """The CUDA event recorded after the copy (None for a synchronous copy)."""
        return self._event

    def done(self) -> bool:
        """True once the copy has finished (never blocks)."""
        if self._event is None or self._event.query():
            self._keep = ()
            return True
        return False

    def wait(self) -> None:
        """Block the calling thread until the copy has finished."""
        if self._event is not None:
            self._event.synchronize()
        self._keep = ()

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for the copy, without blocking
        the host: call it before the forward pass reads blocks that a load wrote."""
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)


class HostStager:
    """Dumps and loads between a GPU's paged caches and pinned host buffers.

    Args:
        device: the caches' GPU (default: the current CUDA device when there is one).
        stream: the side stream to copy on (default: a new one per stager).
        direct: let the kernel touch host memory itself (see the module docstring).
        backend: the kernel backend for the device-side gather/scatter.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        direct: bool = False,
        backend: Backend = "auto",
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.direct = direct
        self.backend = backend
        self._stream = stream
        if self.device.type == "cuda" and stream is None:
            self._stream = torch.cuda.Stream(self.device)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        return self._stream

    def dump(
        self,
        caches: Sequence[torch.Tensor] | CheckedCaches,
        block_ids: object,
        host_buffers: torch.Tensor | Sequence[torch.Tensor] | RowTable,
        *,
        token_range: tuple[int, int] | None = None,
        null_block_id: int | None = None,
        scales: Sequence[torch.Tensor] | None = None,
        digests: torch.Tensor | None = None,
    ) -> TransferHandle:
        """Gather into host buffers; returns at once on a GPU (see :class:`TransferHandle`).
        ``digests``: an int64 host tensor (pinned on a GPU) that gets each block's digest
        (:func:`~ucm.kernels.digest.row_digests`) once the handle is done, computed on the
        device from the gathered rows."""
        if isinstance(host_buffers, RowTable):
            options = {"token_range": token_range, "null_block_id": null_block_id}
            return self._table(GATHER, caches, block_ids, host_buffers, scales, options, digests)[1]
        plan = build_plan(
            GATHER,
            caches,
            block_ids,
            host_buffers,
            token_range=token_range,
            null_block_id=null_block_id,
            scales=scales,
            host_buffers=True,
        )
        if digests is not None and digests.shape != (plan.num_store_blocks,):
            raise ValueError(f"digests for {plan.num_store_blocks} blocks, got {digests.shape}")
        return self._run(plan, digests)

    def load(
        self,
        caches: Sequence[torch.Tensor] | CheckedCaches,
        block_ids: object,
        host_buffers: torch.Tensor | Sequence[torch.Tensor] | RowTable,
        *,
        token_range: tuple[int, int] | None = None,
        null_block_id: int | None = None,
        scales: Sequence[torch.Tensor] | None = None,
    ) -> TransferHandle:
        """Scatter from host buffers; on a GPU, call ``wait_on()`` on the handle before the
        forward pass reads the blocks (and keep the buffers until the handle is done)."""
        if isinstance(host_buffers, RowTable):
            options = {"token_range": token_range, "null_block_id": null_block_id}
            return self._table(SCATTER, caches, block_ids, host_buffers, scales, options)[1]
        plan = build_plan(
            SCATTER,
            caches,
            block_ids,
            host_buffers,
            token_range=token_range,
            null_block_id=null_block_id,
            scales=scales,
            host_buffers=True,
        )
        return self._run(plan)

    def load_checked(
        self,
        caches: Sequence[torch.Tensor] | CheckedCaches,
        block_ids: object,
        host_buffers: torch.Tensor | Sequence[torch.Tensor] | RowTable,
        expected: Sequence[int],
        **options: object,
    ) -> tuple[torch.Tensor, TransferHandle]:
        """Scatter from host buffers the blocks whose digest is ``expected[i]`` (as
        :mod:`ucm.core.digest` gives it).  Returns, per block, whether it was (a bool host
        tensor, to be read once the handle is done) and the handle.  On a GPU it returns at
        once: the rows cross the link into device memory, are summed there, and only those
        whose digest matches are scattered, all on the side stream (a block that fails
        never reaches the cache, and the host waits for nothing).  On the CPU the rows are
        checked where they lie, synchronously."""
        if isinstance(host_buffers, RowTable):
            rest = {k: v for k, v in options.items() if k != "scales"}
            scales = options.get("scales")
            verdicts, handle = self._table(
                SCATTER,
                caches,
                block_ids,
                host_buffers,
                scales,
                rest,
                expected=expected,  # type: ignore[arg-type]
            )
            assert verdicts is not None
            return verdicts, handle
        plan = build_plan(
            SCATTER,
            caches,
            block_ids,
            host_buffers,
            host_buffers=True,
            **options,  # type: ignore[arg-type]
        )
        count = plan.num_store_blocks
        if len(expected) != count:
            raise ValueError(f"{len(expected)} digests for {count} blocks")
        want = _as_int64s(expected)
        if plan.device.type != "cuda":
            got = torch.cat([row_digests(row.view(1, -1)) for row in plan.raw]) if count else want
            ok = got == want
            execute(attrs.evolve(plan, keep=ok), self.backend)
            return ok, TransferHandle()
        if plan.device != self.device:
            raise ValueError(f"the caches are on {plan.device}, this stager on {self.device}")
        self._check_pinned(plan)
        assert self._stream is not None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        verdicts = torch.empty(count, dtype=torch.bool, pin_memory=True)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            scratch = torch.empty(
                (count, plan.layout.nbytes), dtype=torch.uint8, device=self.device
            )
            _copy_rows(scratch, plan)
            wanted = want.pin_memory().to(self.device, non_blocking=True)
            ok = row_digests(scratch, self.backend) == wanted
            execute(attrs.evolve(rebind_buffers(plan, scratch), keep=ok), self.backend)
            verdicts.copy_(ok, non_blocking=True)
            done.record(self._stream)
        return verdicts, TransferHandle(done, (*plan.caches, scratch, wanted, ok), self.device)

    # -------------------------------------------------------------------------------------
    def _table(
        self,
        direction: str,
        caches: Sequence[torch.Tensor] | CheckedCaches,
        block_ids: object,
        table: RowTable,
        scales: Sequence[torch.Tensor] | None,
        options: dict,
        digests: torch.Tensor | None = None,
        expected: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor | None, TransferHandle]:
        """A transfer whose host rows are a table: the blocks between the caches and the
        device's scratch, the scratch's rows between the device and the table
        (:func:`copy_rows`), digested or checked in the scratch.  On the CPU the same steps,
        synchronously (a GPU's path, for the tests: the CPU's own copies take the rows as
        tensors).  Returns the verdicts where ``expected`` digests were given."""
        if not isinstance(caches, CheckedCaches):
            caches = check_caches(caches, scales)
        elif scales is not None:
            raise ValueError("checked caches carry their scales: give scales=None")
        device = caches.device
        cuda = device.type == "cuda"
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"a row table's copies need a GPU or the CPU, not {device}")
        if cuda and device != self.device:
            raise ValueError(f"the caches are on {device}, this stager on {self.device}")
        if table.device.type != "cpu":
            raise ValueError(f"a row table's rows are host memory, not {table.device}")
        if cuda and not table.is_pinned():
            raise ValueError(
                "the row table's memory is not pinned: an asynchronous copy needs it "
                "registered with the driver (PinnedRegions)"
            )
        if self.direct:
            raise ValueError("direct=True takes host rows as tensors; a row table goes by DMA")
        rows = "torch" if self.backend in ("torch", "reference") else self.backend
        stream = self._stream if cuda else None
        ready = done = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            done = torch.cuda.Event()
        verdicts = None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            scratch = torch.empty((len(table), table.nbytes), dtype=torch.uint8, device=device)
            plan = build_plan(direction, caches, block_ids, scratch, **options)
            if plan.layout.nbytes != table.nbytes:
                raise ValueError(
                    f"the row table's rows are {table.nbytes} bytes, a payload {plan.layout.nbytes}"
                )
            if digests is not None and digests.shape != (len(table),):
                raise ValueError(f"digests for {len(table)} blocks, got {tuple(digests.shape)}")
            if expected is not None and len(expected) != len(table):
                raise ValueError(f"{len(expected)} digests for {len(table)} blocks")
            if stream is not None:
                stream.wait_event(ready)
            keep: tuple = (*plan.caches, table.base, table.offsets, scratch)
            if direction == GATHER:
                execute(plan, self.backend)
                copy_rows(scratch, table, to_table=True, backend=rows)
                if digests is not None:  # summed in device memory: a few % of the link's time
                    digests.copy_(row_digests(scratch, self.backend), non_blocking=cuda)
            elif expected is None:
                copy_rows(scratch, table, to_table=False, backend=rows)
                execute(plan, self.backend)
            else:
                want = _as_int64s(expected)
                wanted = want.pin_memory().to(device, non_blocking=True) if cuda else want
                copy_rows(scratch, table, to_table=False, backend=rows)
                ok = row_digests(scratch, self.backend) == wanted
                execute(attrs.evolve(plan, keep=ok), self.backend)
                verdicts = ok
                if cuda:
                    verdicts = torch.empty(len(table), dtype=torch.bool, pin_memory=True)
                    verdicts.copy_(ok, non_blocking=True)
                keep = (*keep, wanted, ok)
            if done is not None:
                done.record(stream)
        if not cuda:
            return verdicts, TransferHandle()
        return verdicts, TransferHandle(done, keep, device)

    def _check_pinned(self, plan: TransferPlan) -> None:
        # Rows of one allocation are pinned or not together: one query (each asks the CUDA
        # driver about the address) instead of one per row.
        stacked = plan.raw_stacked
        rows = [stacked] if stacked is not None else plan.raw
        for s, row in enumerate(rows):
            if row.device.type == "cpu" and not row.is_pinned():
                raise ValueError(
                    f"host_buffers[{s}] is not pinned: an asynchronous copy needs pinned memory "
                    f"(allocate with alloc_host_buffers)"
                )

    def _run(self, plan: TransferPlan, digests: torch.Tensor | None = None) -> TransferHandle:
        if plan.device.type == "cpu":
            if any(r.device.type != "cpu" for r in plan.raw):
                raise ValueError("the caches are on the CPU but some buffers are not")
            execute(plan, self.backend)
            if digests is not None:
                digests.copy_(torch.cat([row_digests(r.view(1, -1)) for r in plan.raw]))
            return TransferHandle()
        if plan.device.type != "cuda":
            if digests is not None:
                raise ValueError("digests on the device need a GPU or the CPU")
            return self._run_sync(plan)
        if plan.device != self.device:
            raise ValueError(f"the caches are on {plan.device}, this stager on {self.device}")
        self._check_pinned(plan)
        if self.direct and plan.scales is not None:
            raise ValueError("direct=True does not handle scales; use the default DMA path")
        if self.direct and digests is not None:
            raise ValueError("direct=True does not compute digests; use the default DMA path")
        assert self._stream is not None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            keep: tuple = (*plan.caches, *plan.raw)
            if self.direct:
                execute(plan, "triton")
            else:
                scratch = torch.empty(
                    (plan.num_store_blocks, plan.layout.nbytes),
                    dtype=torch.uint8,
                    device=self.device,
                )
                dev_plan = rebind_buffers(plan, scratch)
                if plan.direction == SCATTER:
                    _copy_rows(scratch, plan)
                    execute(dev_plan, self.backend)
                else:
                    execute(dev_plan, self.backend)
                    _copy_rows(scratch, plan)
                    if digests is not None:  # summed in device memory: a few % of the link's time
                        digests.copy_(row_digests(scratch, self.backend), non_blocking=True)
                keep = (*keep, scratch)
            done.record(self._stream)
        return TransferHandle(done, keep, self.device)

    def _run_sync(self, plan: TransferPlan) -> TransferHandle:
        """Another accelerator: a device scratch buffer and blocking copies."""
        scratch = torch.empty(
            (plan.num_store_blocks, plan.layout.nbytes), dtype=torch.uint8, device=plan.device
        )
        dev_plan = rebind_buffers(plan, scratch)
        if plan.direction == SCATTER:
            _copy_rows(scratch, plan)
        execute(dev_plan, self.backend)
        if plan.direction == GATHER:
            _copy_rows(scratch, plan)
        return TransferHandle()


def _as_int64s(expected: Sequence[int]) -> torch.Tensor:
    """Digests (unsigned 64-bit) as the int64s with their bits, in one conversion (a Python
    call a block cost 1.1 ms a 1,024)."""
    try:
        return torch.from_numpy(np.array(expected, dtype=np.uint64).view(np.int64))
    except (OverflowError, TypeError, ValueError):  # not all unsigned 64-bit: bit by bit
        return torch.tensor([as_int64(e) for e in expected], dtype=torch.int64)


def _copy_rows(scratch: torch.Tensor, plan: TransferPlan) -> None:
    """Between the device scratch ``[S, nbytes]`` and the host payloads, in the plan's
    direction: one copy when the host rows are evenly spaced, else one per run of rows
    lying one after another in one allocation."""
    to_host = plan.direction == GATHER
    # Only a contiguous stacked view: a strided host destination would go through a
    # pageable temporary and lose the asynchrony.
    if plan.raw_stacked is not None and plan.raw_stacked.is_contiguous():
        pairs = [(plan.raw_stacked, scratch)]
    else:
        pairs = [(host, scratch[s : s + len(host)]) for s, host in _runs(plan.raw)]
    for host, dev in pairs:
        if to_host:
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)


def _runs(rows: tuple[torch.Tensor, ...]) -> list[tuple[int, torch.Tensor]]:
    """Maximal runs of consecutive rows, each starting where the one before it ends in one
    storage, as ``(first row, [rows, nbytes] view)``: one copy call each (a call costs the
    driver microseconds, as long as a 256 KiB row takes to cross the link)."""
    out: list[tuple[int, torch.Tensor]] = []
    start = 0
    for s in range(1, len(rows) + 1):
        if s < len(rows):
            prev, row = rows[s - 1], rows[s]
            if (
                row.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                and row.data_ptr() == prev.data_ptr() + prev.numel()
                and row.numel() == prev.numel()
            ):
                continue
        first = rows[start]
        out.append((start, first.as_strided((s - start, first.numel()), (first.numel(), 1))))
        start = s
    return out
