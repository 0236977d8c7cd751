"""The tests' zygote: a child of it behaves as ``python -m MODULE ARGS`` would, to whoever
started the launcher (streams, environment, folder, exit status, signals), and nothing it
started outlives a killed launcher or the zygote's parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from ucm.lab.testing.zygote import Zygote

PROBE = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, subprocess, sys, time

    def report(queue):
        queue.put([os.getpid(), os.getppid()])

    def here():
        return [os.readlink("/proc/self/ns/net"), sorted(os.listdir("/sys/class/net"))]

    def where(queue):
        queue.put(here())

    def main(mode):
        if mode == "echo":
            print(json.dumps({"args": sys.argv[1:], "cwd": os.getcwd(), "name": __name__,
                              "probe": os.environ.get("PROBE"), "stdin": sys.stdin.read()}))
            print("to stderr", file=sys.stderr)
            sys.exit(7)
        if mode == "tree":  # a grandchild too, as vLLM's engine core would be
            sleeper = subprocess.Popen(["sleep", "60"])
            print(os.getpid(), sleeper.pid, flush=True)
            time.sleep(60)
        if mode == "term":  # a server's orderly stop
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
            print("ready", flush=True)
            time.sleep(60)
        if mode == "pid":
            print(os.getpid(), flush=True)
        if mode == "placed":
            print(json.dumps([os.getpid(), sorted(os.sched_getaffinity(0))]), flush=True)
        if mode == "where":  # the network namespace, and one a spawned child is in
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=where, args=(queue,))
            proc.start()
            print(json.dumps([os.getppid(), here(), queue.get(timeout=60)]), flush=True)
            proc.join(60)
        if mode == "crash":
            raise RuntimeError("boom")
        if mode == "spawn":  # as vLLM CPU starts its engine core and workers
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=report, args=(queue,))
            proc.start()
            print(json.dumps(queue.get(timeout=60)), flush=True)
            proc.join(60)
            print(proc.exitcode, flush=True)

    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


@pytest.fixture
def zygote(tmp_path, monkeypatch):
    (tmp_path / "zygote_probe.py").write_text(PROBE)
    # the probe importable by the zygote and by every process the tests start
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    z = Zygote(dict(os.environ), preload=("json",))
    yield z
    z.close()


def gone(pid: int, within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_has_the_launchers_streams_environment_folder_and_exit_status(zygote, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        zygote.command("zygote_probe", ["echo", "a b", "--x"]),
        input="from stdin", capture_output=True, text=True, cwd=work,
        env=dict(os.environ, PROBE="asked"), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 7
    assert proc.stderr == "to stderr\n"
    assert json.loads(proc.stdout) == {
        "args": ["echo", "a b", "--x"], "cwd": str(work), "name": "__main__",
        "probe": "asked", "stdin": "from stdin",
    }  # fmt: skip


def test_an_exception_is_exit_1_with_its_traceback(zygote):
    proc = subprocess.run(
        zygote.command("zygote_probe", ["crash"]), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr


def test_sigterm_to_the_launcher_is_the_childs_to_handle(zygote):
    proc = subprocess.Popen(
        zygote.command("zygote_probe", ["term"]), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 3


def test_multiprocessing_spawns_children_of_the_zygote_too(zygote):
    proc = subprocess.run(
        zygote.command("zygote_probe", ["spawn"]), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    first, last = proc.stdout.splitlines()
    child, parent = json.loads(first)
    assert parent == zygote._proc.pid and child != parent  # forked, not a new interpreter
    assert last == "0"


def test_what_acts_at_a_process_start_is_honoured_by_a_new_interpreter(zygote):
    # values that differ from the zygote's (an OpenMP-like name the environment lacks)
    preload = os.environ.get("LD_PRELOAD", "") + " "
    for env, forked in (
        ({}, True),
        ({"OMP_UCM_PROBE": "1"}, False),
        ({"LD_PRELOAD": preload}, False),
    ):
        proc = subprocess.Popen(
            zygote.command("zygote_probe", ["pid"]), stdout=subprocess.PIPE, text=True,
            env={**os.environ, **env},
        )  # fmt: skip
        pid = int(proc.stdout.read())
        assert proc.wait(60) == 0
        # exec keeps the launcher's pid; a fork of the zygote has one of its own
        assert (pid != proc.pid) is forked, env


def test_a_worker_bound_to_one_core_forks_and_is_bound_as_openmp_would_bind_it(zygote):
    """vLLM CPU starts a worker bound to one core with ``OMP_NUM_THREADS=1`` and
    ``GOMP_CPU_AFFINITY=N`` (and torch's OpenMP runtime preloaded, as the zygote has it): a
    fork of the zygote binds its main thread there itself; more threads need OpenMP's own
    binding, a new interpreter."""
    cpu = max(os.sched_getaffinity(0))
    for env, forked, cpus in (
        ({"OMP_NUM_THREADS": "1", "GOMP_CPU_AFFINITY": str(cpu)}, True, [cpu]),
        ({"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": f"{cpu} {cpu}"}, False, None),
        ({"OMP_NUM_THREADS": None, "GOMP_CPU_AFFINITY": str(cpu)}, False, None),
        ({"LD_PRELOAD": zygote_preload()}, True, sorted(os.sched_getaffinity(0))),
    ):
        proc = subprocess.Popen(
            zygote.command("zygote_probe", ["placed"]), stdout=subprocess.PIPE, text=True,
            env={k: v for k, v in {**os.environ, **env}.items() if v is not None},
        )  # fmt: skip
        pid, placed = json.loads(proc.stdout.read())
        assert proc.wait(60) == 0
        assert (pid != proc.pid) is forked, env
        if forked:
            assert placed == cpus, env


def zygote_preload() -> str:
    """What the zygote preloads (torch's OpenMP runtime, where this environment has torch)."""
    from ucm.lab.testing.zygote import _openmp_preload

    return _openmp_preload({}).get("LD_PRELOAD", "")


def test_a_killed_launcher_takes_the_child_and_what_it_started_along(zygote):
    proc = subprocess.Popen(
        zygote.command("zygote_probe", ["tree"]), stdout=subprocess.PIPE, text=True
    )
    child, grandchild = map(int, proc.stdout.readline().split())
    proc.kill()
    proc.wait(10)
    assert gone(child) and gone(grandchild)


def test_the_zygote_ends_with_its_parent_and_so_do_its_children(tmp_path):
    (tmp_path / "zygote_probe.py").write_text(PROBE)
    # a parent that starts a zygote and a child of it, says their pids and is killed
    parent = textwrap.dedent(
        """
        import os, subprocess, sys
        from ucm.lab.testing.zygote import Zygote
        z = Zygote(dict(os.environ), preload=())
        proc = subprocess.Popen(z.command("zygote_probe", ["tree"]), stdout=subprocess.PIPE,
                                text=True)
        print(z._proc.pid, proc.stdout.readline().strip(), flush=True)
        import time; time.sleep(60)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env
    )
    zygote_pid, child, grandchild = map(int, proc.stdout.readline().split())
    proc.kill()
    proc.wait(10)
    # the launcher was the parent's child: it lives on, but the zygote and its tree do not
    assert gone(zygote_pid) and gone(child) and gone(grandchild)


@pytest.mark.root
def test_a_child_started_in_another_host_joins_its_network_as_ip_netns_exec_would(zygote):
    """A launcher under ``ip netns exec HOST`` (a host of ``ucm.lab.netlab``): the forked child
    and what it spawns are in that host's network and see its interfaces in /sys, as a new
    interpreter there does."""
    from ucm.lab.netlab import NetLab
    from ucm.lab.pytest_plugin import require_namespaces

    require_namespaces()
    code = (
        "import json, os; print(json.dumps([os.readlink('/proc/self/ns/net'), "
        "sorted(os.listdir('/sys/class/net'))]))"
    )
    with NetLab(["a"]) as lab:
        interpreter = subprocess.run(
            lab.command("a", [sys.executable, "-c", code]),
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        proc = subprocess.run(
            lab.command("a", zygote.command("zygote_probe", ["where"])),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    parent, child, spawned = json.loads(proc.stdout)
    assert parent == zygote._proc.pid  # forked, not a new interpreter
    assert child == spawned == json.loads(interpreter.stdout)
    assert child[1] == ["eth0", "lo"] and child[0] != os.readlink("/proc/self/ns/net")
