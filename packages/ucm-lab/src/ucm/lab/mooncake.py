"""Mooncake's daemons run by us: for the demo, the benchmarks and the tests.

:class:`LocalMaster` is a ``mooncake_master``; :class:`SegmentServer` is a
``mooncake_client``, a process whose only job is to give the pool memory, so that blocks
outlive the engine that wrote them.  Production clusters run both as services (see Running
across machines); these start one on free ports of a given address, wait until it accepts
connections, and stop it by its pid.  ``netns`` runs it inside a network namespace.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from ucm.lab.daemon import Daemon, free_port


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
    """``mooncake_master`` on ``host``: ``address`` is what clients set as ``master``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics_port = free_port("127.0.0.1")

    def _command(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
        ]


class SegmentServer(Daemon):
    """``mooncake_client`` on ``host``, giving ``segment_mb`` MiB to ``master``'s pool."""

    def __init__(self, master: str, segment_mb: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.master = master
        self.segment_mb = segment_mb

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
