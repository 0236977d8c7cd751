"""Where the stores' threads run: the CPUs an engine leaves to them.

An engine may pin its compute to cores: vLLM on the CPU binds each worker's OpenMP threads,
the worker's main thread among them, and every thread a process starts inherits the CPUs of
the thread that starts it.  A store's threads, started from the worker, would then copy and
hash on the cores that run the forward pass, while the cores the engine keeps free idle.
An adapter that knows the engine's binding names the free CPUs once
(``place_store_threads``), before it opens its stores; every thread a store starts moves
there first thing (``store_pool``, ``store_thread``).  Threads started before stay where
they are.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_placement: frozenset[int] | None = None
_warned = False


def place_store_threads(cpus: Iterable[int] | None) -> None:
    """Run the threads the stores start from now on on ``cpus`` (None: where the thread
    that starts them runs)."""
    global _placement
    chosen = frozenset(cpus) if cpus is not None else None
    _placement = chosen or None


def store_threads_cpus() -> frozenset[int] | None:
    """The CPUs set by ``place_store_threads``; None where none is."""
    return _placement


def enter_store_thread() -> None:
    """The first call of every thread a store starts: move to the placement, if any."""
    global _warned
    cpus = _placement
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError) as exc:  # the CPUs went away; stay, and say so once
        if not _warned:
            _warned = True
            log.warning(
                "ucm: store threads stay where they are, not on CPUs %s: %s", format_cpus(cpus), exc
            )


def store_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A store's thread pool, its threads on the placement."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=enter_store_thread)


def store_thread(
    target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """A store's daemon thread (not started), on the placement."""

    def run() -> None:
        enter_store_thread()
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpus(text: str) -> frozenset[int]:
    """``"0-3,6"`` (the kernel's cpulist format) as a set; ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"{part.strip()!r} is not a CPU number or range like '4-7'")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"the range {part.strip()!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The kernel's cpulist format: ``"0-3,6"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def spare_cpus(
    allowed: Iterable[int],
    computing: Iterable[int],
    nodes: Mapping[int, frozenset[int]] | None = None,
) -> frozenset[int]:
    """The CPUs of ``allowed`` that do not compute, on the memory nodes that the computing
    CPUs sit on (a worker bound to one NUMA node copies on that node; vLLM gives each rank
    a node of its own).  Empty where every allowed CPU computes."""
    computing = frozenset(computing)
    free = frozenset(allowed) - computing
    if nodes:
        near = frozenset().union(*(cpus for cpus in nodes.values() if cpus & computing))
        if near:
            free &= near
    return free


def memory_nodes(root: Path = Path("/sys/devices/system/node")) -> dict[int, frozenset[int]]:
    """Each NUMA node's CPUs, as the kernel lists them; empty where it lists none."""
    nodes: dict[int, frozenset[int]] = {}
    for folder in root.glob("node[0-9]*"):
        try:
            text = (folder / "cpulist").read_text().strip()
            nodes[int(folder.name[4:])] = parse_cpus(text) if text else frozenset()
        except (OSError, ValueError):
            continue
    return nodes
