"""The mooncake store against a real ``mooncake_master``: what it does with objects it did
not write, a full pool, hosts that leave, and a master that dies and comes back.

The promises every store keeps are in test_store_contract.py."""

import contextlib
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from ucm.core.block_format import HEADER_BYTES, encode_header
from ucm.core.config import MooncakeStoreConfig, parse_store_config
from ucm.core.settings import ConfigError
from ucm.core.store import Status
from ucm.lab.pytest_plugin import require_mooncake, require_namespaces
from ucm.lab.testing.core import blob, key, mooncake_config

pytestmark = pytest.mark.mooncake


@pytest.fixture(autouse=True)
def _mooncake_here():
    require_mooncake()


@pytest.fixture
def kind():
    """This file's kind of the shared ``store`` fixture (conftest.py)."""
    return "mooncake"


@pytest.fixture
def raw(mooncake_master):
    """Mooncake's own client on the same master, to write objects behind the store's back."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert (
        client.setup(
            "127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", mooncake_master.address
        )
        == 0
    )
    yield client
    client.close()


def put_raw(raw, name: str, data: bytes) -> None:
    buf = np.frombuffer(bytearray(data), np.uint8)
    assert raw.put_from(name, buf.ctypes.data, buf.nbytes) == 0


# -- objects the store did not write are misses, never data ---------------------------------


def test_foreign_truncated_and_corrupt_objects_are_misses(store, raw):
    payload = blob(1, 10_000)

    def block(k: bytes) -> bytes:
        return encode_header(k, payload) + payload.tobytes()

    flipped = bytearray(block(key(3)))
    flipped[HEADER_BYTES + 5000] ^= 0x40
    cases = {
        key(1): b"not a ucm block".ljust(HEADER_BYTES + 10_000, b"\0"),  # foreign
        key(2): block(key(2))[: HEADER_BYTES + 6000],  # truncated
        key(3): bytes(flipped),  # a flipped bit in the payload
        key(4): block(key(99)),  # a block stored under another key
        key(5): block(key(5))[:100],  # not even a header
    }
    for k, data in cases.items():
        put_raw(raw, store.config.key_prefix + k.hex(), data)
    assert store.lookup(list(cases)) == [True] * 5
    out = [np.zeros(10_000, np.uint8) for _ in cases]
    results = store.wait(store.load(list(cases), out))
    assert [r.status for r in results] == [Status.CORRUPT] * 5, results
    assert store.lookup(list(cases)) == [False] * 5  # removed: the next lookup misses
    assert store.errors == 5


def test_a_block_written_by_another_client_is_read(store, raw):
    payload = blob(5, 8192)
    put_raw(
        raw,
        store.config.key_prefix + key(6).hex(),
        encode_header(key(6), payload) + payload.tobytes(),
    )
    out = np.zeros_like(payload)
    assert store.wait(store.load([key(6)], [out]))[0].ok
    np.testing.assert_array_equal(out, payload)


# -- a full pool is a counted write error, and the store serves on ----------------------------


def test_a_full_pool_fails_writes_and_keeps_serving(mooncake_master):
    from ucm.core.store.mooncake.store import MooncakeStore

    # This test's own master: the session master's pool holds other tests' segments.
    from ucm.lab.mooncake import LocalMaster

    with LocalMaster() as master:
        store = MooncakeStore(mooncake_config(master, global_segment_gb=16 / 1024))
        try:
            size = 1 << 20
            keys = [key(i, b"full") for i in range(40)]  # 40 MiB into a 16 MiB pool
            results = []
            for i in range(0, 40, 4):
                results += store.wait(
                    store.dump(keys[i : i + 4], [blob(j, size) for j in range(i, i + 4)]), 30
                )
            failed = [r for r in results if not r.ok]
            assert failed and all(r.status is Status.ERROR for r in failed)
            assert all("full" in r.detail or "code" in r.detail for r in failed), failed[0]
            assert store.errors >= len(failed)
            assert store.connected  # a full pool is not a dead master
            # Whatever is stored loads intact; whatever was evicted or never stored misses.
            out = [np.zeros(size, np.uint8) for _ in keys]
            loaded = store.wait(store.load(keys, out), 30)
            assert {r.status for r in loaded} <= {Status.OK, Status.MISS}
            assert any(r.ok for r in loaded)
            for i, r in enumerate(loaded):
                if r.ok:
                    np.testing.assert_array_equal(out[i], blob(i, size))
        finally:
            store.close()


# -- hosts that leave ------------------------------------------------------------------------


# Another host: gives the pool a segment, stores blocks in it, says so, then on a line of
# stdin leaves (closes its store) or dies (no unmount: as a host that loses power).
OTHER_HOST = """
import os, sys
import numpy as np
import xxhash
from ucm.core.config import MooncakeStoreConfig
from ucm.core.store.mooncake.store import MooncakeStore

