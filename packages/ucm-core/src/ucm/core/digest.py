"""The digest of a block's payload: its checksum in every block format and seal of UCM.

Defined once, computed in three places that agree bit for bit: here (the compiled library,
or numpy where the wheel has none), and by the copy kernels on a GPU as they gather and
scatter blocks (``ucm.kernels.digest``), so a block dumped on a GPU host checks on a
CPU-only one, in ``ucm store verify``, and the other way round.

The payload is read as little-endian 64-bit words ``w[j]``, the last one zero-padded.  Each
word adds, modulo 2**64, the term::

    v = w[j] ^ ((j + 1) * P1)
    lo32(v) * hi32(v) + rotl64(w[j], 32)

to a sum, and the digest is :func:`finish` of the sum and the payload's length.  A term
depends only on a word and its place, so any piece of a payload sums on its own
(:func:`words_sum`) and the pieces' sums add up to the whole's: a GPU sums thousands of
pieces at once, a CPU eight words a vector, as fast as XXH3.

What it catches: a flip of any bit in the low half of a word changes that word's term
always, one in the high half but for 1 in 2**32 of the values around it; two words changed
at random cancel out with odds of about 1 in 2**64.  It is a checksum, not a MAC: anyone
can make two payloads with one digest, so a store shared with writers it does not trust
signs its blocks (:mod:`ucm.core.signing`) and checks the MAC on the host instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
from ucm.core.native import NATIVE

P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
MIX = 0x165667919E3779F9
MASK = (1 << 64) - 1
#: words a numpy pass takes at once (bounds its temporaries)
_NUMPY_WORDS = 1 << 17

#: the compiled library, None where the wheel has none (then numpy; tests set it None)
_LIBRARY = NATIVE


def compiled() -> bool:
    """Whether digests are computed by the compiled library (else numpy, much slower)."""
    return _LIBRARY is not None


def finish(total: int, nbytes: int) -> int:
    """The digest of a payload of ``nbytes`` whose words' terms sum to ``total``."""
    h = (total ^ (nbytes * P2)) & MASK
    h ^= h >> 37
    h = (h * MIX) & MASK
    return h ^ (h >> 32)


def words_sum(data: memoryview | bytes | bytearray, first: int = 0) -> int:
    """The sum of the terms of ``data``'s whole words, the first of them word ``first`` of
    its payload (bytes past the last whole word are not summed)."""
    view = memoryview(data).cast("B")
    n = view.nbytes // 8
    if not n:
        return 0
    buffer = np.frombuffer(view, np.uint8, count=8 * n)
    if _LIBRARY is not None:
        return int(_LIBRARY.ucm_digest_sum(buffer.ctypes.data, n, first))
    words = buffer.view("<u8")
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for at in range(0, n, _NUMPY_WORDS):
            w = words[at : at + _NUMPY_WORDS]
            key = np.arange(first + at + 1, first + at + 1 + w.size, dtype=np.uint64)
            key *= np.uint64(P1)
            v = w ^ key
            term = (v & np.uint64(0xFFFFFFFF)) * (v >> np.uint64(32))
            term += (w << np.uint64(32)) | (w >> np.uint64(32))
            total += term.sum(dtype=np.uint64)
    return int(total)


def copy_layer(
    dsts: np.ndarray,
    slots: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    parts: range,
    sums: np.ndarray,
) -> None:
    """Copy parts ``parts`` of every block of a batch into place and add the sum of each
    one's words where it landed to its block's ``sums`` (uint64, modulo 2**64).

    Block ``b`` lies at address ``slots[b]``; part ``p`` of its payload starts ``offsets[p]``
    bytes in, is ``lengths[p]`` bytes long (whole words) and lands at address
    ``dsts[b, p]`` (uint64 arrays).  A block's parts' sums add up to its payload's
    (:func:`finish` of the total is its digest), so a load may copy every block a layer at a
    time (a layer's parts) and check each once its last layer landed, over the very bytes
    the engine reads.  One compiled call, the GIL let go, where the library is built; numpy
    otherwise."""
    nblocks, nparts = dsts.shape
    if not (len(slots) == len(sums) == nblocks and len(offsets) == len(lengths) == nparts):
        raise ValueError("copy_layer takes a slot and a sum a block, an offset and a length a part")
    if bool((lengths % 8).any()) or bool((offsets % 8).any()):
        raise ValueError("copy_layer copies whole words: a part is not a multiple of 8 bytes")
    if not 0 <= parts.start <= parts.stop <= nparts or parts.step != 1:
        raise ValueError(f"parts {parts} are not a run of the {nparts} parts of a block")
    if _LIBRARY is not None:
        arrays = [np.ascontiguousarray(a, np.uint64) for a in (dsts, slots, offsets, lengths)]
        if sums.dtype != np.uint64 or not sums.flags.c_contiguous:
            raise ValueError("sums must be a contiguous uint64 array")
        _LIBRARY.ucm_copy_layer(
            nblocks, nparts, *(a.ctypes.data for a in arrays), parts.start, parts.stop,
            sums.ctypes.data,
        )  # fmt: skip
        return
    for b in range(nblocks):
        total = int(sums[b])
        for p in parts:
            n = int(lengths[p])
            into = (ctypes.c_char * n).from_address(int(dsts[b, p]))
            ctypes.memmove(into, int(slots[b]) + int(offsets[p]), n)
            total += words_sum(memoryview(into), int(offsets[p]) // 8)
        sums[b] = total & MASK


class Digest:
    """A payload's digest fed in pieces of any length (``update``, then ``intdigest``): the
    same as :func:`block_digest` of their concatenation."""

    def __init__(self) -> None:
        self._sum = 0
        self._words = 0  # whole words summed
        self._held = b""  # 0-7 bytes of the next word

    def update(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        if self._held:
            fill = min(8 - len(self._held), view.nbytes)
            self._held += view[:fill].tobytes()
            view = view[fill:]
            if len(self._held) < 8:
                return
            self._sum += words_sum(self._held, self._words)
            self._words += 1
            self._held = b""
        whole = view.nbytes // 8
        self._sum += words_sum(view, self._words)
        self._words += whole
        self._held = view[8 * whole :].tobytes()

    def intdigest(self) -> int:
        total = self._sum
        if self._held:  # the last word, zero-padded
            total += words_sum(self._held.ljust(8, b"\0"), self._words)
        return finish(total & MASK, 8 * self._words + len(self._held))


def block_digest(payload: memoryview | bytes | bytearray | Sequence[memoryview]) -> int:
    """The digest of a payload: one buffer, or buffers whose concatenation it is."""
    if isinstance(payload, (list, tuple)):
        digest = Digest()
        for part in payload:
            digest.update(part)
        return digest.intdigest()
    view = memoryview(payload).cast("B")  # type: ignore[arg-type]
    if _LIBRARY is not None and view.nbytes:
        return int(_LIBRARY.ucm_digest(np.frombuffer(view, np.uint8).ctypes.data, view.nbytes))
    digest = Digest()
    digest.update(view)
    return digest.intdigest()
