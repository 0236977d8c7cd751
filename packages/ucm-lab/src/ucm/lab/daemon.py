"""A process of ours that listens on a port: Mooncake's daemons for the demo, the
benchmarks and the tests, and the services benchmarks run beside an engine.  ``netns`` runs
it inside a network namespace."""

from __future__ import annotations

import abc
import os
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Mapping
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self  # 3.11; annotations only, so 3.10 runs too


#: every port free_port handed out in this process: none is handed out twice
_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1", *, other_than: Collection[int] = ()) -> int:
    """A port nothing listens on at ``host`` now, none this process was given before and
    none of ``other_than`` (a port chosen by a caller): the kernel may hand two calls in a
    row the same free port, and a daemon given one already given (a Mooncake master's RPC
    and metrics ports; a standby's RPC port, not bound until it is elected) fails to listen
    on it only when it needs it."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN and port not in other_than:
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port at {host} but {sorted(other_than)} and those given")


class Daemon(abc.ABC):
    """A process of ours listening on ``host:port``: started in a session of its own,
    ready once the port accepts, stopped by its pid (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        netns: str | None = None,
        log_path: str | None = None,
        extra_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host if netns is None else "127.0.0.1")
        self.netns = netns
        self.log_path = log_path
        self.extra_args = extra_args
        self.env = None if env is None else {**os.environ, **env}  # added to ours
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The daemon's command line."""

    def start(self, timeout: float = 20.0) -> Self:
        command = [*self._command(), *self.extra_args]
        if self.netns is not None:
            command = ["ip", "netns", "exec", self.netns, *command]
        self._log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - kept while it runs
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{command[0]} exited with {self.proc.returncode} (log: {self.log_path})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{command[0]} did not listen on {self.address}")
            time.sleep(0.05)
        return self

    def _ready(self) -> bool:
        """Whether the daemon has started (by default: it accepts connections)."""
        return self._accepts()

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

    def restart(self) -> Self:
        """A new process on the same address (a master's metadata starts empty)."""
        self.stop()
        return self.start()

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_CONNECT = (
    "import socket,sys\n"
    "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.2).close()"
)
