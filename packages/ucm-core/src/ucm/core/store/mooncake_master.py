"""A ``mooncake_master`` process of our own: for the demo, the benchmarks and the tests.

Production clusters run their master as a service (see Running across machines); this
starts one on free ports of a given address, waits until it accepts connections, and
stops it by its pid.  ``netns`` runs it inside a network namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import IO


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def master_binary() -> str:
    """The ``mooncake_master`` that Mooncake's wheel installs (beside this Python first)."""
    import sys

    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError(
            "mooncake_master not found: pip install 'ucm-core[mooncake]' puts it beside python"
        )
    return found


class LocalMaster:
    """``mooncake_master`` on ``host``: ``address`` is what clients set as ``master``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        netns: str | None = None,
        log_path: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.port = port or free_port(host if netns is None else "127.0.0.1")
        self.metrics_port = free_port("127.0.0.1")
        self.netns = netns
        self.log_path = log_path
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> LocalMaster:
        command = [
            master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            *self.extra_args,
        ]
        if self.netns is not None:
            command = ["ip", "netns", "exec", self.netns, *command]
        self._log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - kept while it runs
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while not self._accepts():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.proc.returncode} (log: {self.log_path})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mooncake_master did not listen on {self.address}")
            time.sleep(0.05)
        return self

    def _accepts(self) -> bool:
        if self.netns is not None:
            probe = ["ip", "netns", "exec", self.netns, "python3", "-c", _CONNECT, self.host]
            return subprocess.run([*probe, str(self.port)], capture_output=True).returncode == 0
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the master dies with its metadata, as in a crash."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> LocalMaster:
        """A new master on the same address, with empty metadata."""
        self.stop()
        return self.start()

    def __enter__(self) -> LocalMaster:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_CONNECT = (
    "import socket,sys\n"
    "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.2).close()"
)
