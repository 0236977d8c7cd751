"""What another user of the host can do to a store, and what it must not achieve.

An attacker here is a process of another uid (a forked child that drops root for
``nobody``); the victim, where its own uid matters (the store trusts folders of its user or
root), is a forked child running as uid 1000.  Covered:

1. folders: a folder another user made (or can write) at the store's path, a folder of the
   victim's own that group or others can write, a link at the store path or on the way to
   it: refused with a ``ConfigError`` naming the path, the owner and the mode, before a
   block is read; a private folder is accepted;
2. the dram store's default folder is per user (``/dev/shm/ucm-<uid>``);
3. a parent folder that others can write is refused unless it has the sticky bit;
4. a FIFO, or a link to a FIFO, ``/dev/tty`` or another user's file, at a block's path:
   loads return at once without the foreign bytes, the store keeps working, and
   ``ucm store verify`` / ``stats`` finish;
5. signed stores: keyed file names, blocks without the secret (or with another one) are
   never loaded, a flipped payload bit is corrupt, and the secret's settings are checked;
6. a huge sparse file at a block's path loads as an error without the process's memory
   growing;
7. a hostile marker file (``ucm-store.json``) does not crash ``ucm store stats``.
"""

from __future__ import annotations

import os
import pickle
import pwd  # noqa: F401 - imported while root: a child that dropped root names owners with it
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from ucm.core.block_format import _CHECKSUM, _FIXED, HEADER_BYTES, encode_header
from ucm.core.config import DramStoreConfig, PosixStoreConfig
from ucm.core.settings import ConfigError
from ucm.core.signing import BlockSigner
from ucm.core.store import PosixStore, SharedMemoryStore, Status
from ucm.core.store.dram.shared import MEMORY_FILESYSTEMS, mount_of
from ucm.lab.testing.core import key as key_of  # the tests name a key `key`

_ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="runs the attacker and the victim as other users: needs root"
)


def needs_root(test):
    """Runs processes as other users (setresuid) or gives files to them (chown)."""
    return pytest.mark.root(_ROOT_ONLY(test))


ATTACKER = 65534  # nobody
VICTIM = 1000
CHILD_TIMEOUT = 30.0
LOAD_TIMEOUT = 5.0  # a load that waits on a FIFO never returns: it must not take this long
ATTACKER_BYTES = b"attacker's bytes" * 64
SECRET = "a-test-secret-of-some-length-0123456789"
OTHER_SECRET = "another-secret-nobody-gave-the-victim-42"