def key(i):
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))

store = MooncakeStore(MooncakeStoreConfig(
    master=sys.argv[1], global_segment_gb=0.0625, key_prefix=sys.argv[2]))
data = [np.random.default_rng(i).integers(0, 256, 100_000, dtype=np.uint8) for i in range(8)]
results = store.wait(store.dump([key(i) for i in range(8)], data), 30)
print("stored", sum(r.ok for r in results), flush=True)
if sys.stdin.readline().strip() == "kill":
    os._exit(0)
store.close()
"""


@pytest.mark.parametrize("how", ["close", "kill"])
def test_blocks_of_a_host_that_left_are_misses(mooncake_master, how):
    from ucm.core.store.mooncake.store import MooncakeStore

    prefix = f"left-{how}-{os.getpid()}/"
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_HOST, mooncake_master.address, prefix],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    # This client gives no memory, so every block lives in the other host's segment.
    store = MooncakeStore(mooncake_config(mooncake_master, global_segment_gb=0, key_prefix=prefix))
    try:
        assert other.stdout.readline().split() == ["stored", "8"]
        keys = [key(i) for i in range(8)]
        out = [np.zeros(100_000, np.uint8) for _ in keys]
        assert all(r.ok for r in store.wait(store.load(keys, out), 30))
        other.communicate(f"{how}\n", timeout=30)
        deadline = time.monotonic() + 60
        while True:  # a killed host's segment goes when the master's client TTL runs out
            started = time.monotonic()
            results = store.wait(store.load(keys, [np.zeros(100_000, np.uint8) for _ in keys]), 30)
            assert time.monotonic() - started < 10
            assert {r.status for r in results} <= {Status.OK, Status.MISS}, results
            if all(r.status is Status.MISS for r in results) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert all(r.status is Status.MISS for r in results), results
    finally:
        store.close()
        if other.poll() is None:
            other.kill()


# -- the master: absent at start-up, killed, restarted ------------------------------------------


# A call that reaches a dead master blocks ~4.3 s (Mooncake 0.3.13); one that is answered
# without it takes microseconds.  The bound sits far from both, so that a loaded CI machine
# cannot fail it and a call that waits on the master cannot pass it.
NO_WAIT = 0.5


def _timed(call):
    started = time.monotonic()
    value = call()
    return value, time.monotonic() - started


def _until_connected(store, within: float = 60.0):
    """Wait until ``store`` has its master.  Its own wait at start-up is ``timeout_s``, short in
    these tests; Mooncake's client set-up retries every ~4.4 s, longer on a loaded machine."""
    deadline = time.monotonic() + within
    while not store.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.connected, f"no master within {within} s"
    return store


def test_start_up_without_a_master_serves_then_connects(tmp_path):
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster

    master = LocalMaster(log_path=str(tmp_path / "master.log"))  # not started yet
    config = mooncake_config(master, timeout_s=1.0)
    store, took = _timed(lambda: MooncakeStore(config))
    try:
        assert took < 3 and not store.connected
        keys = [key(i) for i in range(4)]
        data = [blob(i, 50_000) for i in range(4)]
        (found, took) = _timed(lambda: store.lookup(keys))
        assert found == [False] * 4 and took < NO_WAIT
        dumped, took = _timed(lambda: store.wait(store.dump(keys, data), 1))
        assert all(r.status is Status.ERROR for r in dumped) and took < NO_WAIT
        assert "unreachable" in dumped[0].detail
        master.start()
        _until_connected(store)
        assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
        assert store.lookup(keys) == [True] * 4
    finally:
        store.close()
        master.stop()


