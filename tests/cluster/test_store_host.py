"""The cluster's TCPStore is hosted on a socket of its address's family: the serving
thread then never asks DNS for an accepted client's name (which on this machine's
resolver stalls the whole store 5 s for one connect in ~25)."""
from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from shared_td.coordinator.cluster_store import open_store
from shared_td.coordinator.store_host import host_tcp_store, listening_address

_CLIENTS = 12
_SERVER = """
import sys
from shared_td.coordinator.store_host import host_tcp_store
store = host_tcp_store("127.0.0.1", 0, timeout=30)
print(store.port, flush=True)
sys.stdin.read()  # until the test closes it
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_node_0_store_for_a_loopback_url_listens_on_that_address_only():
    store, _, _ = open_store(f"tcp://127.0.0.1:{_free_port()}", 0, timeout=10)
    # torch's own server listens on '::' (every interface, IPv6 mapped addresses)
    assert listening_address(store.port) == ("127.0.0.1", store.port)
    client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_a_port_in_use_is_an_error_naming_the_address():
    store = host_tcp_store("127.0.0.1", 0, timeout=10)
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{store.port}"):
        host_tcp_store("127.0.0.1", store.port, timeout=10)


def _loopback_named_by_hosts_file() -> bool:
    try:
        with open("/etc/hosts") as hosts:
            return any(line.split()[:1] == ["127.0.0.1"] for line in hosts)
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to see the server's DNS queries")
@pytest.mark.skipif(not _loopback_named_by_hosts_file(), reason="/etc/hosts does not name 127.0.0.1 here")
def test_the_store_server_asks_dns_nothing_when_clients_connect(tmp_path):
    trace = tmp_path / "server.strace"
    server = subprocess.Popen(
        ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        port = int(server.stdout.readline())
        for _ in range(_CLIENTS):
            client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
            client.set("k", "v")
            del client
    finally:
        server.stdin.close()
        server.wait(30)
    queries = [line for line in trace.read_text().splitlines() if "htons(53)" in line]
    # torch's default server (listening on '::') sends one PTR query per accepted client
    assert len(queries) <= 1, f"{len(queries)} DNS queries for {_CLIENTS} connections:\n" + "\n".join(queries)
