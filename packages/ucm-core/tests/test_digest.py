"""The block digest: one definition (written out here word by word), computed alike by the
compiled library and by numpy, piece by piece or whole, and catching a flipped bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
from ucm.core import digest
from ucm.core.digest import MASK, P1, Digest, block_digest, finish, words_sum


def definition(data: bytes) -> int:
    """The digest as its docstring defines it, one word at a time in Python integers."""
    padded = data + bytes(-len(data) % 8)
    total = 0
    for j in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
        v = w ^ ((j + 1) * P1 & MASK)
        total += (v & 0xFFFFFFFF) * (v >> 32) + ((w << 32 | w >> 32) & MASK)
    return finish(total & MASK, len(data))


@pytest.fixture(params=["compiled", "numpy"])
def way(request, monkeypatch):
    if request.param == "compiled" and digest._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    if request.param == "numpy":
        monkeypatch.setattr(digest, "_LIBRARY", None)
    return request.param


def test_a_known_answer_is_pinned():
    # a change here changes every stored block's checksum: bump the block format with it
    assert block_digest(b"") == 0
    assert block_digest(bytes(range(256)) * 5) == definition(bytes(range(256)) * 5)
    assert block_digest(bytes(range(256)) * 5) == 0x501669559E6CF5C9


def test_every_length_and_split_gives_the_definitions_digest(way):
    rng = random.Random(5)
    source = np.random.default_rng(5).integers(0, 256, 1 << 16, np.uint8).tobytes()
    lengths = [*range(0, 140), 1023, 1024, 1025, 4099, 65535]
    for n in lengths:
        at = rng.randrange(16)
        data = source[at : at + n]
        want = definition(data)
        assert block_digest(data) == want, n
        parts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(5)))})
        pieces = [memoryview(data)[a:b] for a, b in zip(parts, parts[1:])]
        assert block_digest(pieces) == want, (n, parts)
        streamed = Digest()
        for piece in pieces:
            streamed.update(piece)
        assert streamed.intdigest() == want, (n, parts)


def test_pieces_sum_on_their_own_and_add_up_to_the_whole(way):
    # what lets a GPU sum thousands of pieces of a block at once, in any order
    data = np.random.default_rng(6).integers(0, 256, 8 * 5000, np.uint8).tobytes()
    cuts = [0, 8 * 7, 8 * 1000, 8 * 1001, 8 * 4096, len(data)]
    sums = [words_sum(data[a:b], a // 8) for a, b in zip(cuts, cuts[1:])]
    assert finish(sum(reversed(sums)) & MASK, len(data)) == definition(data)


@pytest.fixture(params=[3, 2, 0, "numpy"], ids=["avx512", "avx2", "baseline", "numpy"])
def form(request, monkeypatch):
    """Each of the library's word loops (those this processor has), and numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(digest, "_LIBRARY", None)
        yield request.param
        return
    if digest._LIBRARY is None:
        pytest.skip("the library was not built here (no C compiler)")
    chosen = digest._LIBRARY.ucm_digest_choose(request.param)
    if chosen != request.param:
        pytest.skip(f"this processor has no word loop {request.param}")
    try:
        yield chosen
    finally:
        digest._LIBRARY.ucm_digest_choose(3)


def test_blocks_copied_a_layer_at_a_time_sum_to_their_digests_where_they_landed(form):
    # a layered load: the first layer's parts of every block, then the second's; each
    # part's sum is of the bytes where they landed, and a block's parts add up to its digest
    rng = np.random.default_rng(8)
    lengths = np.array([8 * 7, 8 * 4096, 8 * 2501, 8 * 2048], np.uint64)  # around a vector
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    nbytes = int(lengths.sum())
    blocks = [rng.integers(0, 256, nbytes, np.uint8) for _ in range(3)]
    # each block's parts land apart from each other, in another order
    landed = [[np.zeros(int(n), np.uint8) for n in lengths] for _ in blocks]
    dsts = np.array([[part.ctypes.data for part in parts] for parts in landed], np.uint64)
    slots = np.array([block.ctypes.data for block in blocks], np.uint64)
    sums = np.zeros(len(blocks), np.uint64)
    for layer in (range(2, 4), range(0, 2)):  # in any order
        digest.copy_layer(dsts, slots, offsets, lengths, layer, sums)
    for block, parts, total in zip(blocks, landed, sums.tolist()):
        assert np.array_equal(np.concatenate(parts), block)
        assert finish(total, nbytes) == definition(block.tobytes())
    with pytest.raises(ValueError, match="multiple of 8"):
        digest.copy_layer(dsts, slots, offsets + np.uint64(4), lengths, range(0, 1), sums)
    with pytest.raises(ValueError, match="not a run"):
        digest.copy_layer(dsts, slots, offsets, lengths, range(0, 5), sums)


def test_a_flipped_bit_anywhere_in_a_block_changes_its_digest(way):
    data = bytearray(np.random.default_rng(7).integers(0, 256, 4096, np.uint8).tobytes())
    want = block_digest(data)
    rng = random.Random(7)
    for at in [*range(64), *(rng.randrange(len(data)) for _ in range(200))]:
        for bit in range(8):
            data[at] ^= 1 << bit
            assert block_digest(data) != want, (at, bit)
            data[at] ^= 1 << bit
    # two words swapped, a word moved, the block one zero byte longer
    words = np.frombuffer(bytes(data), np.uint64).copy()
    words[[3, 9]] = words[[9, 3]]
    assert block_digest(words.tobytes()) != want
    assert block_digest(bytes(data[8:] + data[:8])) != want
    assert block_digest(bytes(data) + b"\0") != want
