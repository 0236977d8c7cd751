"""The harness's daemons: ports they are given."""

from __future__ import annotations

import socket

from ucm.lab import daemon
from ucm.lab.mooncake import Etcd, LocalMaster


class SamePort(socket.socket):
    """A socket whose first binds to port 0 get one port, as the kernel may hand out."""

    ports = [40001, 40001, 40001, 40002]

    def getsockname(self):
        host, _ = super().getsockname()
        return host, SamePort.ports.pop(0) if SamePort.ports else 40003


def test_a_daemon_never_gets_the_same_port_twice(monkeypatch, tmp_path):
    # a Mooncake master given its RPC port as its metrics port too listened on it for
    # metrics and failed to serve once elected leader (seen in a full test run)
    monkeypatch.setattr(daemon.socket, "socket", SamePort)
    monkeypatch.setattr(daemon, "_GIVEN", set())  # the ports this test's fakes hand out
    SamePort.ports = [40001, 40001, 40001, 40002]
    master = LocalMaster(etcd="127.0.0.1:2379", cluster_id="c", log_path=str(tmp_path / "m"))
    assert (master.port, master.metrics_port) == (40001, 40002)
    SamePort.ports = [40005, 40005, 40006]
    etcd = Etcd(str(tmp_path / "e"))
    assert (etcd.port, etcd.peer_port) == (40005, 40006)
    SamePort.ports = [40007] * 3
    assert daemon.free_port(other_than={40007}) == 40003
