"""Helpers of the stores' tests: the one generator of keys and payloads (every byte depends
on an index or a key alone, so any process checks any block it loads without asking the one
that wrote it), the stores the tests open, Mooncake's settings, bytes flipped in shared
memory."""

import contextlib
import secrets
import threading
from collections.abc import Iterator

import numpy as np
import xxhash


def key(i: int, salt: bytes = b"") -> bytes:
    """Block key number ``i`` (16 bytes); ``salt`` makes another series."""
    return xxhash.xxh3_128_digest(salt + i.to_bytes(8, "little"))


def blob(i: int | bytes, size: int) -> np.ndarray:
    """``size`` bytes that depend on ``i`` alone (an index, or a key)."""
    seed = int.from_bytes(i, "little") if isinstance(i, bytes) else i
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def size_of(k: bytes, max_size: int) -> int:
    """A payload size in [1, ``max_size``] that depends on the key ``k`` alone."""
    return 1 + xxhash.xxh3_64_intdigest(b"size" + k) % max_size


def payload_of(k: bytes, max_size: int) -> bytes:
    """The payload of key ``k``: :func:`blob` of the key, of :func:`size_of` bytes."""
    return blob(k, size_of(k, max_size)).tobytes()


#: the secret of the stores of a ``-signed`` kind, in this environment variable
SECRET = "env:UCM_CONTRACT_SECRET"


def store_config(kind: str, tmp_path, request, **posix):
    """The settings of a store of ``kind`` for a test (``request``: its fixtures, for the
    shared-memory folder, the Mooncake master and the secret's variable):

    ``posix``, ``posix-o_direct``, ``dram`` (shared memory), ``dram-process``, ``tiered``
    (shared memory over posix), ``mooncake``, ``tiered-mooncake``, ``posix-over-mooncake``;
    ``KIND-signed``: ``KIND`` with a secret.  ``posix``: settings of the posix stores."""
    import attrs
    from ucm.core.config import DramStoreConfig, PosixStoreConfig, TieredStoreConfig

    if kind.endswith("-signed"):
        request.getfixturevalue("monkeypatch").setenv(SECRET[4:], "contract-test-secret-0123456789")
        unsigned = store_config(kind.removesuffix("-signed"), tmp_path, request, **posix)
        return attrs.evolve(unsigned, secret=SECRET)
    if kind in ("posix", "posix-o_direct"):
        direct = {"o_direct": True} if kind == "posix-o_direct" else {}
        return PosixStoreConfig(path=str(tmp_path / "p"), **direct, **posix)
    if kind == "dram":
        return shared_dram(request)
    if kind == "dram-process":
        return DramStoreConfig(capacity_gb=0.0625, scope="process")
    if kind == "tiered":
        return TieredStoreConfig(
            dram=shared_dram(request),
            backing=PosixStoreConfig(path=str(tmp_path / "t"), **posix),
        )
    master = request.getfixturevalue("mooncake_master")
    if kind == "mooncake":
        return mooncake_config(master)
    if kind == "posix-over-mooncake":  # a local disk in front of the cluster
        return TieredStoreConfig(
            local=PosixStoreConfig(path=str(tmp_path / "local"), **posix),
            backing=mooncake_config(master),
        )
    assert kind == "tiered-mooncake", kind
    return TieredStoreConfig(dram=shared_dram(request), backing=mooncake_config(master))


def shared_dram(request, capacity_gb: float = 0.0625):
    """A host dram store's settings in the test's shared-memory folder."""
    from ucm.core.config import DramStoreConfig

    return DramStoreConfig(capacity_gb=capacity_gb, path=str(request.getfixturevalue("shm_dir")))


def dram_store(folder, capacity_gb: float = 0.03125, **settings):
    """A host dram store (an arena in shared memory) in ``folder``."""
    from ucm.core.store import SharedMemoryStore, create_store

    store = create_store(
        {"kind": "dram", "path": str(folder), "capacity_gb": capacity_gb, **settings}
    )
    assert isinstance(store, SharedMemoryStore)
    return store


def mooncake_config(master, **overrides):
    """Settings of a mooncake store on ``master``, with a key prefix of its own: the
    session's tests share one master."""
    from ucm.core.config import MooncakeStoreConfig

    settings = {
        "master": master.address,
        "global_segment_gb": 0.0625,
        "key_prefix": f"test-{secrets.token_hex(4)}/",
    }
    settings.update(overrides)
    return MooncakeStoreConfig(**settings)


def flip_shared_block_byte(folder, key: bytes, offset: int = -1) -> None:
    """Flip one byte of ``key``'s block in the host dram store of ``folder`` (``offset``
    into its payload; -1 the last), writing the arena file as any other writer of it could."""
    import struct

    _flip_in_arena(folder, lambda arena: [arena.pin([struct.unpack("<QQ", key)])[0]], offset)


def flip_shared_bytes(folder, every: int = 1, offset: int = -100) -> int:
    """Flip one payload byte (``offset`` from its start, or from its end when negative) of
    every ``every``-th block stored in the host dram store of ``folder``; how many."""

    def pins(arena):
        npc = arena.np
        words = [(int(npc["key0"][s]), int(npc["key1"][s])) for s in arena.ready_slots()]
        return arena.pin(words[::every])

    return _flip_in_arena(folder, pins, offset)


def _flip_in_arena(folder, pin, offset: int) -> int:
    import os

    from ucm.core.store.dram.arena import ARENA_FILE, Arena

    arena = Arena.attach(str(folder), capacity_bytes=1 << 62, data=False)
    assert arena is not None, f"no arena in {folder}"
    try:
        pinned = pin(arena)
        assert pinned and all(p is not None for p in pinned), f"not stored in {folder}"
        arena.unpin(pinned)
        g = arena.geometry
        places = [g.meta_bytes + p.slot * g.slot_bytes + offset % p.length for p in pinned]
    finally:
        arena.close()
    fd = os.open(os.path.join(str(folder), ARENA_FILE), os.O_RDWR)
    try:
        for at in places:
            byte = os.pread(fd, 1, at)[0]
            os.pwrite(fd, bytes([byte ^ 0xFF]), at)
    finally:
        os.close(fd)
    return len(places)


@contextlib.contextmanager
def lock_held_elsewhere(arena) -> Iterator[None]:
    """Another thread of this process holds ``arena``'s lock (a dram store's) until the
    block ends: whatever the block asks of the arena waits for it, and gives up."""
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        with arena.locked():
            held.set()
            free.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        yield
    finally:
        free.set()
        holder.join()
