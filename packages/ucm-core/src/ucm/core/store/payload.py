"""A key's buffer as the stores see it: a :class:`Payload` of byte views whose
concatenation is the block (a scatter-gather list), checked before any I/O starts."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import numpy as np


class Payload:
    """One key's buffer as byte views: the payload is the concatenation of ``parts``.

    :meth:`deferred` makes one whose views are made only when a store moves it."""

    __slots__ = ("_parts", "nbytes")

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._parts = tuple(parts)
        self.nbytes = sum([p.nbytes for p in self._parts])

    @property
    def parts(self) -> tuple[memoryview, ...]:
        """The views, in payload order (a store takes them once per key it moves)."""
        return self._parts

    @classmethod
    def one(cls, view: memoryview) -> Payload:
        """A payload of one checked flat byte view (most buffers: made for every key of every
        batch on the caller's thread, so without the general constructor's work)."""
        made = cls.__new__(cls)
        made._parts = (view,)
        made.nbytes = view.nbytes
        return made

    @staticmethod
    def deferred(nbytes: int, source: Sequence[Sequence[memoryview]], index: int) -> Payload:
        """A payload of ``nbytes`` whose views are ``source[index]``, made each time a store
        takes :attr:`parts` and dropped when it is done with them.

        For payloads of many views (one per cache tensor): a batch of thousands of blocks
        made up front keeps every view alive until the batch ends, and each is an object the
        garbage collector tracks; tens of thousands of those set off its full collections
        (150 ms each with paddle loaded, holding the GIL that the I/O threads need).  The
        views are checked when made: a wrong size or a view that is not flat bytes fails
        that key only."""
        return _DeferredPayload(nbytes, source, index)

    def copy_to(self, dst: memoryview) -> None:
        """Write the payload to the start of ``dst``."""
        copy_parts(self.parts, dst)

    def fill_from(self, src: memoryview) -> None:
        """Fill the parts from the start of ``src``."""
        fill_parts(self.parts, src)


class _DeferredPayload(Payload):
    __slots__ = ("_index", "_source")

    def __init__(self, nbytes: int, source: Sequence[Sequence[memoryview]], index: int) -> None:
        self.nbytes = nbytes
        self._source = source
        self._index = index

    @property
    def parts(self) -> tuple[memoryview, ...]:
        made = as_payload(list(self._source[self._index]), writable=False, what="deferred payload")
        if made.nbytes != self.nbytes:
            raise ValueError(
                f"deferred payload {self._index} is {made.nbytes} bytes, promised {self.nbytes}"
            )
        return made.parts


def copy_parts(parts: Sequence[memoryview], dst: memoryview) -> None:
    """Write the concatenation of ``parts`` to the start of ``dst``."""
    at = 0
    for part in parts:
        dst[at : at + part.nbytes] = part
        at += part.nbytes


def fill_parts(parts: Sequence[memoryview], src: memoryview) -> None:
    """Fill ``parts`` in order from the start of ``src``."""
    at = 0
    for part in parts:
        part[:] = src[at : at + part.nbytes]
        at += part.nbytes


def quick_payload(buffer: object, writable: bool) -> Payload | None:
    """A single buffer that needs no checks spelled out, as a :class:`Payload`; None for
    anything else (lists, payloads, and what :func:`as_payload` refuses, with its reason).
    Made for every key of every batch on the caller's thread: a few attribute reads, no
    name formatted for an error that does not happen."""
    kind = type(buffer)
    if kind is memoryview:
        if _flat_bytes(buffer, writable):
            return Payload.one(buffer)  # type: ignore[arg-type]
        view: memoryview = buffer  # type: ignore[assignment]
    elif kind is np.ndarray:  # host rows (torch's .numpy()) and numpy buffers
        flags = buffer.flags  # type: ignore[attr-defined]
        if not (flags.c_contiguous and (flags.writeable or not writable)):
            return None
        view = memoryview(buffer)  # type: ignore[arg-type]
    elif kind in _BUFFERS:  # mmap, bytearray, bytes: flat bytes already
        view = memoryview(buffer)  # type: ignore[arg-type]
    else:
        return None
    if not view.c_contiguous or (writable and view.readonly):
        return None
    return Payload.one(view if view.format == "B" and view.ndim == 1 else view.cast("B"))


#: buffer types whose memoryview is flat bytes, C-contiguous
_BUFFERS = frozenset({mmap.mmap, bytearray, bytes})


def as_payload(buffer: object, *, writable: bool, what: str) -> Payload:
    """A buffer, or a list or tuple of buffers, as a :class:`Payload` (checked)."""
    quick = quick_payload(buffer, writable)
    if quick is not None:
        return quick
    if isinstance(buffer, Payload):
        return buffer
    if isinstance(buffer, (list, tuple)):
        if not buffer:
            raise ValueError(f"{what} is an empty list: give at least one buffer")
        return Payload(
            [
                b
                if _flat_bytes(b, writable)  # most parts: no checks to spell out, no f-string
                else byte_view(b, writable=writable, what=f"{what}[{j}]")
                for j, b in enumerate(buffer)
            ]
        )
    return Payload((byte_view(buffer, writable=writable, what=what),))


def _flat_bytes(buffer: object, writable: bool) -> bool:
    """Whether ``buffer`` is already a usable flat byte view (a slice of one, too)."""
    return (
        type(buffer) is memoryview
        and buffer.ndim == 1
        and buffer.format == "B"
        and buffer.strides == (1,)
        and not (writable and buffer.readonly)
    )


def byte_view(buffer: object, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of a buffer-protocol object; refuses what cannot be used as one."""
    if _flat_bytes(buffer, writable):
        return buffer  # type: ignore[return-value]
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must support the buffer protocol (bytes, bytearray, numpy array, "
            f"memoryview), got {type(buffer).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; a load needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def address_of(view: memoryview) -> int:
    """Where a flat byte view's memory starts (0 for an empty one), for a compiled call or a
    driver; the view must stay alive while the address is used."""
    if not view.nbytes:
        return 0
    if not view.readonly:  # ctypes' way is the cheaper, for writable memory only
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def addresses_of(views: Sequence[memoryview | None]) -> np.ndarray:
    """:func:`address_of` of each view as uint64, 0 for ``None``."""
    return np.array([0 if v is None else address_of(v) for v in views], dtype=np.uint64)


def view_bytes_of(views: Sequence[memoryview | None]) -> np.ndarray:
    """Each view's length as uint64, 0 for ``None``."""
    return np.array([0 if v is None else v.nbytes for v in views], dtype=np.uint64)