def test_a_killed_master_costs_one_wait_then_nothing_and_restarts(tmp_path):
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster

    with LocalMaster(log_path=str(tmp_path / "master.log")) as master:
        store = _until_connected(MooncakeStore(mooncake_config(master, timeout_s=1.0)))
        try:
            keys = [key(i) for i in range(8)]
            data = [blob(i, 50_000) for i in range(8)]
            assert all(r.ok for r in store.wait(store.dump(keys[:4], data[:4]), 10))
            master.kill()
            # The first call finds out, within timeout_s at most.
            found, took = _timed(lambda: store.lookup(keys))
            assert found == [False] * 8 and took < 2.5  # not the ~4.3 s of a wait
            assert not store.connected and store.master_failures == 1
            # From then on nothing waits on the dead master.
            for _ in range(20):
                found, took = _timed(lambda: store.lookup(keys))
                assert found == [False] * 8 and took < NO_WAIT
                loaded, took = _timed(
                    lambda: store.wait(
                        store.load(keys[:4], [np.zeros_like(d) for d in data[:4]]), 1
                    )
                )
                assert all(r.status is Status.MISS for r in loaded) and took < NO_WAIT
                dumped, took = _timed(lambda: store.wait(store.dump(keys[4:], data[4:]), 1))
                assert all(r.status is Status.ERROR for r in dumped) and took < NO_WAIT
            assert store.dropped >= 20 * 16
            # A new master with empty metadata: dumps land again within 5 s, and hits resume.
            master.start()
            started = time.monotonic()
            while time.monotonic() - started < 5:
                # (the pool is empty until the clients have mounted their segments again)
                dumped = store.wait(store.dump(keys[4:], data[4:]), 10)
                if all(r.ok for r in dumped):
                    break
                time.sleep(0.1)
            assert all(r.ok for r in dumped), dumped
            print(f"dumps land {time.monotonic() - started:.2f} s after the restart")
            assert store.connected
            assert store.lookup(keys[:4]) == [False] * 4  # the old master's blocks are gone
            assert all(r.ok for r in store.wait(store.dump(keys[:4], data[:4]), 10))
            out = [np.zeros_like(d) for d in data]
            assert all(r.ok for r in store.wait(store.load(keys, out), 10))
            for got, want in zip(out, data):
                np.testing.assert_array_equal(got, want)
            assert store.master_failures == 1
        finally:
            store.close()


def test_a_killed_master_is_found_out_before_the_next_request(tmp_path):
    """Requests come one at a time; the master dies between two of them.  The next request
    waits for nothing: the store heard of the death from the connection it holds to the
    master, before anybody asked it anything."""
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster

    with LocalMaster(log_path=str(tmp_path / "master.log")) as master:
        store = _until_connected(MooncakeStore(mooncake_config(master, timeout_s=2.0)))
        try:
            keys = [key(i, b"next") for i in range(4)]
            data = [blob(i, 50_000) for i in range(4)]
            assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
            master.kill()
            time.sleep(0.5)  # the gap between two requests
            found, took = _timed(lambda: store.lookup(keys))
            assert found == [False] * 4 and took < NO_WAIT, took
            assert not store.connected and store.master_failures == 1
            loaded, took = _timed(
                lambda: store.wait(store.load(keys, [np.zeros_like(d) for d in data]), 5)
            )
            assert all(r.status is Status.MISS for r in loaded) and took < NO_WAIT, took
        finally:
            store.close()


