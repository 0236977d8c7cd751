"""The Mooncake client of one store, and whether its master answers.

A Mooncake client whose master is gone blocks every call for seconds (about 4 s each with
0.3.13) and a client set up while it is gone retries for 90 s.  An engine must not pay that
on every request, so :class:`MasterLink` keeps the client and whether its master answers:
after the first failure, lookups answer miss and dumps are dropped (counted) at once, with
no call made, until a background probe hears from the master again.  A master restarted
with empty metadata is used again as soon as it answers (the client re-registers itself);
the blocks it held are gone and read as misses.

Not even the first request after a death waits: while the master is up, a watch thread
holds an idle TCP connection to it (to the leader, when highly available), which the
master's kernel resets the moment the master dies (seen: 10 ms after a SIGKILL).  The
watch then knocks; a master that no longer accepts is taken as down before any request
asks it anything.  A master whose host vanishes sends nothing: TCP keepalives find that
out within seconds, and a lookup's own ``timeout_s`` bounds the calls made meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ucm.core.settings import ConfigError
from ucm.core.store.mooncake.config import MooncakeStoreConfig
from ucm.core.store.mooncake.leader import master_address
from ucm.core.threads import store_thread

log = logging.getLogger(__name__)

#: Held while a client is set up, for the environment it reads.
_environment_lock = threading.Lock()
#: The etcd endpoints this process's clients follow a leader through: Mooncake's client
#: keeps one etcd connection per process, and refuses (retrying for seconds) another.
_process_etcd: str | None = None
_process_etcd_lock = threading.Lock()


def _claim_etcd(config: MooncakeStoreConfig) -> None:
    global _process_etcd
    if not config.highly_available:
        return
    with _process_etcd_lock:
        if _process_etcd is None:
            _process_etcd = config.master
        elif _process_etcd != config.master:
            raise ConfigError(
                "store.master",
                f"this process already follows the masters of {_process_etcd}; Mooncake's "
                f"client reaches one etcd per process, so {config.master} cannot be used here",
            )


class MasterLink:
    """The Mooncake client, and whether its master answers.

    ``client`` is the set-up client while the master answers, else ``None``: callers then
    skip the call.  :meth:`failed` takes the master as down; a background thread sets the
    client up (start-up) or probes it (after a failure) every ``probe_interval_s`` until the
    master answers, and logs each change once."""

    def __init__(self, config: MooncakeStoreConfig, make_client: Callable[[], Any]) -> None:
        _claim_etcd(config)
        self.config = config
        self._make_client = make_client
        self._client: Any = None  # set up (not necessarily up)
        self._up = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._ever_up = False
        self.failures = 0  # times the master was taken as down
        self._thread = store_thread(self._run, "ucm-mooncake-link")
        self._thread.start()
        self._watching: socket.socket | None = None
        self._watcher = store_thread(self._watch, "ucm-mooncake-watch")
        self._watcher.start()

    @property
    def client(self) -> Any:
        return self._client if self._up else None

    @property
    def up(self) -> bool:
        return self._up

    def wait_up(self, timeout: float) -> bool:
        """Wait until the master answers; whether it does."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._up and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._up

    def failed(self, what: str) -> None:
        """A call found the master unreachable: answer without it until it is back."""
        with self._lock:
            if not self._up:
                return
            self._up = False
            self.failures += 1
            self._changed.notify_all()
        log.warning(
            "ucm mooncake store: master %s unreachable (%s); lookups miss and dumps are "
            "dropped until it answers again",
            self.config.master,
            what,
        )
        self._wake.set()

    def _set_up(self) -> None:
        with self._lock:
            self._up = True
            first = not self._ever_up
            self._ever_up = True
            self._changed.notify_all()
        if first:
            log.info("ucm mooncake store: connected to master %s", self.config.master)
        else:
            log.warning("ucm mooncake store: master %s answers again", self.config.master)

    def _run(self) -> None:
        reported = False
        while not self._closed:
            if self._client is None:
                client = self._connect()
                if client is None:
                    if not reported:
                        reported = True
                        log.warning(
                            "ucm mooncake store: master %s does not answer; serving without "
                            "this store until it does",
                            self.config.master,
                        )
                    self._sleep()
                    continue
                self._client = client
                self._set_up()
            elif self._up:
                self._wake.wait()
                self._wake.clear()
            elif self._answers(self._client):
                self._set_up()
            else:
                self._sleep()

    def _watch(self) -> None:
        """While the master answers, hold a connection to it; when the master closes or
        resets it, knock: a master that does not accept is taken as down at once."""
        while True:
            with self._lock:
                while not self._up and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
            master = self._knock()
            conn = _watch_connection(master) if master is not None else None
            if conn is None:
                self.failed("it stopped accepting connections")
                continue
            self._watching = conn
            try:
                while self._up and not self._closed:
                    try:
                        if not conn.recv(64):
                            break  # closed by the master: dead, restarting, or idle-closed
                    except TimeoutError:
                        continue
                    except OSError:
                        break  # reset: its process died
            finally:
                self._watching = None
                conn.close()
            if self._up and not self._closed and self._knock() is None:
                self.failed("its connection was reset and it no longer accepts one")

    def _sleep(self) -> None:
        self._wake.wait(self.config.probe_interval_s)
        self._wake.clear()

    def _knock(self) -> tuple[str, int] | None:
        """The master (the leader, when highly available) if it accepts a connection."""
        wait = min(1.0, self.config.timeout_s)
        master = master_address(self.config, wait)
        if master is None or not _accepts(*master, wait):
            return None
        return master

    def _connect(self) -> Any:
        config = self.config
        # Mooncake's setup() holds the GIL while it retries a master that does not answer
        # (90 s with 0.3.13), freezing every thread of the engine: knock first.
        master = self._knock()
        if master is None:
            return None
        client = self._make_client()
        # the tenant only where one is set: clients before 0.3.13 take no such argument
        tenant = {} if config.tenant_id is None else {"tenant_id": config.tenant_id}
        with _environment_lock:
            if config.highly_available:
                # The client reads which cluster's leader to follow from its environment,
                # once, in setup().
                os.environ["MC_STORE_CLUSTER_ID"] = config.cluster_id
            code = client.setup(
                config.local_hostname or local_address(*master),
                config.metadata_server,
                config.global_segment_bytes,
                config.local_buffer_bytes,
                config.protocol,
                config.device,
                config.master,
                **tenant,
            )
        if code != 0:
            _abandon(client)
            return None
        return client

    def _answers(self, client: Any) -> bool:
        # A call to a master that is gone blocks for seconds: knock first.
        if self._knock() is None:
            return False
        # health_check() alone reports the state of the client's last heartbeat, which
        # still says healthy just after the master died: ask the master something as well.
        if client.health_check() != 0:
            return False
        found = client.batch_is_exist(["ucm-probe"])
        return bool(found) and found[0] >= 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            up = self._up
            self._up = False
            self._changed.notify_all()
        self._wake.set()
        watching = self._watching
        if watching is not None:
            try:
                watching.shutdown(socket.SHUT_RDWR)  # wakes the watch thread's recv
            except OSError:
                pass
        if self._client is None:
            return
        if up and not self.config.highly_available:
            self._client.close()  # unmounts this process's segment: its blocks leave the pool
        else:
            # A client following the leader through etcd blocks for 30 s in close(),
            # holding the GIL (0.3.13): left open, its segment leaves the pool when its
            # process exits (a load from a gone process fails: a miss).
            _abandon(self._client)


def _abandon(client: Any) -> None:
    """Never close or destroy ``client``: with its master gone, close() retries unmounting
    for about 13 s holding the GIL, and its destructor, run at interpreter exit, aborts the
    process (a joinable std::thread destroyed).  There is nothing to unmount from a dead
    master; the reference taken here is never given back."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


def _watch_connection(master: tuple[str, int]) -> socket.socket | None:
    """An idle connection to the master, or None where it is refused.  Keepalives find a
    peer that vanished without a word (a host down, a cable cut) within a few seconds."""
    try:
        conn = socket.create_connection(master, timeout=1.0)
    except OSError:
        return None
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    conn.settimeout(0.5)  # the watch looks at the link's state between waits
    return conn


def _accepts(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def local_address(host: str, port: int) -> str:
    """This host's address on the route to ``host``: what other clients reach it at."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()
