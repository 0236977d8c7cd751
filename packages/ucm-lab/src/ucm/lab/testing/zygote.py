"""Engine processes forked from one that has imported vLLM already (the tests' start-up).

Importing torch and vLLM takes 15 of the 24 s a test engine of the tiny model lives here,
and the suite starts about a hundred engines and servers.  A zygote imports them once and
then only forks: each process is a fresh child of it that runs as ``python -m MODULE ARGS``
or ``python -c CODE ARGS`` would, with the environment, the working folder and the open
files of whoever asked for it.

Who asks is a launcher (``Zygote.command``; the file ``launcher`` in the zygote's folder),
a small Python process that hands the zygote its open files over a Unix socket (SCM_RIGHTS)
and exits with the child's exit status, forwarding SIGTERM, SIGINT and SIGHUP to it: the
caller holds an ordinary process (``subprocess.Popen``: ``communicate``, ``kill``,
``returncode``) whatever ran behind it.  Killing a launcher kills its child and everything
the child started (the child leads a session of its own and watches the launcher's socket);
the zygote ends when its parent does, taking its children along.  A launcher run in another
host of ``ucm.lab.netlab`` (``ip netns exec HOST launcher ...``) sends its network and mount
namespaces too, and the child joins them before it runs: the hosts' engines fork as well.

A fork is faithful only where nothing read at a process's start differs: a request whose
environment differs from the zygote's in such variables (``EXEC_NAMES``, ``EXEC_PREFIXES``)
becomes a new interpreter instead (the launcher execs it).  In a child, multiprocessing's
"spawn" goes through the launcher too (``multiprocessing.set_executable``).  vLLM CPU
starts its engine core and workers with torch's OpenMP runtime in LD_PRELOAD, which the
zygote preloads too, and each worker with OpenMP bound to its cores: a worker bound to one
core with one thread (as every test engine's is) is forked and binds itself there
(``_bind_as_openmp_would``), any other binding is a new interpreter.  Forked with the
zygote's two threads, workers computed logprobs 0.003 apart; bound to one thread, a split
engine and a two-rank one compute the same logprobs, bit for bit, as new interpreters do.
What is saved is every import of torch and vLLM: the whole start-up of a one-process
engine, most of a split one's (58 s to 34 s here) and of a server's.

The zygote is single-threaded: forking copies only the forking thread, and a lock held by
any other would stay held in the child for good.
"""

from __future__ import annotations

import array
import atexit
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Sequence
from pathlib import Path

# The launcher: the standard library only, nothing of ours to import (its start-up is the
# interpreter's, a few tens of milliseconds).  It is a file of its own (``#!python``) so
# that multiprocessing can take it as its executable.
LAUNCHER = r"""
import array, json, os, signal, socket, sys
path = @SOCKET@
def acts_at_exec(name):
    return name in @EXEC_NAMES@ or name.startswith(@EXEC_PREFIXES@)
# whether a child forked from the zygote computes as a new interpreter would: the same
# start-up variables, but for what the child does itself (one OpenMP thread on one core, as
# vLLM binds a worker to one core) and for the zygote's preload of torch's OpenMP runtime
# (which torch's import loads anyway)
def forks_alike(mine, zygote):
    for name in set(mine) | set(zygote):
        value = mine.get(name)
        if value == zygote.get(name):
            continue
        if name == "LD_PRELOAD" and value is None:
            continue
        if name == "OMP_NUM_THREADS" and value == "1":
            continue
        one_core = (value or "").isdigit() and mine.get("OMP_NUM_THREADS") == "1"
        if name == "GOMP_CPU_AFFINITY" and one_core:
            continue  # one core, one thread
        return False
    return True
if not forks_alike({k: v for k, v in os.environ.items() if acts_at_exec(k)}, @EXEC_ENV@):
    # what the dynamic loader, the OpenMP runtime or the interpreter read when a process
    # starts differs from the zygote's: only a new interpreter honours it
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
args = sys.argv[1:]
while args and args[0] not in ("-m", "-c"):
    args = args[1:]  # interpreter flags multiprocessing passes on: not ours to honour
kind, what, args = args[0], args[1], args[2:]
child, pending = 0, []
def forward(sig, frame):  # a process manager's signal is the child's to handle
    if child:
        os.kill(child, sig)
    else:
        pending.append(sig)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, forward)
opened = []
for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
    try:
        os.fstat(fd)
        opened.append(fd)
    except OSError:
        pass  # the listing's own descriptor, closed by now
# the namespaces this launcher runs in (``ip netns exec HOST`` put it in a host's network
# and mount namespaces): the child joins them
spaces = @NAMESPACES@
space_fds = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in spaces]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
request = json.dumps({kind[1]: what, "args": args, "env": dict(os.environ), "cwd": os.getcwd(),
                      "fds": opened, "namespaces": spaces}).encode()
s.sendmsg([len(request).to_bytes(8, "big") + request],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", opened + space_fds))])
for fd in opened + space_fds:
    os.close(fd)  # the child holds them now: pipes see their end when it ends
def word():
    data = b""
    while len(data) < 4:
        chunk = s.recv(4 - len(data))
        if not chunk:
            os._exit(70)  # the zygote died before it could tell
        data += chunk
    return int.from_bytes(data, "big", signed=True)
child = word()
for sig in pending:
    os.kill(child, sig)
code = word()
os._exit(code if code >= 0 else 128 - code)
"""