def payload(i: int, size: int = 4096) -> bytes:
    return (key_of(i) * (size // 16 + 1))[:size]


def forged_block(key: bytes, data: bytes, signer: BlockSigner | None = None) -> bytes:
    """A well-formed block file for ``key`` holding ``data``: what anyone can compute."""
    return encode_header(key, data, b"", signer) + data


def block_path(root: str | Path, name: str) -> Path:
    return Path(root) / "blocks" / name[:2] / name


def plant(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def give_to_attacker(path: Path) -> None:
    """Make ``path`` (not followed) the attacker's, where this process may."""
    if os.geteuid() == 0:
        os.lchown(path, ATTACKER, ATTACKER)


def protected_symlinks() -> bool:
    """Whether the kernel itself refuses to follow another user's link in a sticky folder
    (``fs.protected_symlinks``): then a planted link fails with EACCES before the store
    sees it."""
    try:
        return Path("/proc/sys/fs/protected_symlinks").read_text().strip() != "0"
    except OSError:
        return False


# --- running code as another user ------------------------------------------------------------


def as_user(uid: int | None, fn: Callable[[], object], timeout: float = CHILD_TIMEOUT):
    """Run ``fn()`` in a forked child as ``uid`` (its own group, no other groups; ``None``:
    this process's own).  Returns ``("returned", value)`` or ``("raised", type name, message)``."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads: the
        # child only opens stores (threads of its own) and exits
        warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            try:
                outcome: tuple = ("returned", fn())
            except Exception as exc:
                outcome = ("raised", type(exc).__name__, str(exc))
            with os.fdopen(write_end, "wb") as out:
                out.write(pickle.dumps(outcome))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"a child running as uid {uid} took over {timeout} s")
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child as uid {uid} failed (see stderr)"
    return pickle.loads(b"".join(chunks))


def assert_refused(outcome, *needles: str) -> str:
    """``outcome`` (of :func:`as_user`) is a ``ConfigError`` whose message holds every needle."""
    assert outcome[0] == "raised", f"the store was opened: {outcome!r}"
    assert outcome[1] == "ConfigError", outcome
    for needle in needles:
        assert needle in outcome[2], f"{needle!r} not in: {outcome[2]}"
    return outcome[2]


def victim_loads(open_store: Callable[[], PosixStore], key: bytes, size: int):
    """What the victim's child runs: open the store and load ``key``; returns the status and
    the bytes loaded (only when the store could be opened)."""

    def victim():
        store = open_store()
        try:
            out = bytearray(size)
            (result,) = store.load([key], [out]).wait(LOAD_TIMEOUT)
            return result.status.name, bytes(out)
        finally:
            store.close()

    return victim


def opener(kind: str, path: str) -> Callable[[], PosixStore]:
    if kind == "dram":
        return lambda: SharedMemoryStore(DramStoreConfig(path=path, capacity_gb=0.0625))
    return lambda: PosixStore(PosixStoreConfig(path=path))


# --- folders -----------------------------------------------------------------------------------


@pytest.fixture
def base():
    """A folder of root's in /tmp that every user can traverse (pytest's tmp_path cannot)."""
    path = tempfile.mkdtemp(prefix="ucm-sectest-", dir="/tmp")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm():
    """Makes fresh names in /dev/shm (``shm()``), each removed afterwards."""
    found = mount_of("/dev/shm") if os.path.isdir("/dev/shm") else None
    if found is None or found[1] not in MEMORY_FILESYSTEMS:
        pytest.skip("no memory filesystem at /dev/shm")
    made: list[Path] = []

    def new() -> Path:
        made.append(Path(f"/dev/shm/ucm-sectest-{uuid.uuid4().hex[:12]}"))
        return made[-1]

    yield new
    for path in made:
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path, ignore_errors=True)


def attacker_plants_store(path: Path, mode: int, key: bytes) -> None:
    """As the attacker: make ``path`` a folder of its own (``mode``) holding a well-formed
    block of ``key`` with the attacker's bytes."""

    def attacker():
        (path / "blocks" / key.hex()[:2]).mkdir(parents=True)
        for folder in (path, path / "blocks", path / "blocks" / key.hex()[:2]):
            os.chmod(folder, mode)
        plant(block_path(path, key.hex()), forged_block(key, ATTACKER_BYTES))

    assert as_user(ATTACKER, attacker)[0] == "returned"


@needs_root
@pytest.mark.parametrize("kind", ["dram", "posix"])
@pytest.mark.parametrize("mode", [0o777, 0o755], ids=["0777", "0755"])
def test_a_store_folder_made_by_another_user_is_refused_before_a_block_is_read(shm, kind, mode):
    path = shm()
    key = key_of(1)
    attacker_plants_store(path, mode, key)
    outcome = as_user(VICTIM, victim_loads(opener(kind, str(path)), key, len(ATTACKER_BYTES)))
    assert_refused(outcome, str(path), f"uid {ATTACKER}", f"mode {mode:04o}", "chmod 700")


@needs_root
@pytest.mark.parametrize("kind", ["dram", "posix"])
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=["group", "others", "sticky"])
def test_a_store_folder_of_ones_own_that_others_can_write_is_refused(shm, kind, mode):
    path = shm()
    path.mkdir()
    os.chown(path, VICTIM, VICTIM)
    os.chmod(path, mode)
    outcome = as_user(VICTIM, lambda: opener(kind, str(path))().close())
    assert_refused(outcome, str(path), f"uid {VICTIM}", f"mode {mode:04o}")


@needs_root
@pytest.mark.parametrize("kind", ["dram", "posix"])
def test_a_private_folder_of_ones_own_is_accepted(shm, kind):
    """The control of the refusals above: the same victim, a folder of its own."""
    path = shm()

    def victim():
        store = opener(kind, str(path))()
        try:
            stored = store.wait(store.dump([key_of(1)], [payload(1)]))
            out = bytearray(4096)
            loaded = store.wait(store.load([key_of(1)], [out]))
            return [r.status.name for r in stored + loaded], bytes(out)
        finally:
            store.close()

    assert as_user(VICTIM, victim) == ("returned", (["OK", "OK"], payload(1)))
    st = os.stat(path)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (VICTIM, 0o700)


def test_a_blocks_folder_others_can_write_is_refused(base):
    root = base / "store"
    (root / "blocks").mkdir(parents=True)
    os.chmod(root, 0o700)
    os.chmod(root / "blocks", 0o777)
    with pytest.raises(ConfigError, match="not a folder that only you can write") as info:
        PosixStore(PosixStoreConfig(path=str(root)))
    assert str(root / "blocks") in str(info.value)


def test_a_refused_store_leaves_no_descriptor_open_and_no_writer_registered(base):
    """Refused after the store has registered itself as a writer (the blocks folder is
    checked then): what it opened is closed again.  In a child: no other thread opens files."""
    root = base / "store"
    (root / "blocks").mkdir(parents=True)
    os.chmod(root / "blocks", 0o777)

    def refuse_three_times():
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            try:
                PosixStore(PosixStoreConfig(path=str(root)))
            except ConfigError:
                pass
        return len(os.listdir("/proc/self/fd")) - before

    assert as_user(None, refuse_three_times) == ("returned", 0), "descriptors leaked"
    assert not list((root / "writers").glob("*"))


@needs_root
def test_a_link_planted_at_the_store_path_is_refused(shm):
    theirs, link = shm(), shm()
    key = key_of(2)
    attacker_plants_store(theirs, 0o755, key)
    assert as_user(ATTACKER, lambda: os.symlink(theirs, link))[0] == "returned"
    outcome = as_user(VICTIM, victim_loads(opener("dram", str(link)), key, len(ATTACKER_BYTES)))
    if protected_symlinks() and outcome[1] != "ConfigError":
        # the kernel refused to follow the attacker's link before the store saw it
        assert outcome[:2] == ("raised", "OSError") and str(link) in outcome[2], outcome
        return
    assert_refused(outcome, str(link), "symbolic link")


@needs_root
def test_a_link_of_another_user_on_the_way_to_the_store_is_refused(shm):
    """The victim's own folder, reached through a link the attacker owns (and could point
    anywhere later): refused; through a link of the victim's own: accepted."""
    mine, theirs_link, my_link = shm(), shm(), shm()
    mine.mkdir(mode=0o700)
    os.chown(mine, VICTIM, VICTIM)
    assert as_user(ATTACKER, lambda: os.symlink(mine, theirs_link))[0] == "returned"
    assert as_user(VICTIM, lambda: os.symlink(mine, my_link))[0] == "returned"

    outcome = as_user(VICTIM, lambda: PosixStore(PosixStoreConfig(path=f"{theirs_link}/s")).close())
    if not (protected_symlinks() and outcome[1] == "OSError"):
        assert_refused(outcome, str(theirs_link), f"uid {ATTACKER}", "another user owns")
    assert not (mine / "s").exists()  # refused before anything was made through the link
    assert as_user(VICTIM, lambda: PosixStore(PosixStoreConfig(path=f"{my_link}/s")).close()) == (
        "returned",
        None,
    )
    assert (mine / "s" / "blocks").is_dir()


# --- 2. the dram store's default folder ---------------------------------------------------------


@needs_root
def test_the_dram_default_folder_is_per_user():
    assert DramStoreConfig().path == f"/dev/shm/ucm-{os.geteuid()}"
    assert as_user(VICTIM, lambda: DramStoreConfig().path) == ("returned", f"/dev/shm/ucm-{VICTIM}")


# --- 3. parent folders ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2], ids=["parent", "grandparent"])
def test_a_parent_folder_others_can_write_without_the_sticky_bit_is_refused(base, depth):
    open_folder = base / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)
    path = open_folder / "sub" / "store" if depth == 2 else open_folder / "store"
    with pytest.raises(ConfigError) as info:
        PosixStore(PosixStoreConfig(path=str(path)))
    assert f"{open_folder} (owner" in str(info.value) and "mode 0777" in str(info.value)


