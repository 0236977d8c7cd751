"""Where a server's CPU time goes while it serves: ``py-spy`` attached to a ``vllm serve``
(and its engine's processes), its samples sorted into what vLLM computes and what each KV
connector adds (``bench_serve --profile``).

A sample is one stack of one thread that was running (py-spy leaves idle threads out), so
samples / rate is CPU seconds.  A stack is put under the first KV connector hook vLLM called
on it (``connector.start_load_kv``, ``connector.get_num_new_matched_tokens``, ...) when that
hook is the connector's own code, under ``forward`` when it runs the model otherwise, under
``store threads`` when it is a connector's background thread (UCM's copy threads, LMCache's
workers), else under ``other`` (the HTTP front end, the scheduler's own work, tokenising).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

#: samples a second: a 20-ms step is seen about 4 times
RATE = 200

#: the calls vLLM makes into a KV connector (``KVConnectorBase_V1``), on either side
HOOKS = frozenset(
    {
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "request_finished", "request_finished_all_groups", "update_connector_output",
        "take_events", "register_kv_caches", "start_load_kv", "wait_for_layer_load",
        "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
        "handle_preemptions", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
        "bind_connector_metadata", "clear_connector_metadata",
    }
)  # fmt: skip
#: where a connector's own code lives (in a frame's full file name: installed, or UCM's
#: source tree in an editable install)
CONNECTOR_CODE = (
    "site-packages/ucm/", "/src/ucm/", "site-packages/lmcache/", "/offloading_connector.py",
)  # fmt: skip
#: frames of the model's forward pass
FORWARD = ("execute_model", "_model_forward")


def py_spy() -> str:
    """The ``py-spy`` of this environment (``pip install py-spy``)."""
    found = Path(sys.executable).parent / "py-spy"
    if not found.exists():
        raise RuntimeError(f"--profile needs py-spy beside {sys.executable}: pip install py-spy")
    return str(found)


class Profiler:
    """``py-spy record`` of process ``pid`` and its children until :meth:`stop`."""

    def __init__(self, pid: int, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.proc = subprocess.Popen(
            [py_spy(), "record", "--pid", str(pid), "--subprocesses", "--nonblocking",
             "--full-filenames", "--format", "raw", "--rate", str(RATE),
             "--output", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def stop(self, timeout: float = 60) -> Path:
        """Stop sampling and write the samples (py-spy writes them on SIGINT)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.path.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err[-2000:]}")
        return self.path


def classify(stack: list[str]) -> str:
    """The part of the server a stack (outermost frame first) is spent in."""
    names = []
    for frame in stack:
        qualified, _, where = frame.partition(" (")
        name = qualified.rpartition(".")[2]  # py-spy names methods Class.method
        if name in HOOKS and any(code in where for code in CONNECTOR_CODE):
            return f"connector.{name}"
        names.append(name)
    if any(name in FORWARD for name in names):
        return "forward"
    if any(code in frame for frame in stack for code in CONNECTOR_CODE):
        return "store threads"
    return "other"


def cpu_seconds(raw: str, rate: int = RATE) -> dict[str, float]:
    """CPU seconds by part (:func:`classify`) of a py-spy raw profile ("frames count" lines,
    frames separated by ``;``, the process frames first)."""
    samples: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        samples[classify(frames)] += int(count)
    return {part: n / rate for part, n in sorted(samples.items())}


def connector_share(seconds: Mapping[str, float]) -> float:
    """CPU seconds in the connector's hooks and threads, of all a profile holds."""
    return sum(s for part, s in seconds.items() if part.startswith("connector.")) + seconds.get(
        "store threads", 0.0
    )
