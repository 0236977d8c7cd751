"""Finding the leader of highly available masters in a real etcd: what the link knocks on
before it lets Mooncake's client call a master."""

import base64
import http.server
import json
import threading
import urllib.request

import pytest
from ucm.core.config import MooncakeStoreConfig
from ucm.core.store.mooncake.leader import etcd_get, master_address, parse_leader
from ucm.lab.daemon import free_port
from ucm.lab.pytest_plugin import require_etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    from ucm.lab.mooncake import Etcd

    require_etcd()
    logs = tmp_path_factory.mktemp("etcd")
    with Etcd(str(logs / "data"), log_path=str(logs / "etcd.log")) as etcd:
        yield etcd


def put(etcd, key: str, value: bytes) -> None:
    body = json.dumps(
        {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
    ).encode()
    urllib.request.urlopen(f"http://{etcd.address}/v3/kv/put", body, timeout=5).read()


def config(master: str, cluster_id: str) -> MooncakeStoreConfig:
    return MooncakeStoreConfig(master=master, cluster_id=cluster_id)


def test_the_leader_etcd_names_is_knocked_on(etcd):
    put(etcd, "mooncake-store/named/master_view", b"10.1.2.3:50051")
    assert master_address(config(etcd.url, "named"), 1.0) == ("10.1.2.3", 50051)
    # another cluster on the same etcd has no leader yet
    assert master_address(config(etcd.url, "other"), 1.0) is None


def test_an_endpoint_that_does_not_answer_is_passed_over(etcd):
    put(etcd, "mooncake-store/second/master_view", b"[fd00::7]:6000")
    dead = f"127.0.0.1:{free_port()}"
    both = config(f"etcd://{dead};{etcd.address}", "second")
    assert master_address(both, 1.0) == ("fd00::7", 6000)
    assert master_address(config(f"etcd://{dead}", "second"), 1.0) is None


@pytest.mark.parametrize("value", [b"", b"no port", b"10.0.0.1:0", b"\xff\xfe:1", b"a b:1"])
def test_a_view_that_is_not_host_port_names_no_leader(etcd, value):
    put(etcd, "mooncake-store/junk/master_view", value)
    assert parse_leader(value) is None
    assert master_address(config(etcd.url, "junk"), 1.0) is None


def test_a_single_master_is_its_own_address():
    assert master_address(config("10.0.0.9:50051", "unused"), 1.0) == ("10.0.0.9", 50051)


class _Hostile(http.server.BaseHTTPRequestHandler):
    """Answers a range read with more than any one key's value."""

    def do_POST(self) -> None:  # noqa: N802 - the handler's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"kvs": [{"value": "QQ==" * 100_000}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_endless_answer_is_not_read():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        with pytest.raises(ValueError, match="bytes"):
            etcd_get(str(host), int(port), "mooncake-store/x/master_view", 1.0)
        assert master_address(config(f"etcd://{host}:{port}", "x"), 1.0) is None
    finally:
        server.shutdown()
        server.server_close()