@needs_root
def test_a_parent_folder_of_another_user_is_refused(base):
    theirs = base / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, ATTACKER, ATTACKER)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(theirs))} \(owner .*uid {ATTACKER}"):
        PosixStore(PosixStoreConfig(path=str(theirs / "store")))


def test_a_parent_folder_with_the_sticky_bit_is_accepted(base):
    sticky = base / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /tmp and /dev/shm: others cannot replace the store folder
    store = PosixStore(PosixStoreConfig(path=str(sticky / "store")))
    try:
        assert store.wait(store.dump([key_of(3)], [payload(3)]))[0].ok
        out = bytearray(4096)
        assert store.wait(store.load([key_of(3)], [out]))[0].ok and bytes(out) == payload(3)
    finally:
        store.close()


# --- 4. what sits at a block's path --------------------------------------------------------------


def plant_not_a_block(kind: str, at: Path, attacker_dir: Path, key: bytes) -> Path | None:
    """Put ``kind`` at a block's path ``at``; returns the attacker's file a link points at."""
    at.parent.mkdir(parents=True, exist_ok=True)
    attacker_dir.mkdir(exist_ok=True)
    target = None
    if kind == "fifo":
        os.mkfifo(at)
        give_to_attacker(at)
        return None
    if kind == "link-to-fifo":
        target = attacker_dir / f"fifo-{key.hex()}"
        if not target.exists():
            os.mkfifo(target)
    elif kind == "link-to-tty":
        target = Path("/dev/tty")
    elif kind == "link-to-attacker-block":  # a well-formed block of the key, with their bytes
        target = plant(attacker_dir / f"block-{key.hex()}", forged_block(key, ATTACKER_BYTES))
        give_to_attacker(target)
    os.symlink(target, at)
    give_to_attacker(at)
    return target if kind == "link-to-attacker-block" else None


def unblock_fifos(*paths: Path) -> None:
    """Release a reader stuck opening a FIFO (only if the store waited on one: a failure)."""
    for path in paths:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


NOT_BLOCKS = ["fifo", "link-to-fifo", "link-to-tty", "link-to-attacker-block"]


@pytest.mark.parametrize("o_direct", [False, True], ids=["pagecache", "o_direct"])
@pytest.mark.parametrize("kind", NOT_BLOCKS)
def test_what_is_not_a_block_file_is_never_loaded_and_never_hangs(base, kind, o_direct):
    root = base / "store"
    good, bad = key_of(10), key_of(11)
    size = len(ATTACKER_BYTES)
    store = PosixStore(PosixStoreConfig(path=str(root), o_direct=o_direct))
    at = block_path(root, bad.hex())
    try:
        assert store.wait(store.dump([good], [payload(10, size)]))[0].ok
        target = plant_not_a_block(kind, at, base / "attacker", bad)
        assert store.lookup([bad]) == [False]

        out = bytearray(b"\xab" * size)
        (result,) = store.load([bad], [out]).wait(LOAD_TIMEOUT)  # TimeoutError: it hung
        assert result.status in (Status.CORRUPT, Status.MISS), result
        assert out == b"\xab" * size  # the engine's buffer is untouched
        assert store.errors == (1 if result.status is Status.CORRUPT else 0)
        if target is not None:  # the link went, never what it pointed at
            assert target.read_bytes() == forged_block(bad, ATTACKER_BYTES)

        # the store goes on: another block loads, and the key can be stored over the thing
        loaded = bytearray(size)
        assert store.load([good], [loaded]).wait(LOAD_TIMEOUT)[0].ok
        assert loaded == payload(10, size)
        if not os.path.lexists(at):
            plant_not_a_block(kind, at, base / "attacker", bad)
        assert store.dump([bad], [payload(11, size)]).wait(LOAD_TIMEOUT)[0].ok
        assert store.load([bad], [loaded]).wait(LOAD_TIMEOUT)[0].ok
        assert loaded == payload(11, size)
    finally:
        unblock_fifos(at, base / "attacker" / f"fifo-{bad.hex()}")
        store.close()


def ucm_cli(*args: str, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucm.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,  # subprocess.TimeoutExpired: it hung
    )


def test_verify_and_stats_finish_on_a_store_holding_fifos_and_links(base):
    root = base / "store"
    store = PosixStore(PosixStoreConfig(path=str(root)))
    try:
        assert store.wait(store.dump([key_of(20)], [payload(20)]))[0].ok
    finally:
        store.close()
    planted = []
    for i, kind in enumerate(NOT_BLOCKS):
        key = key_of(21 + i)
        planted.append(block_path(root, key.hex()))
        plant_not_a_block(kind, planted[-1], base / "attacker", key)
    try:
        verify = ucm_cli("store", "verify", str(root))
        stats = ucm_cli("store", "stats", "--json", str(root))
    finally:
        unblock_fifos(*planted, *(base / "attacker").glob("fifo-*"))
    assert verify.returncode == 0 and "Traceback" not in verify.stderr, verify
    for path in planted:
        assert f"FOREIGN {path}" in verify.stdout
    assert "OK: 1 blocks checked, 0 corrupt" in verify.stdout
    assert stats.returncode == 0 and '"blocks": 1' in stats.stdout, stats
    assert f'"foreign_files": {len(NOT_BLOCKS)}' in stats.stdout


# --- 5. signed stores ------------------------------------------------------------------------


@pytest.fixture
def secrets_env(monkeypatch):
    monkeypatch.setenv("UCM_TEST_SECRET", SECRET)
    monkeypatch.setenv("UCM_TEST_OTHER_SECRET", OTHER_SECRET)


@pytest.fixture
def shared_folder(base):
    """A folder every user can write, as a team's shared mount."""
    path = base / "shared"
    path.mkdir()
    os.chmod(path, 0o777)
    return path


def signed_store(path: Path, secret: str = "env:UCM_TEST_SECRET") -> PosixStore:
    return PosixStore(PosixStoreConfig(path=str(path), shared=True, secret=secret))


def block_names(root: Path) -> set[str]:
    return {p.name for p in (root / "blocks").rglob("*") if p.is_file()}


@pytest.mark.parametrize("kind", ["posix", "dram"])
def test_signed_blocks_round_trip_under_names_keyed_by_the_secret(
    secrets_env, shared_folder, shm, kind
):
    if kind == "posix":
        root = shared_folder
        store = signed_store(root)
    else:
        root = shm()
        store = SharedMemoryStore(
            DramStoreConfig(path=str(root), capacity_gb=0.0625, secret="env:UCM_TEST_SECRET")
        )
    keys = [key_of(30 + i) for i in range(4)]
    try:
        assert all(r.ok for r in store.wait(store.dump(keys, [payload(30 + i) for i in range(4)])))
        out = [bytearray(4096) for _ in keys]
        assert all(r.ok for r in store.wait(store.load(keys, out)))
        assert out == [payload(30 + i) for i in range(4)]
        if kind == "posix":
            names = block_names(root)
        else:  # the keys of the arena's index
            arena = store._arena
            names = {
                (int(arena.np["key0"][s]).to_bytes(8, "little")
                 + int(arena.np["key1"][s]).to_bytes(8, "little")).hex()
                for s in arena.ready_slots()
            }  # fmt: skip
    finally:
        store.close()
    assert len(names) == len(keys)
    assert not names & {k.hex() for k in keys}  # a prompt's block cannot be found by its key
    signer = BlockSigner.from_secret(SECRET.encode())
    assert names == {signer.name(k).hex() for k in keys}


def test_blocks_written_without_the_secret_are_never_loaded(secrets_env, shared_folder):
    root = shared_folder
    key = key_of(40)
    victim = signed_store(root)
    attacker = signed_store(root, "env:UCM_TEST_OTHER_SECRET")
    try:
        # under the names the attacker can make: the key's own, or keyed by another secret
        assert attacker.wait(attacker.dump([key], [ATTACKER_BYTES]))[0].ok
        plant(block_path(root, key.hex()), forged_block(key, ATTACKER_BYTES))
        out = bytearray(len(ATTACKER_BYTES))
        assert victim.wait(victim.load([key], [out]))[0].status is Status.MISS
        assert victim.lookup([key]) == [False]

        # over the victim's own block (the header names its key): a MAC under another
        # secret, or none at all
        mine = payload(40, len(ATTACKER_BYTES))
        assert victim.wait(victim.dump([key], [mine]))[0].ok
        victim_file = block_path(root, BlockSigner.from_secret(SECRET.encode()).name(key).hex())
        other = BlockSigner.from_secret(OTHER_SECRET.encode())
        for forged in (forged_block(key, ATTACKER_BYTES, other), forged_block(key, ATTACKER_BYTES)):
            plant(victim_file, forged)
            errors = victim.errors
            out = bytearray(len(ATTACKER_BYTES))
            (result,) = victim.wait(victim.load([key], [out]))
            assert result.status is Status.CORRUPT, result
            assert victim.errors == errors + 1
            assert not victim_file.exists()  # removed: the next dump stores the real block
    finally:
        attacker.close()
        victim.close()


def test_a_store_without_a_secret_never_loads_a_signed_block(secrets_env, base):
    store = PosixStore(PosixStoreConfig(path=str(base / "store")))
    key = key_of(45)
    try:
        signer = BlockSigner.from_secret(SECRET.encode())
        plant(block_path(base / "store", key.hex()), forged_block(key, ATTACKER_BYTES, signer))
        (result,) = store.wait(store.load([key], [bytearray(len(ATTACKER_BYTES))]))
        assert result.status is Status.CORRUPT and "signed" in result.detail, result
    finally:
        store.close()


def test_a_flipped_payload_byte_of_a_signed_block_is_corrupt(secrets_env, shared_folder):
    store = signed_store(shared_folder)
    key = key_of(50)
    try:
        assert store.wait(store.dump([key], [payload(50)]))[0].ok
        (name,) = block_names(shared_folder)
        path = block_path(shared_folder, name)
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0x01]))
        out = bytearray(4096)
        (result,) = store.wait(store.load([key], [out]))
        assert result.status is Status.CORRUPT and "MAC" in result.detail, result
        assert store.errors == 1
        assert store.lookup([key]) == [False]
    finally:
        store.close()


