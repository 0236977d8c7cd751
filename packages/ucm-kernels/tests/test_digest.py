"""Block digests on the device: the copy path's digests are :mod:`ucm.core.digest`'s bit for
bit (Triton through the interpreter here, on a GPU where there is one; the torch fallback),
a dump hands them out with its rows, and a checked load scatters only the blocks whose
digest is the stored one."""

from __future__ import annotations

import pytest
import torch
from ucm.core.digest import block_digest
from ucm.lab.testing.kernels import assert_bits_equal, random_bits

from ucm.kernels import HostStager, alloc_host_buffers, payload_layout
from ucm.kernels.api import triton_available
from ucm.kernels.digest import row_digests, unsigned

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _backends(device: str) -> list[str]:
    return ["auto", "torch"] + (["triton"] if triton_available(device) else [])


def _core(rows: torch.Tensor) -> list[int]:
    return [block_digest(row.cpu().numpy()) for row in rows]


@pytest.mark.parametrize("device", DEVICES)
def test_row_digests_are_the_cores_for_every_backend(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    wrong = []
    # rows shorter than, equal to and longer than a program's chunk; rows apart in storage
    for nbytes in (8, 4096, 16384, 16384 + 8, 3 * 16384 + 800):
        rows = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8, generator=gen)
        wide = torch.zeros(5, nbytes + 64, dtype=torch.uint8, device=device)
        wide[:, :nbytes] = rows.to(device)
        for backend in _backends(device):
            for apart, data in enumerate((rows.to(device), wide[:, :nbytes])):
                got = row_digests(data, backend)
                assert got.device.type == device
                if [unsigned(x) for x in got.tolist()] != _core(rows):
                    wrong.append((nbytes, backend, "apart" if apart else "contiguous"))
    assert not wrong


def test_rows_that_are_not_whole_words_are_refused() -> None:
    with pytest.raises(ValueError, match="whole words"):
        row_digests(torch.zeros(2, 12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous rows"):
        row_digests(torch.zeros(16, 2, dtype=torch.uint8).t())


def _caches(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [random_bits((8, 2, 4, 16), torch.bfloat16, gen).to(device) for _ in range(3)]


@pytest.mark.parametrize("device, backend", [(d, b) for d in DEVICES for b in _backends(d)])
def test_a_dump_digests_what_it_gathered_and_a_checked_load_scatters_only_good_blocks(
    device: str, backend: str
) -> None:
    # the scatter skips the blocks that failed (Triton: their ids made null on the device;
    # the other backends: the kept blocks picked)
    caches = _caches(device)
    lay = payload_layout(caches, 2)
    pin = device == "cuda"
    host = alloc_host_buffers(lay, 3, pin=pin)
    digests = torch.zeros(3, dtype=torch.int64, pin_memory=pin)
    stager = HostStager(device, backend=backend)
    ids = [[1, 2], [6, 3], [4, 5]]
    stager.dump(caches, ids, host, digests=digests).wait()
    want = _core(host)
    assert [unsigned(x) for x in digests.tolist()] == want
    # block 1's bytes changed after the dump (a corrupt copy): it never reaches the cache
    host[1, 100] ^= 0x10
    target = [torch.zeros_like(c) for c in caches]
    verdicts, handle = stager.load_checked(target, ids, host, want)
    handle.wait()
    assert verdicts.tolist() == [True, False, True]
    for t, c in zip(target, caches):
        assert_bits_equal(t[[1, 2, 4, 5]], c[[1, 2, 4, 5]])
        assert not bool(t[[3, 6]].view(torch.int16).any())
    # nothing good: nothing scattered
    before = [t.clone() for t in target]
    verdicts, handle = stager.load_checked(target, ids[:1], host[:1], [want[0] ^ 1])
    handle.wait()
    assert verdicts.tolist() == [False]
    assert all(
        torch.equal(t.view(torch.int16), b.view(torch.int16)) for t, b in zip(target, before)
    )
