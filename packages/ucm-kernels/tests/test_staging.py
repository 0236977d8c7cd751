"""Host staging: the CPU path here; the CUDA path (pinned buffers, side stream, events)
needs a GPU and is skipped without one."""

from __future__ import annotations

import pytest
import torch
from ucm.lab.testing.kernels import assert_bits_equal, random_bits

from ucm.kernels import (
    HostStager,
    alloc_host_buffers,
    gather,
    payload_layout,
)

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="pinned staging and side streams need a CUDA GPU"
)


def _caches(device="cpu"):
    gen = torch.Generator().manual_seed(11)
    return [random_bits((8, 2, 4, 16), torch.bfloat16, gen).to(device) for _ in range(3)]


def test_cpu_dump_and_load_are_synchronous_and_exact() -> None:
    caches = _caches()
    lay = payload_layout(caches, 2)
    host = alloc_host_buffers(lay, 2, pin=False)
    stager = HostStager("cpu")
    handle = stager.dump(caches, [[1, 2], [6, 0]], host, null_block_id=0)
    assert handle.done() and handle.event is None
    handle.wait()
    want = torch.empty(2, lay.nbytes // 2, dtype=torch.bfloat16)
    gather(caches, [[1, 2], [6, 0]], want, null_block_id=0, backend="reference")
    assert_bits_equal(host.view(torch.bfloat16), want)
    target = [torch.zeros_like(c) for c in caches]
    assert stager.load(target, [[1, 2], [6, 0]], host, null_block_id=0).done()
    for t, c in zip(target, caches):
        assert_bits_equal(t[[1, 2, 6]], c[[1, 2, 6]])
        assert not bool(t.view(torch.int16)[[0, 3, 4, 5, 7]].any())


def test_alloc_host_buffers() -> None:
    buf = alloc_host_buffers(1000, 3, pin=False)
    assert buf.shape == (3, 1000) and buf.dtype == torch.uint8 and buf.device.type == "cpu"
    with pytest.raises(ValueError):
        alloc_host_buffers(0, 3)


@cuda
@pytest.mark.parametrize("direct", [False, True])
def test_cuda_dump_and_load_through_pinned_buffers(direct: bool) -> None:
    caches = _caches("cuda")
    lay = payload_layout(caches, 2)
    host = alloc_host_buffers(lay, 2)
    assert host.is_pinned()
    stager = HostStager("cuda", direct=direct)
    ids = [[1, 2], [6, 0]]
    handle = stager.dump(caches, ids, host, null_block_id=0)
    handle.wait()
    assert handle.done()
    want = torch.empty(2, lay.nbytes // 2, dtype=torch.bfloat16)
    gather([c.cpu() for c in caches], ids, want, null_block_id=0, backend="reference")
    assert_bits_equal(host.view(torch.bfloat16), want)
    target = [torch.zeros_like(c) for c in caches]
    handle = stager.load(target, ids, host, null_block_id=0)
    handle.wait_on()  # the current stream waits for the load before reading the blocks
    for t, c in zip(target, caches):
        assert_bits_equal(t[[1, 2, 6]].cpu(), c[[1, 2, 6]].cpu())


@cuda
def test_cuda_refuses_pageable_buffers() -> None:
    caches = _caches("cuda")
    host = alloc_host_buffers(payload_layout(caches, 2), 2, pin=False)
    with pytest.raises(ValueError, match="not pinned"):
        HostStager("cuda").dump(caches, [[1, 2], [3, 4]], host)


def test_rows_one_after_another_in_one_allocation_move_in_one_copy() -> None:
    # A store's slots (rows sliced from one tensor over its memory): each run of rows that
    # follow each other is one copy call, in the order of the store blocks.
    from ucm.kernels.staging import _runs

    memory = torch.arange(64, dtype=torch.uint8)
    other = torch.arange(8, dtype=torch.uint8)
    rows = (memory[0:8], memory[8:16], memory[16:24], memory[40:48], memory[32:40], other)
    runs = _runs(rows)
    assert [(first, tuple(view.shape)) for first, view in runs] == [
        (0, (3, 8)), (3, (1, 8)), (4, (1, 8)), (5, (1, 8))
    ]  # fmt: skip
    assert torch.equal(runs[0][1].reshape(-1), memory[:24])
    assert runs[0][1].data_ptr() == memory.data_ptr()  # a view: the copy lands in the rows
    assert torch.equal(runs[2][1][0], memory[32:40])


def test_host_memory_is_registered_only_where_there_is_a_gpu() -> None:
    from ucm.kernels import PinnedRegions

    region = memoryview(bytearray(4096))
    pinned = PinnedRegions()
    assert pinned.register(region) is torch.cuda.is_available()
    if pinned:
        (row,) = pinned.rows([region[1024:2048], region[3072:4096]])[:1]
        assert row.is_pinned() and row.numel() == 1024
        # one after another in rising order: one [rows, bytes] tensor, one copy
        rows = pinned.rows([region[0:1024], region[1024:2048], region[2048:3072]])
        assert isinstance(rows, torch.Tensor) and rows.shape == (3, 1024) and rows.is_pinned()
        with pytest.raises(ValueError):
            pinned.rows([memoryview(bytearray(16))])  # not inside a registered region
    pinned.close()
    assert not pinned