def test_a_shared_store_without_a_secret_is_refused(shared_folder):
    with pytest.raises(ConfigError, match="secret"):
        PosixStoreConfig(path=str(shared_folder), shared=True)


def test_a_folder_others_can_write_is_taken_only_as_a_shared_signed_store(
    secrets_env, shared_folder
):
    with pytest.raises(ConfigError, match="shared: true with a secret"):
        PosixStore(PosixStoreConfig(path=str(shared_folder)))
    signed_store(shared_folder).close()


@pytest.mark.parametrize(
    ("mode", "owner"),
    [
        pytest.param(0o644, None, id="0644"),
        pytest.param(0o640, None, id="0640"),
        pytest.param(
            0o600, ATTACKER, id="0600-of-another-user", marks=[pytest.mark.root, _ROOT_ONLY]
        ),
    ],
)
def test_a_secret_file_others_can_read_or_change_is_refused(base, mode, owner):
    secret_file = base / "secret"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, mode)
    if owner is not None:
        os.chown(secret_file, owner, owner)
    with pytest.raises(ConfigError, match=f"chmod 600 {secret_file}"):
        PosixStore(PosixStoreConfig(path=str(base / "store"), secret=f"file:{secret_file}"))
    assert not (base / "store").exists()  # refused before anything is made