# Variables read when a process starts (by the dynamic loader, OpenMP and math runtimes as
# they load, the interpreter): a child forked from the zygote would run with the zygote's
# values, so a request whose values differ runs in a new interpreter, but for the launcher's
# ``forks_alike``: the zygote's own preload, and one OpenMP thread on one core.
EXEC_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH")
EXEC_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_", "PYTHON")


# The namespaces a child joins where its launcher's differ from the zygote's, as ``ip netns
# exec`` enters them (a host of ``ucm.lab.netlab``: its network, and the mounts in which /sys
# shows that network), with the flag ``setns`` takes for each.
NAMESPACES = {"net": 0x40000000, "mnt": 0x00020000}  # CLONE_NEWNET, CLONE_NEWNS


def _acts_at_exec(name: str) -> bool:
    return name in EXEC_NAMES or name.startswith(EXEC_PREFIXES)


# modules the tests' engines and servers import on their way: imported once, here
PRELOAD = (
    "torch",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader",
    "vllm.lora.request",
    "vllm.plugins.lora_resolvers.filesystem_resolver",
    "compressed_tensors",
    "torch._inductor.codegen.cpp",
    "sympy.combinatorics",
    "ucm.vllm",
    "ucm.vllm.connector",
)


class Zygote:
    """A zygote process in the environment ``env``, importing ``preload``; started on first
    use, stopped with ``close``."""

    def __init__(self, env: dict[str, str] | None = None, preload: Sequence[str] = PRELOAD):
        self._env = env
        self._preload = tuple(preload)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = ""
        self._lock = threading.Lock()

    def launcher(self) -> str:
        """The launcher's path, starting the zygote (and waiting for its imports) if need
        be."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            return str(Path(self._dir, "launcher"))

    def command(self, module: str, args: Sequence[str]) -> list[str]:
        """The command that runs ``python -m module args`` as a child of the zygote."""
        return [self.launcher(), "-m", module, *args]

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ucm-zygote-")  # 0700: the socket is ours
        sock = Path(self._dir, "zygote.sock")
        launcher = Path(self._dir, "launcher")
        env = _openmp_preload(dict(os.environ if self._env is None else self._env))
        exec_env = {k: v for k, v in env.items() if _acts_at_exec(k)}
        code = LAUNCHER
        for name, value in (("SOCKET", str(sock)), ("EXEC_NAMES", EXEC_NAMES),
                            ("EXEC_PREFIXES", EXEC_PREFIXES), ("EXEC_ENV", exec_env),
                            ("NAMESPACES", list(NAMESPACES))):  # fmt: skip
            code = code.replace(f"@{name}@", repr(value))
        launcher.write_text(f"#!{sys.executable}\n{code}")
        launcher.chmod(0o700)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ucm.lab.testing.zygote", str(sock), str(launcher),
             *self._preload],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != b"ready":
            self._proc.kill()
            raise RuntimeError(f"the zygote did not start (exit {self._proc.wait()})")

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None
            if self._dir:
                _remove_folder(self._dir)
                self._dir = ""


def _remove_folder(folder: str) -> None:
    """The zygote's folder and the two files it ever holds."""
    for name in ("zygote.sock", "launcher"):
        Path(folder, name).unlink(missing_ok=True)
    os.rmdir(folder)


def _word(n: int) -> bytes:
    """A pid or an exit status as the launcher reads it: 4 bytes, signed."""
    return n.to_bytes(4, "big", signed=True)


_zygote: Zygote | None = None


