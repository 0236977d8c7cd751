"""Where the store's threads run in a vLLM CPU worker (``store_cpus``).

vLLM on the CPU starts each worker with OpenMP bound to cores of one NUMA node
(``VLLM_CPU_OMP_THREADS_BIND=auto``), the worker's main thread among them, and keeps some
cores free for its other processes: one, plus one a rank when a KV connector is configured
(``vllm.utils.ompmultiprocessing``).  The connector's stores start their threads from that
main thread, so without a placement they copy and hash on the compute cores.  The worker's
parent (vLLM's engine core) still holds every CPU the deployment may use; what it may use
and the worker does not compute on, on the worker's node, is what vLLM left free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ucm.core import format_cpus, memory_nodes, parse_cpus, spare_cpus
from ucm.core.settings import ConfigError

log = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def store_cpus(
    setting: str,
    environ: Mapping[str, str],
    computing: frozenset[int],
    allowed: frozenset[int] | None,
    nodes: Mapping[int, frozenset[int]] | None = None,
    cpu_platform: bool = True,
) -> frozenset[int] | None:
    """The CPUs for the store's threads under ``setting`` (None: where they start), given
    the worker's own CPUs (``computing``) and its parent's (``allowed``, None if unknown);
    vLLM binds its workers only on the CPU platform (``cpu_platform``)."""
    if setting == "inherit":
        return None
    if setting != "spare":
        cpus = parse_cpus(setting)
        known = allowed if allowed is not None else frozenset(range(os.cpu_count() or 1))
        if not cpus <= known:
            raise ConfigError(
                "kv_connector_extra_config.store_cpus",
                f"names CPUs {format_cpus(cpus - known)} that this engine may not use "
                f"(it may use {format_cpus(known)})",
            )
        return cpus
    if not cpu_platform or environ.get(BIND_ENV, "auto") != "auto" or allowed is None:
        # Cores named by hand: the ones left out may belong to another engine.
        return None
    return spare_cpus(allowed, computing, nodes) or None


def worker_store_cpus(setting: str, cpu_platform: bool) -> frozenset[int] | None:
    """``store_cpus`` for this process, a vLLM worker (on the CPU, its compute is bound by
    now: OpenMP binds the main thread when torch loads it)."""
    computing = frozenset(os.sched_getaffinity(0))
    try:
        allowed: frozenset[int] | None = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone or not ours to ask
        allowed = None
    cpus = store_cpus(setting, os.environ, computing, allowed, memory_nodes(), cpu_platform)
    if cpus is not None:
        log.info(
            "ucm: the store's threads run on CPUs %s (this worker computes on %s)",
            format_cpus(cpus),
            format_cpus(computing),
        )
    return cpus