def test_a_private_secret_file_is_accepted(base):
    secret_file = base / "secret"
    secret_file.write_text(SECRET + "\n")
    os.chmod(secret_file, 0o600)
    store = PosixStore(PosixStoreConfig(path=str(base / "store"), secret=f"file:{secret_file}"))
    try:
        assert store.wait(store.dump([key_of(60)], [payload(60)]))[0].ok
    finally:
        store.close()
    signer = BlockSigner.from_secret(SECRET.encode())  # the newline is not part of it
    assert block_names(base / "store") == {signer.name(key_of(60)).hex()}


def test_a_secret_shorter_than_16_bytes_is_refused(base, monkeypatch):
    monkeypatch.setenv("UCM_TEST_SECRET", "x" * 15)
    with pytest.raises(ConfigError, match="is 15 bytes; at least 16"):
        PosixStore(PosixStoreConfig(path=str(base / "store"), secret="env:UCM_TEST_SECRET"))
    monkeypatch.setenv("UCM_TEST_SECRET", "x" * 16)
    PosixStore(PosixStoreConfig(path=str(base / "store"), secret="env:UCM_TEST_SECRET")).close()


def test_a_secret_written_in_the_configuration_is_refused_and_not_echoed():
    with pytest.raises(ConfigError) as info:
        PosixStoreConfig(secret=SECRET)
    assert SECRET not in str(info.value) and "env:NAME" in str(info.value)


