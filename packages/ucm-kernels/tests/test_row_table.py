"""Host rows as one table: checked where made, copied row for row by the kernel (through
Triton's interpreter here, on a GPU where there is one) and by torch, and taken by the
stager whole (dump with digests, load, checked load) as it takes rows a tensor each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ucm.core import address_of
from ucm.lab.testing.kernels import assert_bits_equal, random_bits

from ucm.kernels import HostStager, PinnedRegions, payload_layout
from ucm.kernels.api import triton_available
from ucm.kernels.digest import row_digests, unsigned
from ucm.kernels.row_table import RowTable, copy_rows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="registered memory needs a GPU")


def _backends(device: str = "cpu") -> list[str]:
    return ["torch"] + (["triton"] if triton_available(device) else [])


def _rows(table: RowTable) -> list[torch.Tensor]:
    return [table.base[o : o + table.nbytes] for o in table.offsets.tolist()]


def test_a_table_is_checked_where_it_is_made() -> None:
    base = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row 1 .* outside the region of 4096 bytes"):
        RowTable.of(base, np.array([0, 4000]), 200)
    with pytest.raises(ValueError, match="row 0 .* outside"):
        RowTable.of(base, np.array([-8]), 8)
    with pytest.raises(ValueError, match="offsets 1000 and 1100 overlap"):
        RowTable.of(base, np.array([1100, 0, 1000]), 200)
    with pytest.raises(ValueError, match="at least one"):
        RowTable.of(base, np.array([0]), 0)
    with pytest.raises(ValueError, match="1-D uint8"):
        RowTable.of(base.view(torch.int16), np.array([0]), 8)
    table = RowTable.of(base, np.array([3896, 0]), 200)  # the last byte, the first
    assert len(table) == 2 and table.offsets.tolist() == [3896, 0]


def test_runs_are_rows_one_after_another_in_the_tables_order() -> None:
    table = RowTable.of(torch.zeros(1024, dtype=torch.uint8), np.array([0, 64, 128, 512, 448]), 64)
    assert table.runs() == [(0, 3, 0), (3, 1, 512), (4, 1, 448)]
    run = table.run_view(0, 3)
    assert run.shape == (3, 64) and run.data_ptr() == table.base.data_ptr()  # a view


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize(
    ("nbytes", "stride", "first"),
    [
        (16384, 16384, 0),
        (16384 + 8, 20480, 8),
        (1000, 1002, 2),
        (24, 40, 1),
        (3 * 16384 + 48, 65536, 16),
    ],
)
def test_rows_copied_each_way_in_any_order(
    backend: str, nbytes: int, stride: int, first: int
) -> None:
    # rows longer than a program's chunk, not a whole number of words, at odd offsets
    gen = torch.Generator().manual_seed(nbytes)
    count = 7
    base = torch.zeros(first + stride * (count + 2), dtype=torch.uint8)
    order = torch.randperm(count + 2, generator=gen)[:count].numpy()
    table = RowTable.of(base, first + order * stride, nbytes)
    dense = torch.randint(0, 256, (count, nbytes), dtype=torch.uint8, generator=gen)
    copy_rows(dense, table, to_table=True, backend=backend)
    for i, at in enumerate(table.offsets.tolist()):
        assert torch.equal(base[at : at + nbytes], dense[i])
    assert int(base.sum()) == int(dense.sum())  # nothing written beside the rows
    back = torch.zeros_like(dense)
    copy_rows(back, table, to_table=False, backend=backend)
    assert torch.equal(back, dense)


def test_dense_rows_must_match_the_table() -> None:
    table = RowTable.of(torch.zeros(256, dtype=torch.uint8), np.array([0, 64]), 64)
    with pytest.raises(ValueError, match=r"\[rows, nbytes\] uint8 expected"):
        copy_rows(torch.zeros(2, 32, dtype=torch.uint8), table, to_table=True)
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows(torch.zeros(64, 2, dtype=torch.uint8).t(), table, to_table=True)


def _caches(device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [random_bits((12, 2, 4, 2, 16), torch.bfloat16, gen).to(device) for _ in range(3)]


def _scattered(nbytes: int, count: int, region: torch.Tensor | None = None) -> RowTable:
    gen = torch.Generator().manual_seed(count)
    if region is None:
        region = torch.zeros((2 * count + 1) * nbytes, dtype=torch.uint8)
    slots = torch.randperm(2 * count, generator=gen)[:count].numpy()
    return RowTable.of(region, slots * nbytes + nbytes, nbytes)


@pytest.mark.parametrize("backend", ["auto", *(["triton"] if triton_available("cpu") else [])])
def test_the_stager_takes_a_table_as_it_takes_rows(backend: str) -> None:
    caches = _caches()
    ids = [[3], [1], [7], [10], [5]]
    nbytes = payload_layout(caches, 1).nbytes
    table = _scattered(nbytes, len(ids))
    stager = HostStager("cpu", backend=backend)  # type: ignore[arg-type]
    digests = torch.zeros(len(ids), dtype=torch.int64)
    assert stager.dump(caches, ids, table, digests=digests).done()
    want = torch.zeros(len(ids), nbytes, dtype=torch.uint8)
    HostStager("cpu").dump(caches, ids, want).wait()
    assert torch.equal(torch.stack(_rows(table)), want)
    assert torch.equal(digests, row_digests(want))

    target = [torch.zeros_like(c) for c in caches]
    assert stager.load(target, ids, table).done()
    for got, c in zip(target, caches):
        assert_bits_equal(got[[3, 1, 7, 10, 5]], c[[3, 1, 7, 10, 5]])

    # a byte flipped in the third row: that block is not scattered, the others are
    table.base[int(table.offsets[2]) + 100] ^= 1
    target = [torch.zeros_like(c) for c in caches]
    expected = [unsigned(d) for d in digests.tolist()]
    verdicts, handle = stager.load_checked(target, ids, table, expected)
    handle.wait()
    assert verdicts.tolist() == [True, True, False, True, True]
    for got, c in zip(target, caches):
        assert_bits_equal(got[[3, 1, 10, 5]], c[[3, 1, 10, 5]])
        assert not bool(got[7].view(torch.int16).any())


def test_a_table_of_other_rows_is_refused_before_a_byte_moves() -> None:
    caches = _caches()
    nbytes = payload_layout(caches, 1).nbytes
    table = _scattered(nbytes + 8, 2)
    before = table.base.clone()
    with pytest.raises(ValueError, match=f"rows are {nbytes + 8} bytes, a payload {nbytes}"):
        HostStager("cpu").dump(caches, [[1], [2]], table)
    with pytest.raises(ValueError, match="direct=True"):
        HostStager("cpu", direct=True).dump(caches, [[1], [2]], _scattered(nbytes, 2))
    with pytest.raises(ValueError, match="3 digests for 2 blocks"):
        HostStager("cpu").load_checked(caches, [[1], [2]], _scattered(nbytes, 2), [0, 0, 0])
    assert torch.equal(table.base, before)


def test_no_table_where_nothing_is_registered() -> None:
    region = memoryview(bytearray(4096))
    pinned = PinnedRegions()
    if pinned.register(region):  # a GPU host: the table is over the registered region
        table = pinned.table(np.array([address_of(region) + 2048], np.uint64), 1024)
        assert table is not None and table.offsets.tolist() == [2048] and table.is_pinned()
        with pytest.raises(ValueError, match="outside the registered regions"):
            pinned.table(np.array([1], np.uint64), 1024)
        pinned.close()
    else:
        assert pinned.table(np.array([0], np.uint64), 1024) is None


@cuda
@pytest.mark.parametrize("rows", [3, 64])  # few runs: a copy each; many: one launch
def test_cuda_stager_moves_a_table_of_registered_rows(rows: int) -> None:
    caches = _caches("cuda")
    nbytes = payload_layout(caches, 1).nbytes
    count = min(rows, 10)
    ids = [[1 + i] for i in range(count)]
    memory = memoryview(bytearray((2 * count + 1) * nbytes))
    pinned = PinnedRegions()
    assert pinned.register(memory)
    try:
        table = _scattered(nbytes, count, torch.frombuffer(memory, dtype=torch.uint8))
        stager = HostStager("cuda")
        digests = torch.zeros(count, dtype=torch.int64, pin_memory=True)
        stager.dump(caches, ids, table, digests=digests).wait()
        want = torch.zeros(count, nbytes, dtype=torch.uint8)
        HostStager("cpu").dump([c.cpu() for c in caches], ids, want).wait()
        assert torch.equal(torch.stack(_rows(table)), want)
        assert torch.equal(digests, row_digests(want))
        table.base[int(table.offsets[0]) + 8] ^= 1
        target = [torch.zeros_like(c) for c in caches]
        verdicts, handle = stager.load_checked(
            target, ids, table, [unsigned(d) for d in digests.tolist()]
        )
        handle.wait()
        assert verdicts.tolist() == [False] + [True] * (count - 1)
        for got, c in zip(target, caches):
            assert_bits_equal(got[2 : count + 1].cpu(), c[2 : count + 1].cpu())
            assert not bool(got[1].view(torch.int16).any())
    finally:
        pinned.close()


@cuda
def test_cuda_kernel_copies_rows_of_registered_memory() -> None:
    memory = memoryview(bytearray(64 * 65536))
    pinned = PinnedRegions()
    assert pinned.register(memory)
    try:
        base = torch.frombuffer(memory, dtype=torch.uint8)
        table = RowTable.of(base, torch.randperm(64)[:40].numpy() * 65536, 65536 - 16)
        dense = torch.randint(0, 256, (40, 65536 - 16), dtype=torch.uint8, device="cuda")
        copy_rows(dense, table, to_table=True, backend="triton")
        torch.cuda.synchronize()
        assert torch.equal(torch.stack(_rows(table)), dense.cpu())
        back = torch.zeros_like(dense)
        copy_rows(back, table, to_table=False, backend="triton")
        assert torch.equal(back, dense)
    finally:
        pinned.close()
