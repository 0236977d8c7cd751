"""The on-disk format of one stored block: a self-describing header page plus the payload.

Layout (all integers little-endian)::

    offset 0     magic "UCMB", format version (u16), header bytes (u16), flags (u32)
                 key (16 bytes), payload length (u64), payload digest (u64),
                 layout descriptor length (u16), layout descriptor (UTF-8)
                 [signed blocks: MAC (32 bytes)]
                 header xxh3-64 (u64) over everything before it, zero padding
    offset 4096  payload

The payload's digest is UCM's own (:mod:`ucm.core.digest`), which a GPU's copy kernels
compute as they gather a block; version 1 held its xxh3-64.

Upgrades: a change to this format bumps ``FORMAT_VERSION`` and the keys' namespace tag
(:mod:`ucm.core.keys`), so two versions never write the same name.  A block of another
version is a miss, never deleted on read (:class:`OtherVersion`); ``ucm store gc
--other-versions`` removes them once no build reads them.

The header takes a whole 4 KiB page so that the payload starts page-aligned: O_DIRECT
reads and writes then need no re-alignment, and the checksum of the header itself means a
torn or overwritten header is detected like a bad payload.

A signed block (flag ``SIGNED``, written by a store with a secret: :mod:`ucm.core.signing`)
carries a MAC over its header (up to the layout, with a zero payload digest) and payload
in place of the payload's digest.  A store with a secret takes no unsigned block and a
store without one no signed block: either is a miss.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from typing import Any

import attrs
import xxhash
from ucm.core.digest import Digest, block_digest
from ucm.core.keys import KEY_BYTES
from ucm.core.signing import MAC_BYTES, BlockSigner

MAGIC = b"UCMB"
#: 2: the payload's digest is :mod:`ucm.core.digest`'s (1: xxh3-64)
FORMAT_VERSION = 2
HEADER_BYTES = 4096
MAX_LAYOUT_BYTES = 1024
#: header flags
SIGNED = 1

_FIXED = struct.Struct("<4sHHI16sQQH")
#: the fields of _FIXED up to the payload's length: fixed for a key and a length
_PREFIX = struct.Struct("<4sHHI16sQ")
_CHECKSUM = struct.Struct("<Q")
_PADDING = bytes(HEADER_BYTES)


class BlockFormatError(ValueError):
    """A stored block failed verification; the caller treats it as a miss."""


class OtherVersion(BlockFormatError):
    """A block of another format version: a miss for this build, and not its to delete (a
    newer or older build sharing the store may read it)."""


class SigningMismatch(BlockFormatError):
    """A whole header, signed where the store does not sign or the other way round."""


@attrs.frozen
class BlockHeader:
    key: bytes
    payload_len: int
    payload_checksum: int
    layout: bytes
    version: int = FORMAT_VERSION
    mac: bytes = b""  # signed blocks: the MAC of ``signed`` and the payload
    signed: bytes = b""  # signed blocks: the header bytes the MAC covers


#: a payload: one buffer, or buffers whose concatenation it is (same checksum either way)
PayloadBytes = memoryview | bytes | bytearray | Sequence[memoryview]


def _parts(payload: PayloadBytes) -> Sequence[memoryview | bytes | bytearray]:
    return payload if isinstance(payload, (list, tuple)) else (payload,)  # type: ignore[return-value]


def payload_nbytes(payload: PayloadBytes) -> int:
    return sum(memoryview(p).nbytes for p in _parts(payload))


def payload_checksum(payload: PayloadBytes) -> int:
    """The payload's digest (:func:`ucm.core.digest.block_digest`)."""
    return block_digest(payload)