# --- 6. huge sparse files ------------------------------------------------------------------------

SPARSE_BYTES = 512 << 20
RSS_SLACK = 64 << 20


def _vm_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def peak_memory_growth(action: Callable[[], object]) -> tuple[object, int]:
    """``action()``'s result, and how far the process's peak RSS rose above its RSS before."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs)")
    before = _vm_bytes("VmRSS")
    result = action()
    return result, _vm_bytes("VmHWM") - before


def header_claiming(key: bytes, payload_len: int) -> bytes:
    """A header page for ``key`` whose header checksum holds but which claims
    ``payload_len`` payload bytes."""
    page = bytearray(encode_header(key, b"\0" * 4096))
    fields = list(_FIXED.unpack_from(page))
    fields[5] = payload_len
    _FIXED.pack_into(page, 0, *fields)
    end = _FIXED.size  # no layout, unsigned
    _CHECKSUM.pack_into(page, end, xxhash.xxh3_64_intdigest(bytes(page[:end])))
    return bytes(page)


@pytest.mark.parametrize("o_direct", [False, True], ids=["pagecache", "o_direct"])
@pytest.mark.parametrize("header", ["copied", "claims-the-file"])
def test_a_huge_sparse_file_at_a_block_path_loads_as_an_error_in_bounded_memory(
    base, o_direct, header
):
    root = base / "store"
    key, size = key_of(70), 1 << 20
    store = PosixStore(PosixStoreConfig(path=str(root), o_direct=o_direct))
    try:
        if header == "copied":  # the header page of the key's real 1 MiB block, zeros after
            assert store.wait(store.dump([key], [payload(70, size)]))[0].ok
            page = block_path(root, key.hex()).read_bytes()[:HEADER_BYTES]
            expected = Status.CORRUPT  # the payload's checksum
        else:  # a forged header that claims the whole file
            page = header_claiming(key, SPARSE_BYTES - HEADER_BYTES)
            expected = Status.ERROR  # not the size asked for
        path = plant(block_path(root, key.hex()), page)
        os.truncate(path, SPARSE_BYTES)

        out = bytearray(b"\xab" * size)
        (result,), grown = peak_memory_growth(lambda: store.load([key], [out]).wait(LOAD_TIMEOUT))
        assert result.status is expected, result
        assert grown < RSS_SLACK, f"peak RSS grew by {grown >> 20} MiB"
        assert store.errors == 1
    finally:
        store.close()


# --- 7. the marker file --------------------------------------------------------------------------


HOSTILE_MARKERS = {
    "huge": "[" * 200_000,
    "deep": "[" * 4000,  # within the size limit, nested deeper than the parser recurses
    # well-formed but far larger than a marker: not read (an attacker's file could be any size)
    "huge-valid": '{"capacity_bytes": 1, "padding": "' + "x" * 200_000 + '"}',
    "fifo": None,
}


@pytest.mark.parametrize("marker", list(HOSTILE_MARKERS))
def test_a_hostile_marker_does_not_crash_ucm_store_stats(base, marker):
    root = base / "store"
    PosixStore(PosixStoreConfig(path=str(root), capacity_gb=1.0)).close()
    path = root / "ucm-store.json"
    path.unlink()
    if marker == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(HOSTILE_MARKERS[marker])
    try:
        result = ucm_cli("store", "stats", "--json", str(root))
    finally:
        unblock_fifos(path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result
    assert '"capacity_bytes": null' in result.stdout  # a marker not UCM's says nothing
    # the store itself opens over it, and puts a marker of its own in its place
    PosixStore(PosixStoreConfig(path=str(root), capacity_gb=1.0)).close()
    assert '"capacity_bytes": 1073741824' in ucm_cli("store", "stats", "--json", str(root)).stdout


# --- 8. removals and temporary files -------------------------------------------------------------


def test_a_folder_swapped_for_a_link_after_a_scan_redirects_no_removal(tmp_path):
    """Eviction deletes what a scan listed, later: a block folder swapped meanwhile for a link
    to somewhere else must not make it delete files there."""
    from ucm.core.store.posix import evict_lru, scan_store
    from ucm.core.store.posix.fileio import open_dir

    root = tmp_path / "store"
    s = PosixStore(PosixStoreConfig(path=str(root), capacity_gb=None))
    keys = [key_of(i, b"swap") for i in range(8)]
    assert all(r.ok for r in s.wait(s.dump(keys, [payload(i) for i in range(len(keys))])))
    s.close()
    scan = scan_store(str(root))
    decoy = tmp_path / "elsewhere"
    for block in scan.blocks:  # files of the same names outside the store
        (decoy / block.name[:2]).mkdir(parents=True, exist_ok=True)
        (decoy / block.name[:2] / block.name).write_bytes(b"not the store's")
    for sub in {b.name[:2] for b in scan.blocks}:  # the swap
        (root / "blocks" / sub).rename(tmp_path / f"moved-{sub}")
        (root / "blocks" / sub).symlink_to(decoy / sub)
    root_fd = open_dir(str(root))
    try:
        evict_lru(scan, 0, root_fd)
    finally:
        os.close(root_fd)
    left = [p for p in decoy.rglob("*") if p.is_file()]
    assert len(left) == len(scan.blocks), "a removal followed the swapped-in link"


@needs_root
def test_a_dead_writer_in_another_pid_namespace_leaves_no_temporary_file_for_good(tmp_path):
    """A writer in a container (its own PID namespace, here pid 1) dies with a temporary file:
    the next store removes it, since its lock is free, whatever its pid means here."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    root = tmp_path / "store"
    PosixStore(PosixStoreConfig(path=str(root))).close()
    script = (
        "import os\n"
        "from ucm.core.config import PosixStoreConfig\n"
        "from ucm.core.store import PosixStore\n"
        f"s = PosixStore(PosixStoreConfig(path={str(root)!r}))\n"
        "assert os.getpid() == 1, os.getpid()\n"
        "sub = os.path.join(s.root, 'blocks', 'ab')\n"
        "os.makedirs(sub, exist_ok=True)\n"
        "open(os.path.join(sub, '.ab' + '0' * 30 + '~' + s._writer[0] + '.tmp'), 'wb').close()\n"
        "os._exit(0)\n"  # killed mid-write: nothing closed, nothing removed
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"cannot make a PID namespace: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    temps = list((root / "blocks").rglob(".*.tmp"))
    assert len(temps) == 1 and "~1~" in temps[0].name  # pid 1: alive, judged by the pid
    PosixStore(PosixStoreConfig(path=str(root))).close()  # its first scan runs to the end
    assert list((root / "blocks").rglob(".*.tmp")) == []


@needs_root
def test_a_link_planted_at_the_secret_path_by_another_user_is_refused(base):
    # The victim's own 0600 file with bytes an attacker can predict (here: a marker of its
    # store), reached through a link the attacker planted where the secret file goes, in a
    # folder every user can write (sticky, as /tmp): the attacker would know the secret.
    predictable = base / "victim-marker"
    predictable.write_text("x" * 40)
    os.chmod(predictable, 0o600)
    drop = base / "drop"
    drop.mkdir()
    os.chmod(drop, 0o1777)
    planted = drop / "secret"
    planted.symlink_to(predictable)
    os.lchown(planted, ATTACKER, ATTACKER)
    with pytest.raises(ConfigError, match=f"the secret file passes the link {planted}"):
        PosixStore(PosixStoreConfig(path=str(base / "store"), secret=f"file:{planted}"))
    assert not (base / "store").exists()


@needs_root
def test_a_secret_file_in_a_folder_others_can_change_is_refused(base):
    open_folder = base / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)  # no sticky bit: anyone can swap the file for theirs
    secret_file = open_folder / "secret"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, 0o600)
    with pytest.raises(ConfigError, match="the secret file lies in .* Move it to a folder"):
        PosixStore(PosixStoreConfig(path=str(base / "store"), secret=f"file:{secret_file}"))


