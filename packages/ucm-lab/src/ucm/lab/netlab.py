"""Hosts made of Linux network namespaces on one bridge: the cluster demo and the tests.

Each host is a namespace with its own loopback and one interface on a private /24, so a
process started in it (``command``) sees only its own address and the others', as on a
separate machine.  Faults are made on a host's link: ``link_down`` (a partition), ``throttle``
(a slow link: a token bucket, which also adds queueing delay), ``netem`` (latency and loss,
where the kernel has it).  Needs root and iproute2; ``unavailable()`` says why not.

Names carry the creating pid, so that a lab left by a killed run is removed by the next.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from collections.abc import Sequence


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PREFIX = "ucmlab"
_BRIDGE_PREFIX = "ucmb"


class NetLabError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise NetLabError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not shutil.which("ip"):
        return "iproute2 (the ip command) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"{_PREFIX}-{os.getpid()}-probe"
    done = _ip("netns", "add", name, check=False)
    if done.returncode:
        return f"ip netns add failed: {done.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def remove_stale() -> None:
    """Remove the namespaces and bridges of labs whose creating process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{_PREFIX}-(\d+)-\w+-\w+", name)
        if match and not pid_alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        match = re.match(rf"\d+: ({_BRIDGE_PREFIX}[0-9a-f]{{4}})[:@]", line)
        if match and not _ip("link", "show", "master", match.group(1), check=False).stdout:
            _ip("link", "del", match.group(1), check=False)


class NetLab:
    """Hosts ``names`` on one bridge; ``address(name)`` is a host's address on it.

    The bridge itself has the subnet's ``.1``, so this (the root) namespace reaches every
    host too."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z0-9]+", n) for n in names):
            raise ValueError(f"host names must be distinct, lowercase letters and digits: {names}")
        self.names = list(names)
        self.lab = f"{random.randrange(1 << 16):04x}"
        self.subnet = f"10.213.{random.randrange(256)}"
        self.bridge = f"{_BRIDGE_PREFIX}{self.lab}"
        self._made = False

    def namespace(self, name: str) -> str:
        return f"{_PREFIX}-{os.getpid()}-{self.lab}-{name}"

    def _veth(self, name: str) -> str:
        return f"ucv{self.lab}{self.names.index(name)}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{10 + self.names.index(name)}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge."""
        return f"{self.subnet}.1"

    def start(self) -> NetLab:
        remove_stale()
        self._made = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                ns, veth = self.namespace(name), self._veth(name)
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def link_down(self, name: str) -> None:
        """Cut host ``name`` off the network (its processes keep running)."""
        _ip("link", "set", self._veth(name), "down")

    def link_up(self, name: str) -> None:
        _ip("link", "set", self._veth(name), "up")

    def throttle(self, name: str, kbit: int | None) -> None:
        """Limit what host ``name`` sends to ``kbit`` kbit/s (None: lift the limit)."""
        self._qdisc(name, None if kbit is None else ["tbf", "rate", f"{kbit}kbit",
                                                     "burst", "16kb", "latency", "1s"])  # fmt: skip

    def netem(self, name: str, spec: Sequence[str] | None) -> None:
        """``tc netem`` on what host ``name`` sends (e.g. ``["delay", "20ms", "loss", "1%"]``);
        NetLabError if this kernel has no netem."""
        self._qdisc(name, None if spec is None else ["netem", *spec])

    def _qdisc(self, name: str, qdisc: list[str] | None) -> None:
        ns = self.namespace(name)
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True)
        if qdisc is None:
            return
        done = subprocess.run(
            [*tc, "add", "dev", "eth0", "root", *qdisc], capture_output=True, text=True
        )
        if done.returncode:
            raise NetLabError(f"tc qdisc {' '.join(qdisc)}: {done.stderr.strip()}")

    def close(self) -> None:
        if not self._made:
            return
        self._made = False
        for name in self.names:
            _ip("netns", "del", self.namespace(name), check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
