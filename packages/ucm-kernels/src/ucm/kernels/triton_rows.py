"""The Triton kernel of :func:`ucm.kernels.row_table.copy_rows`: every row of a table in one
launch, each program a chunk of one row, its address read from the table.

The table's base is host memory on a GPU host (registered with the driver and mapped: the
same address serves the device), the dense rows the device's scratch; pointer arithmetic
across the two allocations is plain address arithmetic, as in the copy kernel.  Rows move
as the widest integers their offsets and length allow, with the alignment stated to the
compiler so that it emits 16-byte accesses (the offsets come from a table at run time)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.kernels.row_table import RowTable

#: bytes a program moves (a chunk of a row)
CHUNK_BYTES = 16384
_WIDTHS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _rows_kernel(
    table,  # the table's base, as words
    offsets,  # [rows] int64: each row's first word in table
    dense,  # [rows, row_words] contiguous words
    row_words,
    chunks,  # programs a row
    CHUNK: tl.constexpr,
    ALIGN: tl.constexpr,
    TO_TABLE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    r = pid // chunks
    c = pid - r * chunks
    j = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ok = j < row_words
    far = tl.multiple_of(tl.load(offsets + r), ALIGN)
    near = tl.multiple_of(r * row_words, ALIGN)
    if TO_TABLE:
        tl.store(table + far + j, tl.load(dense + near + j, mask=ok), mask=ok)
    else:
        tl.store(dense + near + j, tl.load(table + far + j, mask=ok), mask=ok)


def _width(table: RowTable, dense: torch.Tensor) -> int:
    """The widest word (bytes) dividing the row length, every offset and both addresses."""
    common = table.nbytes | table.base.data_ptr() | dense.data_ptr()
    offsets = table.offsets
    for width in (8, 4, 2):
        if common % width == 0 and not bool((offsets % width).any()):
            return width
    return 1


def copy_table_rows(dense: torch.Tensor, table: RowTable, to_table: bool) -> None:
    """:func:`~ucm.kernels.row_table.copy_rows` in one launch (arguments checked there)."""
    width = _width(table, dense)
    words = _WIDTHS[width]
    row_words = table.nbytes // width
    chunk = min(CHUNK_BYTES // width, triton.next_power_of_2(row_words))
    chunks = triton.cdiv(row_words, chunk)
    offsets = table.offsets // width
    if dense.device.type == "cuda":  # one small copy, queued: the host goes on
        offsets = offsets.pin_memory().to(dense.device, non_blocking=True)
    # the offsets are said to be multiples of 16 bytes where they are (the pointers' own
    # alignment Triton reads from the tensors)
    on16 = table.nbytes % 16 == 0 and not bool((table.offsets % 16).any())
    base = table.base[: table.base.numel() - table.base.numel() % width]
    _rows_kernel[(len(table) * chunks,)](
        base.view(words),
        offsets,
        dense.view(words),
        row_words,
        chunks,
        CHUNK=chunk,
        ALIGN=16 // width if on16 else 1,
        TO_TABLE=to_table,
    )
