"""A KV-aware router's view of an engine's KV events: a ZMQ subscriber on loopback."""

from __future__ import annotations

import threading
import time
from typing import Any

from ucm.lab.daemon import free_port


class Subscriber:
    """A router's view: a ZMQ SUB socket on loopback (the server's publisher connects to
    it), decoding each batch of events as vLLM encodes it."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.port = free_port()
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.bind(f"tcp://127.0.0.1:{self.port}")
        self.socket.setsockopt_string(zmq.SUBSCRIBE, "")
        self.socket.setsockopt(zmq.RCVTIMEO, 200)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        while not self.done.is_set():
            try:
                _topic, _seq, payload = self.socket.recv_multipart()
            except zmq.Again:
                continue
            self.events += self.decoder.decode(payload).events

    def ucm(self, kind: Any = None) -> list:
        from vllm.distributed.kv_events import BlockStored

        kind = kind or BlockStored
        return [
            e for e in self.events
            if getattr(e, "ownership", None) == "ucm" and isinstance(e, kind)
        ]  # fmt: skip

    def wait_for(self, count: int, kind: Any = None, timeout: float = 30) -> list:
        deadline = time.monotonic() + timeout
        while len(self.ucm(kind)) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.ucm(kind)

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.socket.close(0)


def events_config(subscriber: Subscriber) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` publishing to ``subscriber``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{subscriber.port}",
    }