def test_a_secret_file_reached_through_ones_own_links_is_accepted(base):
    # as Kubernetes mounts a secret: key -> ..data/key, ..data -> a dated folder
    dated = base / "secrets" / "..2026_11_27"
    dated.mkdir(parents=True)
    (dated / "key").write_text(SECRET)
    os.chmod(dated / "key", 0o600)
    (base / "secrets" / "..data").symlink_to(dated.name)
    (base / "secrets" / "key").symlink_to("..data/key")
    store = PosixStore(
        PosixStoreConfig(path=str(base / "store"), secret=f"file:{base / 'secrets' / 'key'}")
    )
    store.close()


@needs_root
def test_links_planted_for_the_block_folders_of_a_shared_store_redirect_no_write(
    secrets_env, shared_folder, base
):
    # Another user who can write a shared store's folder replaces blocks/<xx> with links to
    # a folder of the victim's: the victim's dumps must not follow them (each would write
    # a file there, outside the store's capacity, wherever the attacker points).
    store = signed_store(shared_folder / "store")
    store.close()
    blocks = shared_folder / "store" / "blocks"
    os.chmod(blocks, 0o777)  # a team's mount, writable by everyone
    decoy = base / "victims-folder"
    decoy.mkdir()
    for sub in (f"{i:02x}" for i in range(256)):
        os.makedirs(decoy / sub, exist_ok=True)
        if (blocks / sub).exists():
            shutil.rmtree(blocks / sub)
        (blocks / sub).symlink_to(decoy / sub)
        os.lchown(blocks / sub, ATTACKER, ATTACKER)
    store = signed_store(shared_folder / "store")
    try:
        keys = [key_of(i) for i in range(16)]
        results = store.wait(store.dump(keys, [payload(i) for i in range(16)]), 30)
        assert all(r.status is Status.ERROR for r in results), results
        assert "is not a folder of the store" in results[0].detail
        loaded = store.wait(store.load(keys[:1], [bytearray(4096)]), 30)
        assert not loaded[0].ok
    finally:
        store.close()
    assert [p for p in decoy.rglob("*") if p.is_file()] == []


