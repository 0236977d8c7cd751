"""Which master to knock on: the one configured, or the leader etcd names.

Highly available masters (``mooncake_master --enable_ha``) elect a leader through etcd,
which holds its HOST:PORT under ``mooncake-store/<cluster_id>/master_view`` while its lease
lives.  Mooncake's client follows that key by itself; UCM reads it too, for one reason: a
client whose master does not answer blocks in Mooncake's calls (for 90 s, holding the GIL,
in ``setup()``), so the link knocks on the leader with a plain TCP connect before it lets
the client call it.  etcd's v3 JSON gateway (``POST /v3/kv/range``) answers that read with
the standard library alone.
"""

from __future__ import annotations

import base64
import http.client
import json

from ucm.core.store.mooncake.config import MooncakeStoreConfig, parse_host_port

#: An answer larger than this is not etcd answering one key: it is not read.
_MAX_ANSWER = 64 << 10


def master_address(config: MooncakeStoreConfig, timeout: float) -> tuple[str, int] | None:
    """The master to knock on: ``config.master``, or the leader that the first etcd
    endpoint to answer names; None when no endpoint answers or no leader is elected."""
    if not config.highly_available:
        return config.master_endpoints[0]
    for host, port in config.master_endpoints:
        try:
            value = etcd_get(host, port, config.master_view_key, timeout)
        except (OSError, ValueError, http.client.HTTPException):
            continue  # this endpoint is down or answers nonsense: ask the next
        return None if value is None else parse_leader(value)
    return None


def etcd_get(host: str, port: int, key: str, timeout: float) -> bytes | None:
    """The value of ``key`` in the etcd at ``host:port`` (None: no such key).  Raises
    OSError, HTTPException or ValueError when etcd does not answer, or answers badly."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()})
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("POST", "/v3/kv/range", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = response.read(_MAX_ANSWER + 1)
    finally:
        connection.close()
    if response.status != 200 or len(answer) > _MAX_ANSWER:
        raise ValueError(f"etcd answered {response.status} with {len(answer)} bytes")
    kvs = json.loads(answer).get("kvs") or []
    if not isinstance(kvs, list) or not kvs or not isinstance(kvs[0], dict):
        return None
    return base64.b64decode(kvs[0].get("value", ""), validate=True)


def parse_leader(value: bytes) -> tuple[str, int] | None:
    """The leader's (host, port) from the master view's value, None if it is not one."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    return parse_host_port(text)
