"""``vllm serve`` in a fresh process, and an OpenAI client talking to it over real HTTP.

Every server pins vLLM's CPU threads the same way as ``run_engine``, so that outputs of
servers with and without the connector compare exactly while requests go one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucm.lab.testing.zygote import forked
from ucm.lab.vllm.serve_process import ServeProcess, connector_config, serve_command

MODEL_NAME = "tiny"


class Server(ServeProcess):
    """``vllm serve MODEL`` with ``store`` (None: no connector) on ``host``, as every test
    starts it; ``prefix`` wraps the command (``ip netns exec HOST``)."""

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
        launcher: Sequence[str] | None = None,
    ) -> None:
        command = [
            "--tokenizer", tokenizer, "--served-model-name", MODEL_NAME,
            "--enforce-eager", "--block-size", "32", "--max-model-len", "4096", "--seed", "0",
            "--gpu-memory-utilization", "0.3", "--enable-prompt-tokens-details",
            *args,
        ]  # fmt: skip
        if store is not None:
            command += ["--kv-transfer-config", connector_config(store, extra)]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        if launcher is None:  # a child of the zygote (in the prefix's host): vLLM imported
            launcher = forked(serve_command())
        super().__init__(
            model, command, log_path, host=host, port=None if host == "127.0.0.1" else 8000,
            prefix=prefix, env=env, launcher=launcher,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 300) -> Server:
        try:
            super().wait_ready(timeout)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
        return self

    def client(self, timeout: float = 300) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=timeout, max_retries=0)


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
