"""The rendezvous service under hostile input, on loopback with raw sockets: nobody without
the secret gets more than a bounded share (launcher/service/http_connection.py limits)."""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from lightning_elastic import protocol as p
from lightning_elastic.launcher.job.slots import SlotKey
from lightning_elastic.launcher.service.http_connection import MAX_PIPELINED, ConnectionLimits
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.service.rendezvous_server import RejectionLog, RendezvousServer

pytestmark = pytest.mark.timeout(60)

SECRET = "fedcba9876543210" * 4
IDLE = 0.5
CAP = 20
UNSIGNED = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[Registry, RendezvousServer]]:
    reg = Registry()
    with reg.cond:
        reg.add_worker("good", SlotKey("127.0.0.1", 0))
    srv = RendezvousServer(reg, SECRET, limits=ConnectionLimits(max_unauthenticated=CAP, idle_timeout=IDLE))
    srv.start()
    try:
        yield reg, srv
    finally:
        closer = threading.Thread(target=srv.close, daemon=True)
        closer.start()
        closer.join(timeout=10)


def connect(srv: RendezvousServer) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def closed_by_peer(sock: socket.socket, within: float = 5.0) -> bytes:
    """Everything the server sent until it closed the connection (bounded)."""
    sock.settimeout(within)
    received = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the server kept the connection open for {within} s")


def heartbeat_status(srv: RendezvousServer) -> int:
    body = p.to_json(p.HeartbeatRequest("good", 0, 0, 0.0))
    r = requests.post(srv.url + p.PATH_HEARTBEAT, data=body, headers=p.sign_request(SECRET, "POST", p.PATH_HEARTBEAT, body),
                      timeout=10)
    return r.status_code


def test_pipelining_beyond_the_bound_is_refused_and_closed(service):
    _, srv = service
    sock = connect(srv)
    sock.sendall(UNSIGNED * 1000)
    received = closed_by_peer(sock)
    assert received.count(b"HTTP/1.1 401") <= MAX_PIPELINED
    assert b"HTTP/1.1 429" in received
    assert heartbeat_status(srv) == 200


def test_a_flood_that_never_reads_its_replies_does_not_starve_a_worker(service):
    _, srv = service
    flooders = [connect(srv) for _ in range(10)]
    stop = threading.Event()

    def flood(sock: socket.socket) -> None:
        sock.settimeout(1)
        while not stop.is_set():
            try:
                sock.sendall(UNSIGNED * MAX_PIPELINED)  # within the bound, replies never read
            except OSError:
                return

    threads = [threading.Thread(target=flood, args=(s,), daemon=True) for s in flooders]
    for t in threads:
        t.start()
    try:
        statuses = [heartbeat_status(srv) for _ in range(20)]
    finally:
        stop.set()
        for s in flooders:
            s.close()
        for t in threads:
            t.join(5)
    assert statuses == [200] * 20


@pytest.fixture(scope="module")
def patient_service() -> Iterator[RendezvousServer]:
    """Idle connections kept for a minute: whatever closes one sooner is another limit."""
    srv = RendezvousServer(Registry(), SECRET, limits=ConnectionLimits(idle_timeout=60.0))
    srv.start()
    try:
        yield srv
    finally:
        closer = threading.Thread(target=srv.close, daemon=True)
        closer.start()
        closer.join(timeout=10)


@pytest.mark.parametrize("start,filler", [(b"POST /", b"a"), (b"POST / HTTP/1.1\r\nX-Big: ", b"b"),
                                          (b"POST / HTTP/1.1\r\n", b"X-1: 1\r\n")],
                         ids=["request-line", "header", "header-count"])
def test_an_endless_request_head_is_refused_and_closed(patient_service, start, filler):
    sock = connect(patient_service)
    sock.settimeout(5)
    started = time.monotonic()
    try:
        sock.sendall(start)
        # Streamed until the service cuts it off: a send fails (reset or broken pipe),
        # long before the minute of idle timeout and the 64 MiB offered.
        with pytest.raises(OSError):
            for _ in range(16 * 1024):
                sock.sendall(filler * 4096)
    finally:
        sock.close()
    assert time.monotonic() - started < 30


def test_an_idle_unauthenticated_connection_is_closed(service):
    _, srv = service
    sock = connect(srv)
    try:
        started = time.monotonic()
        assert closed_by_peer(sock, within=IDLE + 5) == b""
        assert time.monotonic() - started >= IDLE * 0.9
    finally:
        sock.close()


def test_an_authenticated_keep_alive_connection_is_not_closed_when_idle(service):
    _, srv = service
    session = requests.Session()
    body = p.to_json(p.HeartbeatRequest("good", 0, 0, 0.0))
    for _ in range(2):  # the same connection, with a pause longer than the idle timeout between
        r = session.post(srv.url + p.PATH_HEARTBEAT, data=body,
                         headers=p.sign_request(SECRET, "POST", p.PATH_HEARTBEAT, body), timeout=10)
        assert r.status_code == 200
        time.sleep(IDLE * 2)
    adapter = session.get_adapter(srv.url)
    assert adapter.poolmanager.pools, "no connection was kept"
    session.close()


def test_unauthenticated_connections_are_capped_oldest_first(service):
    _, srv = service
    socks = [connect(srv) for _ in range(CAP + 10)]
    try:
        deadline = time.monotonic() + 5
        while srv.unauthenticated_connections > CAP and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.unauthenticated_connections <= CAP
        assert closed_by_peer(socks[0], within=2) == b""  # the oldest went first
        assert heartbeat_status(srv) == 200  # a worker's new connection still gets in
    finally:
        for s in socks:
            s.close()


def test_rejections_are_logged_at_a_bounded_rate(caplog):
    now = [0.0]
    rejections = RejectionLog(lambda: now[0], interval=10.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(10_000):
            rejections.note("/ from 10.0.0.9: 401 missing signature")
        now[0] = 10.0
        rejections.note("/ from 10.0.0.9: 401 missing signature")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "9999 more since the last line" in lines[1]


def test_a_large_signed_body_is_not_mistaken_for_a_long_head(service):
    # gloo's bootstrap stores values of 154 + 8 N bytes: 33 KB at 4,096 ranks.
    _, srv = service
    value = base64.b64encode(b"x" * 30_000).decode()
    body = p.to_json(p.StoreRequest("good", p.StoreOp.SET, key="round1/big", value=value))
    r = requests.post(srv.url + p.PATH_STORE, data=body, headers=p.sign_request(SECRET, "POST", p.PATH_STORE, body),
                      timeout=10)
    assert r.status_code == 200, r.text
