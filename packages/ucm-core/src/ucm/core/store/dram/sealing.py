"""Copies into and out of the arena's slots, each block sealed as it moves.

A block's seal is its digest (:mod:`ucm.core.digest`), or with a secret the keyed MAC of its
name (the index words), layout, length and bytes; a load checks it against the one stored
at the dump.  A GPU's copy kernels compute the same digest as they gather a block into the
store's memory, and the store then only books it (:meth:`SlotWrites.commit`).

:func:`move_sealed_batch` moves a chunk of blocks in one call to the compiled library built
with ucm-core's wheel (``native/sealed_moves.c``), which holds the GIL once for the whole
chunk: per block, the Python routine (:func:`move_sealed`) releases and takes it back twice,
and with two copy threads each hand-over cost tens of microseconds on a small VM, as much
as the copy of a 256 KiB block.  Blocks of a signed store, and every block where the library
is absent (a wheel built without a C compiler), go through :func:`move_sealed`; both
compute the same seal.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from ucm.core.digest import Digest, block_digest
from ucm.core.native import NATIVE
from ucm.core.signing import BlockSigner
from ucm.core.store.payload import address_of

#: parts smaller than this are copied by memoryview (numpy's call costs more than it saves)
NUMPY_COPY_MIN = 64 << 10
_HEADER = struct.Struct("<QQQQ")  # what a MAC covers before the payload: name, layout, length
_CHECK, _INTO_SLOT, _OUT_OF_SLOT = 0, 1, 2  # the library's modes

#: one block's move: its parts (empty to check the slot only) and its slot's bytes
Move = tuple[Sequence[memoryview], memoryview]


#: the compiled library (None: a pure-Python wheel; tests set it None)
_LIBRARY = NATIVE


def compiled() -> bool:
    """Whether blocks move through the compiled library."""
    return _LIBRARY is not None


def move_sealed_batch(
    signer: BlockSigner | None,
    names: Sequence[tuple[int, int]],
    layout_word: int,
    moves: Sequence[Move],
    *,
    into: bool,
) -> list[bytes]:
    """:func:`move_sealed` for every block of ``moves`` (``names[i]`` is block i's name),
    in one compiled call where the library is there and the store is not signed."""
    if not moves:
        return []
    if _LIBRARY is None or signer is not None:
        return [
            move_sealed(signer, name, layout_word, parts, slot, into=into)
            for name, (parts, slot) in zip(names, moves)
        ]
    return _moved(moves, into)


def _moved(moves: Sequence[Move], into: bool) -> list[bytes]:
    assert _LIBRARY is not None
    n = len(moves)
    slots = [slot for _parts, slot in moves]
    lengths = [slot.nbytes for slot in slots]
    counts = [len(parts) for parts, _slot in moves]
    parts = [part for block, _slot in moves for part in block]
    if parts:
        if not all(counts):
            raise ValueError("a batch either copies every block or only checks them")
        # the library copies what the lengths say: never more than a slot's view holds
        # (most batches: a part a block, checked in one comparison)
        if len(parts) != n or [part.nbytes for part in parts] != lengths:
            at = 0
            for i, (count, length) in enumerate(zip(counts, lengths)):
                if sum([part.nbytes for part in parts[at : at + count]]) != length:
                    raise ValueError(f"block {i}'s parts do not add up to its {length} bytes")
                at += count
    # rows of uint64: each block's slot address, length, parts and (out) seal; each part's
    # address and length (one array each, their rows found by offset: ctypes' own
    # conversions cost microseconds apiece)
    blocks = np.array([[address_of(s) for s in slots], lengths, counts, [0] * n], np.uint64)
    pieces = np.array([[address_of(p) for p in parts], [p.nbytes for p in parts]], np.uint64)
    b, p, row, prow = blocks.ctypes.data, pieces.ctypes.data, 8 * n, 8 * len(parts)
    mode = _CHECK if not parts else _INTO_SLOT if into else _OUT_OF_SLOT
    # the views in ``moves`` stay alive, their memory mapped, until the call returns
    _LIBRARY.ucm_move_sealed(n, mode, b, b + row, b + 2 * row, p, p + prow, b + 3 * row)
    return [seal.to_bytes(8, "little") for seal in blocks[3].tolist()]


def move_sealed(
    signer: BlockSigner | None,
    words: tuple[int, int],
    layout_word: int,
    parts: Sequence[memoryview],
    slot: memoryview,
    *,
    into: bool,
) -> bytes:
    """Copy ``parts`` into the slot (``into``) or the slot into ``parts`` (empty ``parts``:
    only read it); the block's seal.  The routine in Python: for a signed store, and where
    the compiled library is absent.

    Each piece is hashed where it is read, then copied while it is in the cache: the seal
    of a dump is that of the bytes the caller gave (a slot that differs, written over while
    it was copied, fails its check at load), that of a load the slot's.  One hash and one
    copy call per piece, each releasing the GIL: copying and hashing in 64-256 KiB pieces
    was faster on one thread but much slower on two, each piece a hand-over of the GIL
    (2 MiB blocks: 1.47 of one thread's memcpy on two threads whole, 0.61 in pieces)."""
    if signer is None and len(parts) == 1:  # most blocks: one piece, one call each
        src, dst = (parts[0], slot) if into else (slot, parts[0])
        digest = block_digest(src)
        _copy(dst, src)
        return digest.to_bytes(8, "little")
    hasher: Any
    if signer is None:
        hasher = Digest()
    else:
        hasher = signer.hasher()
        hasher.update(_HEADER.pack(*words, layout_word, slot.nbytes))
    if not parts:
        hasher.update(slot)
    at = 0
    for part in parts:
        piece = slot[at : at + part.nbytes]
        src, dst = (part, piece) if into else (piece, part)
        hasher.update(src)
        _copy(dst, src)
        at += part.nbytes
    if signer is None:
        return hasher.intdigest().to_bytes(8, "little")  # type: ignore[no-any-return]
    return hasher.digest()  # type: ignore[no-any-return]


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, through numpy for large pieces: its copy releases the GIL, so the
    store's threads copy side by side."""
    if dst.nbytes < NUMPY_COPY_MIN:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
