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


def test_blocks_copied_a_layer_at_a_time_sum_to_their_digests_where_they_landed(way):
    # a layered load: the first layer's part of every block, then the second's; each part's
    # sum is of the bytes where they landed, and a block's parts add up to its digest
    rng = np.random.default_rng(8)
    parts = [8 * 7, 8 * 4096, 8 * 2500 + 8 * 2048]  # a block's layers (the last > a piece)
    blocks = [rng.integers(0, 256, sum(parts), np.uint8) for _ in range(3)]
    landed = [np.zeros(sum(parts), np.uint8) for _ in blocks]
    offsets = np.cumsum([0, *parts])
    totals = [0] * len(blocks)
    for layer in reversed(range(len(parts))):  # in any order
        at, n = int(offsets[layer]), parts[layer]
        sums = digest.copy_sums(
            np.array([dst.ctypes.data + at for dst in landed], np.uint64),
            np.array([src.ctypes.data + at for src in blocks], np.uint64),
            np.full(len(blocks), n, np.uint64),
            np.full(len(blocks), at // 8, np.uint64),
        )
        for b, got in enumerate(sums.tolist()):
            totals[b] += got
    for src, dst, total in zip(blocks, landed, totals):
        assert np.array_equal(src, dst)
        assert finish(total & MASK, src.nbytes) == definition(src.tobytes())
    with pytest.raises(ValueError, match="multiple of 8"):
        digest.copy_sums(*(np.array([1], np.uint64) for _ in range(2)),
                         np.array([12], np.uint64), np.array([0], np.uint64))  # fmt: skip


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