def encode_header(
    key: bytes, payload: PayloadBytes, layout: bytes = b"", signer: BlockSigner | None = None
) -> bytes:
    """The header page for ``payload`` stored under ``key`` (signed with ``signer``)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
    if len(layout) > MAX_LAYOUT_BYTES:
        raise ValueError(f"layout descriptor is {len(layout)} bytes, at most {MAX_LAYOUT_BYTES}")
    nbytes = payload_nbytes(payload)
    head = (
        _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            0 if signer is None else SIGNED,
            key,
            nbytes,
            0 if signer is not None else payload_checksum(payload),
            len(layout),
        )
        + layout
    )
    if signer is not None:
        mac = signer.hasher()
        mac.update(head)
        for part in _parts(payload):
            mac.update(part)
        head += mac.digest()
    head += _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))
    return head + bytes(HEADER_BYTES - len(head))


def header_prefix(key: bytes, payload_len: int) -> bytes:
    """The first bytes of the header of an unsigned block of this format holding
    ``payload_len`` bytes under ``key``: a reader that compares them before it reads a
    payload reads none of a block that is not the one asked for (another key, size, format
    or a signed block), without parsing the header."""
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, key, payload_len)


def decode_header(
    page: bytes | bytearray | memoryview,
    *,
    expect_key: bytes | None = None,
    expect_layout: bytes | None = None,
    signer: BlockSigner | None = None,
) -> BlockHeader:
    """Parse and check a header page; raise ``BlockFormatError`` naming the first problem.

    ``signer``: the store's (``None``: it has no secret); a block signed otherwise than the
    store signs is refused."""
    page = memoryview(page)
    if page.nbytes < _FIXED.size + _CHECKSUM.size:
        raise BlockFormatError(f"header truncated: {page.nbytes} bytes")
    magic, version, header_bytes, flags, key, payload_len, checksum, layout_len = (
        _FIXED.unpack_from(page)
    )
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {bytes(magic)!r}, not a UCM block")
    if version != FORMAT_VERSION:
        raise OtherVersion(f"format version {version}, this build reads {FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES or layout_len > MAX_LAYOUT_BYTES:
        raise BlockFormatError(f"bad header size {header_bytes} / layout length {layout_len}")
    if flags & ~SIGNED:
        raise BlockFormatError(f"unknown header flags {flags:#x}")
    signed = bool(flags & SIGNED)
    layout_end = _FIXED.size + layout_len
    end = layout_end + (MAC_BYTES if signed else 0)
    if page.nbytes < end + _CHECKSUM.size:
        raise BlockFormatError(f"header truncated: {page.nbytes} bytes")
    (stored,) = _CHECKSUM.unpack_from(page, end)
    if xxhash.xxh3_64_intdigest(page[:end]) != stored:
        raise BlockFormatError("header checksum mismatch")
    if signed != (signer is not None):
        raise SigningMismatch(
            "the block is signed and this store has no secret"
            if signed
            else "the block is not signed and this store takes only signed blocks"
        )
    if (
        page.nbytes >= HEADER_BYTES
        # as bytes: comparing a memoryview goes item by item, 20 times slower
        and page[end + _CHECKSUM.size : HEADER_BYTES].tobytes()
        != _PADDING[: HEADER_BYTES - end - _CHECKSUM.size]
    ):
        raise BlockFormatError("header padding is not zero")
    layout = bytes(page[_FIXED.size : layout_end])
    if expect_key is not None and key != expect_key:
        raise BlockFormatError(f"header names key {key.hex()}, expected {expect_key.hex()}")
    if expect_layout is not None and layout != expect_layout:
        raise BlockFormatError(f"layout {layout!r} differs from the expected {expect_layout!r}")
    if not signed:
        return BlockHeader(key, payload_len, checksum, layout, version)
    return BlockHeader(
        key,
        payload_len,
        checksum,
        layout,
        version,
        mac=page[layout_end:end].tobytes(),
        signed=page[:layout_end].tobytes(),
    )


def payload_hasher(header: BlockHeader, signer: BlockSigner | None = None) -> Any:
    """What checks ``header``'s payload: ``update`` it with the payload, in order, then
    :func:`check_payload`.  A :class:`~ucm.core.digest.Digest`, or the MAC of a signed
    block (fed the header bytes it covers already)."""
    if signer is None:
        return Digest()
    mac = signer.hasher()
    mac.update(header.signed)
    return mac


def check_payload(header: BlockHeader, hasher: Any) -> None:
    """Raise ``BlockFormatError`` unless ``hasher`` (:func:`payload_hasher`, fed the whole
    payload) matches the header."""
    if header.mac:
        if not hmac.compare_digest(header.mac, hasher.digest()):
            raise BlockFormatError("the block's MAC does not match (not written with this secret)")
    elif hasher.intdigest() != header.payload_checksum:
        raise BlockFormatError("payload checksum mismatch")


def verify_payload(
    header: BlockHeader, payload: PayloadBytes, signer: BlockSigner | None = None
) -> None:
    nbytes = payload_nbytes(payload)
    if nbytes != header.payload_len:
        raise BlockFormatError(f"payload is {nbytes} bytes, header says {header.payload_len}")
    if header.mac:
        hasher = payload_hasher(header, signer)
        for part in _parts(payload):
            hasher.update(part)
        check_payload(header, hasher)
    elif payload_checksum(payload) != header.payload_checksum:
        raise BlockFormatError("payload checksum mismatch")
