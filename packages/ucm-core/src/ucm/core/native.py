"""ucm-core's compiled library (``native/``: the block digest, the dram store's sealed
copies, pins and write books, the posix store's digested reads), loaded with ctypes where the
wheel was built with a C compiler."""

from __future__ import annotations

import ctypes
from pathlib import Path

#: beside this module in a wheel built with a C compiler (see hatch_build.py)
LIBRARY = Path(__file__).with_name("libucm_native.so")


def _load(kind: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL | None:
    try:
        library = kind(str(LIBRARY))
    except OSError:
        return None
    u64, p = ctypes.c_uint64, ctypes.c_void_p
    library.ucm_move_sealed.argtypes = [u64, ctypes.c_int, *[p] * 6]  # uint64 arrays
    library.ucm_move_sealed.restype = u64
    library.ucm_copy_layer.argtypes = [u64, u64, p, p, p, p, u64, u64, p]  # uint64 arrays
    library.ucm_copy_layer.restype = u64
    library.ucm_digest_sum.argtypes = [p, u64, u64]
    library.ucm_digest_sum.restype = u64
    library.ucm_digest.argtypes = [p, ctypes.c_size_t]
    library.ucm_digest.restype = u64
    c_int = ctypes.c_int
    library.ucm_open_block.argtypes = [c_int, ctypes.c_char_p, ctypes.c_char_p, p, u64, c_int, p]
    library.ucm_open_block.restype = c_int
    library.ucm_read_blocks.argtypes = [
        c_int, u64, p, u64, p, u64, p, u64, p, p, p, u64, c_int, p, p, p
    ]  # fmt: skip
    library.ucm_read_blocks.restype = None
    library.ucm_fs_type.argtypes = [c_int]
    library.ucm_fs_type.restype = ctypes.c_int64
    library.ucm_arena_pin.argtypes = [p, u64, u64, u64, u64, p, ctypes.c_int64, p, p]
    library.ucm_arena_pin.restype = u64
    library.ucm_arena_unpin.argtypes = [p, u64, u64, p, p]
    library.ucm_arena_unpin.restype = None
    library.ucm_arena_reserve.argtypes = [p, u64, u64, u64, u64, p, u64, ctypes.c_int, p, p, p]
    library.ucm_arena_reserve.restype = u64
    library.ucm_arena_publish.argtypes = [
        p, u64, u64, u64, u64, p, p, ctypes.c_int64, p, u64, p, u64, p, u64, p
    ]  # fmt: skip
    library.ucm_arena_publish.restype = u64
    i64 = ctypes.c_int64
    library.ucm_lock_new.argtypes = []
    library.ucm_lock_new.restype = p
    for name in ("ucm_lock_free", "ucm_lock_release", "ucm_lock_close"):
        getattr(library, name).argtypes = [p]
        getattr(library, name).restype = None
    library.ucm_lock_try.argtypes = [p]
    library.ucm_lock_try.restype = c_int
    library.ucm_lock_until.argtypes = [p, i64]
    library.ucm_lock_until.restype = c_int
    library.ucm_arena_load_chunk.argtypes = [
        p, c_int, c_int, u64, p, u64, u64, u64, u64, u64, u64, p, p, u64, p, p, p, i64, i64,
        p, p, p, p,
    ]  # fmt: skip
    library.ucm_arena_load_chunk.restype = c_int
    library.ucm_digest_choose.argtypes = [ctypes.c_int]
    library.ucm_digest_choose.restype = ctypes.c_int
    return library


#: the library, or None (a pure-Python wheel): its calls let go of the GIL while they run
NATIVE = _load()
#: the same library, its calls holding the GIL: for calls of a few microseconds under a
#: lock, where letting go of the GIL hands it to a thread that then waits for that lock
#: (the dram arena's pins: 7.9-8.5 us a block of 4 KiB loaded, against 6.1 holding it)
NATIVE_HELD = _load(ctypes.PyDLL)
