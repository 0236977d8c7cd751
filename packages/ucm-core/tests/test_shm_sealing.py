"""The dram store's sealed copies: the compiled batch call and the Python routine move the
same bytes and compute the same seal, so blocks written by either check with the other, and
a block changed in shared memory fails either way."""

from __future__ import annotations

import mmap
import random
import shutil

import numpy as np
import pytest
from ucm.core import digest, native
from ucm.core.digest import block_digest
from ucm.core.store import Status, create_store
from ucm.core.store.dram import sealing
from ucm.lab.testing.core import blob, flip_shared_block_byte, key

# sizes around a word (8 bytes), the vector loops' rounds and the compiled copy's pieces
SIZES = [1, 16, 240, 241, 1023, 1024, 4096 + 5, 65536, 65537, 300_001]


def _need_library() -> None:
    """Skip where the wheel could not have compiled the library; fail where it should have."""
    if not sealing.compiled():
        if not (shutil.which("cc") or shutil.which("gcc")):
            pytest.skip("no C compiler here: the wheel is pure Python by design")
        pytest.fail(f"{native.LIBRARY} is missing: ucm-core's wheel was built without it")


@pytest.fixture(params=["compiled", "python"])
def path(request, monkeypatch):
    if request.param == "compiled":
        _need_library()
    else:
        monkeypatch.setattr(sealing, "_LIBRARY", None)
    return request.param


def test_the_library_is_built_where_there_is_a_c_compiler():
    _need_library()
    assert sealing.compiled()


def _slots(total: int) -> memoryview:
    return memoryview(mmap.mmap(-1, total))


@pytest.mark.parametrize("offset", [0, 3])  # a destination off the 16-byte grid, too
def test_blocks_move_into_slots_and_out_with_the_seal_of_their_bytes(path, offset):
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, n, np.uint8).tobytes() for n in SIZES]
    area = _slots(sum(SIZES) + offset + 4096)
    slots, at = [], offset
    for n in SIZES:
        slots.append(area[at : at + n])
        at += n
    # sources read-only (bytes) and in up to three parts, as a payload of several tensors
    parts = [_split(memoryview(b)) for b in blocks]
    names = [(i, i) for i in range(len(SIZES))]
    seals = sealing.move_sealed_batch(None, names, 0, list(zip(parts, slots)), into=True)
    wanted = [block_digest(b).to_bytes(8, "little") for b in blocks]
    assert seals == wanted
    assert [bytes(s) for s in slots] == blocks
    # checked where they lie, then copied out into parts of a writable buffer
    checks = [((), s) for s in slots]
    assert sealing.move_sealed_batch(None, names, 0, checks, into=False) == wanted
    outs = [bytearray(n) for n in SIZES]
    moves = [(_split(memoryview(o)), s) for o, s in zip(outs, slots)]
    assert sealing.move_sealed_batch(None, names, 0, moves, into=False) == wanted
    assert [bytes(o) for o in outs] == blocks


@pytest.mark.parametrize("form", [0, 2, 3], ids=["baseline", "avx2", "avx512"])
def test_the_compiled_copies_seal_with_the_digest_for_any_length_alignment_and_split(form):
    # each word loop of the library, against numpy's (itself checked against the
    # definition in test_digest.py): lengths around each vector round, random ones up to
    # 1 MiB, at random alignments of source and slot (a slot's streaming stores start on
    # the vector's grid), fed in random parts, checked whole, and copied back out into
    # random parts at random alignments
    _need_library()
    library = native.NATIVE
    chosen = library.ucm_digest_choose(form)
    try:
        rng = random.Random(form)
        source = np.random.default_rng(form).integers(0, 256, 1 << 21, np.uint8).tobytes()
        area = _slots(1 << 21)
        out = memoryview(bytearray(1 << 21))
        around = [k * 128 + d for k in range(1, 20) for d in (-9, -1, 0, 1, 8)]
        lengths = [*range(1, 300), *around, *(rng.randrange(300, 1 << 20) for _ in range(60))]
        for n in lengths:
            at = rng.randrange(64)
            data = memoryview(source)[at : at + n]
            slot = area[rng.randrange(64) :][:n]
            cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(4)))})
            parts = [data[a:b] for a, b in zip(cuts, cuts[1:])]
            want = numpy_digest(data).to_bytes(8, "little")
            moved = sealing.move_sealed_batch(None, [(0, 0)], 0, [(parts, slot)], into=True)
            checked = sealing.move_sealed_batch(None, [(0, 0)], 0, [((), slot)], into=False)
            assert (moved, checked) == ([want], [want]), (chosen, n, cuts)
            assert slot == data
            landed = out[rng.randrange(64) :][:n]
            cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(4)))})
            outs = [landed[a:b] for a, b in zip(cuts, cuts[1:])]
            loaded = sealing.move_sealed_batch(None, [(0, 0)], 0, [(outs, slot)], into=False)
            assert loaded == [want] and landed == data, (chosen, n, cuts)
    finally:
        library.ucm_digest_choose(3)


def numpy_digest(data: memoryview) -> int:
    """The digest computed without the library."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(digest, "_LIBRARY", None)
        return block_digest(data)


def _split(view: memoryview) -> list[memoryview]:
    n = view.nbytes
    cuts = sorted({0, n // 3, n // 2, n})
    return [view[a:b] for a, b in zip(cuts, cuts[1:])]


def test_the_compiled_call_refuses_parts_that_do_not_fill_their_slot_before_moving_a_byte():
    # it copies what the lengths say, so it checks them first: never past a slot's view
    _need_library()
    slot = _slots(4096)[:1000]
    for parts in ([memoryview(bytes(999))], [memoryview(b"x" * 600), memoryview(b"y" * 600)]):
        with pytest.raises(ValueError, match="do not add up to its 1000 bytes"):
            sealing.move_sealed_batch(None, [(0, 0)], 0, [(parts, slot)], into=True)
    mixed = [([memoryview(b"z" * 1000)], slot), ((), slot)]
    with pytest.raises(ValueError, match="every block"):
        sealing.move_sealed_batch(None, [(0, 0), (1, 1)], 0, mixed, into=True)
    assert bytes(slot) == bytes(1000)


def test_blocks_dumped_by_one_path_load_by_the_other_and_corruption_fails_both(
    shm_dir, monkeypatch
):
    _need_library()
    settings = {"kind": "dram", "path": str(shm_dir), "capacity_gb": 0.03125}
    keys = [key(i) for i in range(40)]  # more than one chunk of a copy thread
    data = [blob(i, 70_000) for i in range(40)]
    library = sealing._LIBRARY
    for writer, reader in ((library, None), (None, library)):
        with create_store(settings) as store:
            store.remove(keys)
            monkeypatch.setattr(sealing, "_LIBRARY", writer)
            assert all(r.ok for r in store.wait(store.dump(keys, data)))
            monkeypatch.setattr(sealing, "_LIBRARY", reader)
            out = [np.zeros(70_000, np.uint8) for _ in keys]
            assert all(r.ok for r in store.wait(store.load(keys, out)))
            for got, want in zip(out, data):
                np.testing.assert_array_equal(got, want)
    for library_now in (library, None):
        monkeypatch.setattr(sealing, "_LIBRARY", library_now)
        with create_store(settings) as store:
            assert store.wait(store.dump([key(99)], [blob(99, 70_000)]))[0].ok
            flip_shared_block_byte(shm_dir, key(99))
            out = [np.zeros(70_000, np.uint8)]
            assert store.wait(store.load([key(99)], out))[0].status is Status.CORRUPT
            assert store.lookup([key(99)]) == [False]