def test_a_process_holding_a_shared_stores_count_costs_a_dump_one_wait(
    shared_folder, secrets_env, monkeypatch
):
    # A process (of another user who can write the shared folder, or a stopped one of ours)
    # holds the store's usage lock: a dump of 8 keys fails after one wait, not one per key
    # in turn (the threads used to queue behind the one waiting); a new store still starts.
    from ucm.core.store.posix import usage as usage_module

    monkeypatch.setattr(usage_module, "LOCK_WAIT_S", 1.0)
    signed_store(shared_folder / "store").close()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('holding', flush=True)\n"
         "time.sleep(600)\n",
         str(shared_folder / "store" / "usage")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "holding"
        store = signed_store(shared_folder / "store")  # starts: no OSError of errno None
        try:
            keys = [key_of(100 + i) for i in range(8)]
            started = time.monotonic()
            results = store.wait(store.dump(keys, [payload(100 + i) for i in range(8)]), 60)
            took = time.monotonic() - started
            assert all(r.status is Status.ERROR for r in results), results
            assert "stayed locked by another process" in results[0].detail
            assert took < 4, took  # one wait of 1 s, then at once
        finally:
            store.close()
    finally:
        holder.kill()
        holder.wait()
    store = signed_store(shared_folder / "store")
    try:  # the holder gone, dumps work again
        assert store.wait(store.dump([key_of(1)], [payload(1)]), 30)[0].ok
    finally:
        store.close()