def forked(command: Sequence[str]) -> list[str]:
    """``command`` as a child of this process's zygote where it is ``python -m MODULE ...``
    of this interpreter and ``UCM_TEST_ZYGOTE`` is not 0; else ``command`` as it is."""
    global _zygote
    command = list(command)
    if (
        len(command) < 3
        or command[:2] != [sys.executable, "-m"]
        or os.environ.get("UCM_TEST_ZYGOTE", "1") == "0"
    ):
        return command
    if _zygote is None:
        _zygote = Zygote({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        atexit.register(_zygote.close)
    return _zygote.command(command[2], command[3:])


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(256 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    size = int.from_bytes(data[:8], "big")
    body = bytearray(data[8:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the launcher left mid-request")
        body += chunk
    return json.loads(body), list(fds)


def _child(conn: socket.socket, request: dict, received: list[int], launcher: str) -> None:
    """In the forked child: become the process the launcher asked for."""
    import fcntl
    import multiprocessing
    import runpy

    os.setsid()  # a group of its own, for the watchdog to kill whole
    spaces = request.get("namespaces", [])
    own = len(received) - len(spaces)
    received, space_fds = received[:own], received[own:]
    _join(dict(zip(spaces, space_fds)))  # while this process has one thread, as setns needs
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    # the launcher's files at the launcher's numbers: first all of them, and the socket,
    # out of the way of those numbers
    base = max([1023, *request["fds"], *received]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in received]
    low = conn.detach()
    conn = socket.socket(fileno=fcntl.fcntl(low, fcntl.F_DUPFD, base))
    for fd in [*received, low]:
        os.close(fd)
    for target, fd in zip(request["fds"], high):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _bind_as_openmp_would(request["env"])
    multiprocessing.set_executable(launcher)  # its "spawn" comes back here too

    def watch() -> None:  # the launcher gone (killed): so is everything started here
        while conn.recv(1):
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    if "m" in request:
        sys.argv = [request["m"], *request["args"]]
        runpy.run_module(request["m"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *request["args"]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["c"], "<string>", "exec"), main.__dict__)
    sys.exit(0)


def _join(spaces: dict[str, int]) -> None:
    """Enter the namespaces open at ``spaces`` (name -> descriptor) that are not this
    process's already, and close the descriptors."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for name, fd in spaces.items():
        other = os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino
        if other and libc.setns(fd, NAMESPACES[name]) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"could not join the launcher's {name} namespace")
        os.close(fd)


def _bind_as_openmp_would(env: dict[str, str]) -> None:
    """What a new interpreter's OpenMP runtime does at start-up with one thread on one core
    (``OMP_NUM_THREADS=1``, ``GOMP_CPU_AFFINITY=N``, as vLLM starts a worker bound to one
    core): compute on one thread, the main thread bound to that core."""
    if env.get("OMP_NUM_THREADS") == "1":
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)
        cpu = env.get("GOMP_CPU_AFFINITY", "")
        if cpu.isdigit():
            os.sched_setaffinity(0, {int(cpu)})


def _openmp_preload(env: dict[str, str]) -> dict[str, str]:
    """``env`` with torch's OpenMP runtime preloaded, as vLLM CPU starts its engine core and
    workers (``LD_PRELOAD``), so that those fork from the zygote too; as it is where it
    preloads something already or torch has no such runtime."""
    import importlib.util

    if env.get("LD_PRELOAD"):
        return env
    spec = importlib.util.find_spec("torch")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    found = sorted(
        lib
        for folder in folders
        for lib in [
            *folder.joinpath("lib").glob("libgomp*.so*"),
            *folder.parent.joinpath("torch.libs").glob("libgomp*.so*"),
        ]  # fmt: skip
    )
    return {**env, "LD_PRELOAD": str(found[0])} if found else env


def serve(path: str, launcher: str, preload: Sequence[str]) -> None:
    """Import, listen at ``path``, fork a child per request, report each child's pid and
    then its exit status to its launcher."""
    # what the imports print goes to stderr (vLLM 0.30 logs to stdout): stdout says only
    # "ready" to the parent
    ready = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an engine that needs it imports it itself
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    parent = os.getppid()
    ready.write("ready\n")
    ready.close()
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for _ in sel.select(timeout=0.2):
            conn, _ = server.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                server.close()
                for other in children.values():
                    other.close()
                _child(conn, request, fds, launcher)  # ends in SystemExit: never returns
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(_word(pid))
            except OSError:
                pass  # the launcher is gone: the child's watchdog ends it
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(_word(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            conn.close()
    for pid in children:  # the parent is gone: so are the processes it asked for
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    _remove_folder(os.path.dirname(path))  # and so is the folder made for us


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3:])