def test_a_dump_in_flight_when_the_master_dies_settles(tmp_path):
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster

    with LocalMaster(log_path=str(tmp_path / "master.log")) as master:
        store = _until_connected(MooncakeStore(mooncake_config(master, timeout_s=1.0)))
        try:
            keys = [key(i, b"inflight") for i in range(64)]
            task = store.dump(keys, [blob(i, 200_000) for i in range(64)])
            master.kill()
            results = store.wait(task, 30)  # every key settles: none hangs
            assert {r.status for r in results} <= {Status.OK, Status.ERROR}
        finally:
            _, took = _timed(store.close)
            assert took < 15


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("master", "localhost", "HOST:PORT"),
        ("master", "10.0.0.1:0", "HOST:PORT"),
        ("master", "10.0.0.1:99999", "HOST:PORT"),
        ("master", "etcd://", "etcd://HOST:PORT"),
        ("master", "etcd://10.0.0.1:2379;", "etcd://HOST:PORT"),
        ("master", "etcd://10.0.0.1", "etcd://HOST:PORT"),
        ("master", "http://10.0.0.1:2379", "HOST:PORT"),
        ("cluster_id", "two words", "printable"),
        ("metadata_server", "zookeeper://x:1", "P2PHANDSHAKE"),
        ("protocol", "udp", "must be 'tcp'"),
        ("protocol", "rdma", "not supported yet"),
        ("global_segment_gb", -1, "[0, "),
        ("global_segment_gb", 1e300, "[0, "),
        ("local_buffer_mb", 0, "(0, "),
        ("replicas", 0, "[1, 16]"),
        ("key_prefix", "has space", "no spaces"),
        ("timeout_s", 0, "(0, "),
        ("timeout_s", 1e300, "(0, "),
        ("secret", "a-secret-in-the-config", "env:NAME"),
        ("tenant_id", "two words", "printable"),
        ("io_threads", 0, "[1, 64]"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(setting, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        parse_store_config({"kind": "mooncake", setting: value})
    assert caught.value.key == f"store.{setting}"


def test_unknown_settings_are_refused():
    with pytest.raises(ConfigError) as caught:
        parse_store_config({"kind": "mooncake", "master_addr": "1.2.3.4:5"})
    assert caught.value.key == "store.master_addr"
    with pytest.raises(ConfigError) as caught:
        parse_store_config({"kind": "tiered", "backing": {"kind": "mooncake", "segment": 1}})
    assert caught.value.key == "store.backing.segment"


def test_valid_settings():
    config = parse_store_config(
        {
            "kind": "mooncake",
            "master": "[fd00::1]:50051",
            "metadata_server": "http://10.0.0.1:8080/metadata",
            "global_segment_gb": 0,
        }
    )
    assert isinstance(config, MooncakeStoreConfig)
    assert config.master_endpoints == [("fd00::1", 50051)]
    assert not config.highly_available
    ha = parse_store_config(
        {"kind": "mooncake", "master": "etcd://10.0.0.1:2379;[fd00::2]:2379", "cluster_id": "c"}
    )
    assert ha.highly_available
    assert ha.master_endpoints == [("10.0.0.1", 2379), ("fd00::2", 2379)]
    assert ha.master_view_key == "mooncake-store/c/master_view"
    tiered = parse_store_config({"kind": "tiered", "backing": {"kind": "mooncake"}})
    assert isinstance(tiered.backing, MooncakeStoreConfig)


@contextlib.contextmanager
def _master_on_host_m(tmp_path, **settings):
    """A master alone on host m (a network namespace), and a store of this process on it:
    (the lab, to cut m's link, and the store; the store is the caller's to close)."""
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster
    from ucm.lab.netlab import NetLab

    require_namespaces()
    with NetLab(["m"]) as lab:
        master = LocalMaster(
            lab.address("m"), netns=lab.namespace("m"), log_path=str(tmp_path / "master.log")
        )
        with master:
            yield lab, _until_connected(MooncakeStore(mooncake_config(master, **settings)))


@pytest.mark.root
def test_a_partition_from_the_master_is_waited_on_once(tmp_path):
    """The master's host drops off the network (its link set down) instead of dying: calls
    hang rather than fail at once.  The first lookup gives up after timeout_s; later calls
    answer at once; when the link is back the store is used again."""
    with _master_on_host_m(tmp_path, timeout_s=1.0) as (lab, store):
        try:
            keys = [key(i, b"partition") for i in range(4)]
            data = [blob(i, 50_000) for i in range(4)]
            assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
            lab.link_down("m")
            found, took = _timed(lambda: store.lookup(keys))
            assert found == [False] * 4 and took < 1.0 + NO_WAIT
            assert not store.connected
            for _ in range(10):
                found, took = _timed(lambda: store.lookup(keys))
                assert found == [False] * 4 and took < NO_WAIT
                out = [np.zeros_like(d) for d in data]
                loaded, took = _timed(lambda: store.wait(store.load(keys, out), 1))  # noqa: B023
                assert all(r.status is Status.MISS for r in loaded) and took < NO_WAIT
            lab.link_up("m")
            _until_connected(store)
            out = [np.zeros_like(d) for d in data]  # the same master: its blocks are there
            assert all(r.ok for r in store.wait(store.load(keys, out), 10))
            for got, want in zip(out, data):
                np.testing.assert_array_equal(got, want)
        finally:
            store.close()


@pytest.mark.root
def test_a_master_cut_off_between_two_requests_costs_the_next_one_nothing(tmp_path):
    """The master's host drops off the network between two requests: nothing comes back to
    say so, and a call would hang until timeout_s.  The connection the store holds to the
    master finds it out (TCP keepalives, a few seconds) before the next request comes."""
    with _master_on_host_m(tmp_path, timeout_s=2.0) as (lab, store):
        try:
            keys = [key(i, b"cut") for i in range(4)]
            data = [blob(i, 50_000) for i in range(4)]
            assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
            lab.link_down("m")
            deadline = time.monotonic() + 15  # keepalives: 1 s idle, 3 probes 1 s apart
            while store.connected and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not store.connected, "the store did not hear of the cut by itself"
            found, took = _timed(lambda: store.lookup(keys))
            assert found == [False] * 4 and took < NO_WAIT
            lab.link_up("m")
            _until_connected(store)
        finally:
            store.close()


@pytest.mark.root
def test_a_slow_link_to_the_pool_is_slower_and_still_correct(tmp_path):
    """The pool's host (master and segment server) sends through a token bucket of 20 Mbit/s:
    loads take longer and return the stored bytes.  (This kernel has no netem, so latency
    and loss cannot be injected; where it has, NetLab.netem does it.)"""
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import LocalMaster, SegmentServer
    from ucm.lab.netlab import NetLab

    require_namespaces()
    with NetLab(["m"]) as lab:
        ns, host = lab.namespace("m"), lab.address("m")
        master = LocalMaster(host, netns=ns, log_path=str(tmp_path / "master.log"))
        with master, SegmentServer(master.address, 64, host, netns=ns):
            store = MooncakeStore(mooncake_config(master, global_segment_gb=0))
            try:
                keys = [key(i, b"slow") for i in range(8)]
                data = [blob(i, 250_000) for i in range(8)]
                assert all(r.ok for r in store.wait(store.dump(keys, data), 30))
                fast, fast_s = _timed(lambda: _load(store, keys, data))
                lab.throttle("m", 20_000)
                slow, slow_s = _timed(lambda: _load(store, keys, data))
                lab.throttle("m", None)
                assert fast and slow
                print(f"8 x 250 kB loaded in {fast_s:.3f} s, {slow_s:.3f} s throttled")
                assert slow_s > 0.5  # 2 MB at 20 Mbit/s: the throttle was real
                assert store.connected
            finally:
                store.close()


def _load(store, keys, data) -> bool:
    out = [np.zeros_like(d) for d in data]
    results = store.wait(store.load(keys, out), 60)
    return all(r.ok for r in results) and all(np.array_equal(a, b) for a, b in zip(out, data))


# -- highly available masters: the leader killed -------------------------------------------


@pytest.fixture(scope="module")
def ha_hosts(tmp_path_factory):
    """Hosts e (etcd, running), m1, m2 (masters) and p (a segment server) as network
    namespaces: (lab, etcd).  One etcd for the module: Mooncake's client reaches one etcd
    per process."""
    from ucm.lab.mooncake import Etcd
    from ucm.lab.netlab import NetLab
    from ucm.lab.pytest_plugin import require_etcd

    require_namespaces()
    require_etcd()
    logs = tmp_path_factory.mktemp("ha")
    with NetLab(["e", "m1", "m2", "p"]) as lab:
        etcd = Etcd(str(logs / "etcd"), lab.address("e"), netns=lab.namespace("e"),
                    log_path=str(logs / "etcd.log"))  # fmt: skip
        with etcd:
            yield lab, etcd


@pytest.mark.root
@pytest.mark.parametrize("oplog", [False, True], ids=["cold-standby", "oplog"])
def test_the_leader_killed_costs_nothing_and_dumps_land_on_the_new_one(ha_hosts, tmp_path, oplog):
    """etcd, two masters and a segment server, each on a host of its own (network
    namespaces); the store follows the leader through etcd.  The leader is killed: from the
    first failed call on, dumps are dropped and lookups miss at once, until the standby
    leads (etcd's lease, then the master's warm-up: about 10 s); then dumps land again.
    Blocks registered with the old leader are misses, never errors, unless the masters
    replicate their metadata (``--enable_oplog``): then those stored seconds before the
    failover load as stored."""
    from ucm.core.store.mooncake.store import MooncakeStore
    from ucm.lab.mooncake import HaCluster

    lab, etcd = ha_hosts
    cluster = HaCluster(str(tmp_path), lab=lab, etcd=etcd, cluster_id=f"ucm-{oplog}",
                        segment_mb=64, oplog=oplog)  # fmt: skip
    with cluster:
        config = MooncakeStoreConfig(
            master=cluster.url, cluster_id=cluster.cluster_id, global_segment_gb=0,
            timeout_s=2.0, key_prefix="ha/",
        )  # fmt: skip
        store = MooncakeStore(config)
        try:
            _until_connected(store)
            keys = [key(i, b"ha") for i in range(4)]
            data = [blob(i, 50_000) for i in range(4)]
            assert all(r.ok for r in store.wait(store.dump(keys, data), 10))
            # the standby replays the leader's log each second: what was stored in the
            # last moment before a failover is lost even with the oplog
            time.sleep(3)
            old_leader = cluster.leader()
            assert old_leader is not None
            old_leader.kill()
            killed = time.monotonic()
            slowest, n, landed = 0.0, 0, None
            while landed is None and time.monotonic() - killed < 60:
                n += 1
                k = key(1000 + n, b"ha")
                start = time.monotonic()
                done = store.wait(store.dump([k], [data[0]]), 10)[0]
                found = store.lookup([k])[0]
                slowest = max(slowest, time.monotonic() - start)
                if done.ok and found:
                    landed = time.monotonic() - killed
                time.sleep(0.05)
            new_leader = cluster.leader()
            print(
                f"first dump on the new leader {landed:.2f} s after the kill; {n} dumps "
                f"tried, the slowest with its lookup {slowest * 1e3:.1f} ms; "
                f"{store.errors} failed"
            )
            assert landed is not None and new_leader not in (None, old_leader)
            assert store.master_failures == 1
            # one call may wait for the dead leader (a lookup, timeout_s); none waits longer
            assert slowest < config.timeout_s + NO_WAIT
            # puts the promoted standby takes before the pool re-registers may fail (counted
            # errors, dropped dumps); loads never fail: a block is there or a miss
            failed_puts = store.errors
            out = [np.zeros_like(d) for d in data]
            results = store.wait(store.load(keys, out), 10)
            if oplog:
                assert all(r.ok for r in results), results
                for got, want in zip(out, data):
                    np.testing.assert_array_equal(got, want)
            else:
                assert [r.status for r in results] == [Status.MISS] * 4, results
                assert store.lookup(keys) == [False] * 4
            assert store.errors == failed_puts, f"{store.errors - failed_puts} loads failed"
        finally:
            store.close()


def test_one_process_follows_one_etcd(monkeypatch):
    """Mooncake's client keeps one etcd connection per process: a store naming another
    etcd is refused at once, naming the one in use."""
    from ucm.core.store.mooncake import link

    monkeypatch.setattr(link, "_process_etcd", "etcd://10.0.0.1:2379")
    other = MooncakeStoreConfig(master="etcd://10.0.0.2:2379")
    with pytest.raises(
        ConfigError, match=re.escape("already follows the masters of etcd://10.0.0.1:2379")
    ):
        link.MasterLink(other, lambda: None)
