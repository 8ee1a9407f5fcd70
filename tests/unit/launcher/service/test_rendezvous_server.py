"""launcher/service/rendezvous_server.py: the real HTTP service on 127.0.0.1, port 0, with a real Registry."""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import json
import logging
import re
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import requests

from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.job.state import WorkerState
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.service.rendezvous_server import MAX_BODY, TIMESTAMP_WINDOW, RendezvousServer
from lightning_elastic import protocol as p
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.errors import RendezvousError

pytestmark = pytest.mark.timeout(60)

SECRET = "0123456789abcdef" * 4
TIMEOUT = 10.0  # every HTTP call is bounded


def sign(path: str, body: bytes = b"", secret: str = SECRET, timestamp: int | None = None) -> dict[str, str]:
    """Signing headers for one request; at the given wall-clock ``timestamp`` if one is given."""
    if timestamp is None:
        return p.sign_request(secret, "POST", path, body)
    nonce = secrets.token_hex(16)
    signature = p.request_signature(secret, "POST", path, timestamp, nonce, body)
    return {p.HEADER_PROTOCOL: str(p.PROTOCOL_VERSION), p.HEADER_TIMESTAMP: str(timestamp), p.HEADER_NONCE: nonce,
            p.HEADER_SIGNATURE: signature}


def signed_by_driver(r: requests.Response) -> bool:
    """Is ``r`` signed with the job's secret for the request it answers?"""
    nonce = r.request.headers[p.HEADER_NONCE]
    return p.verify_reply(SECRET, r.status_code, nonce, r.content, r.headers.get(p.HEADER_SIGNATURE))


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[Registry, RendezvousServer]]:
    # One server for the module: each shutdown waits out serve_forever's 0.5 s poll, so a
    # server per test would dominate the suite's runtime. Tests use their own worker ids
    # and count rejections relative to their start.
    reg = Registry()
    srv = RendezvousServer(reg, SECRET)
    srv.start()
    try:
        yield reg, srv
    finally:
        closer = threading.Thread(target=srv.close, daemon=True)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive(), "rendezvous server did not shut down within 10 s"


@pytest.fixture
def registry(service) -> Registry:
    return service[0]


@pytest.fixture
def server(service) -> RendezvousServer:
    return service[1]


_ids = itertools.count()


@pytest.fixture
def w(registry) -> tuple[str, str]:
    """Two fresh live workers of the shared registry."""
    ids = (f"w{next(_ids)}", f"w{next(_ids)}")
    with registry.cond:
        for i, worker_id in enumerate(ids):
            registry.add_worker(worker_id, SlotKey("127.0.0.1", i))
    return ids


@pytest.fixture
def rejected(server) -> Callable[[], int]:
    """Requests the server rejected since the test started."""
    baseline = server.rejected
    return lambda: server.rejected - baseline


def post(server: RendezvousServer, path: str, body, headers: dict[str, str] | None = None) -> requests.Response:
    """POST ``body`` (a message or bytes), signed for ``path`` unless ``headers`` are given."""
    data = body if isinstance(body, bytes) else p.to_json(body)
    if headers is None:
        headers = sign(path, data)
    return requests.post(server.url + path, data=data, headers=headers, timeout=TIMEOUT)


def heartbeat(worker_id: str) -> p.HeartbeatRequest:
    return p.HeartbeatRequest(worker_id, known_generation=0, known_broken_round=0, wait_seconds=0.0)


def form_round(registry: Registry, *worker_ids: str, store_port: int = 1) -> int:
    n = len(worker_ids)
    with registry.cond:
        members = [
            (registry.state.workers[wid], SlotAssignment(registry.state.workers[wid].slot, i, n, n, 0, 1))
            for i, wid in enumerate(worker_ids)
        ]
        return registry.form_round(members, ("127.0.0.1", store_port)).number


# ----- accepted ------------------------------------------------------------------------


def test_url_is_loopback_with_a_real_port(server):
    parts = urlsplit(server.url)
    assert parts.scheme == "http" and parts.hostname == "127.0.0.1" and parts.port > 0


def test_valid_heartbeat_is_answered(server, registry, w, rejected):
    with registry.cond:
        known = registry.state.generation
        registry.bump_generation()
    r = post(server, p.PATH_HEARTBEAT, p.HeartbeatRequest(w[0], known, 0, 0.0))
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/json"
    assert signed_by_driver(r)
    assert p.decode(p.HeartbeatReply, r.content).generation == known + 1
    assert registry.state.workers[w[0]].last_heartbeat is not None
    assert rejected() == 0


def test_valid_report_reaches_the_registry(server, registry, w):
    report = p.Report(w[1], 1, p.Outcome.DONE, "ok")
    r = post(server, p.PATH_REPORT, report)
    assert r.status_code == 200
    assert p.decode(p.Ack, r.content) == p.Ack(True)
    assert registry.state.workers[w[1]].report == report


def test_round_lost_is_answered(server, registry, w):
    number = form_round(registry, *w)
    with registry.cond:
        registry.mark_round_broken(number)
    r = post(server, p.PATH_ROUND_LOST, p.RoundLostRequest(w[0], number, 5.0))
    assert r.status_code == 200
    assert p.decode(p.RoundLostReply, r.content) == p.RoundLostReply(True)


def test_rendezvous_is_answered_with_the_assignment_once_the_round_forms(server, registry, w):
    record = registry.state.workers[w[0]]
    result: dict = {}

    def ask() -> None:
        result["response"] = post(server, p.PATH_RENDEZVOUS, p.RendezvousRequest(w[0], 0))

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    with registry.cond:
        assert registry.cond.wait_for(lambda: record.state == WorkerState.WAITING, TIMEOUT)
    form_round(registry, w[0], store_port=4242)
    asker.join(TIMEOUT)
    assert not asker.is_alive()
    r = result["response"]
    assert r.status_code == 200
    reply = p.decode(p.RendezvousReply, r.content)
    assert reply.status == p.RendezvousStatus.ASSIGNED
    assert reply.assignment == record.assignment and reply.assignment.store_port == 4242


def test_leaving_worker_is_told_to_exit_over_http(server, registry, w):
    registry.state.workers[w[0]].leave = True
    r = post(server, p.PATH_RENDEZVOUS, p.RendezvousRequest(w[0], 0))
    assert r.status_code == 200
    assert p.decode(p.RendezvousReply, r.content).status == p.RendezvousStatus.EXIT


# ----- authentication ------------------------------------------------------------------


def _without(header: str) -> Callable[[str, bytes], dict[str, str]]:
    def headers(path: str, body: bytes) -> dict[str, str]:
        signed = sign(path, body)
        del signed[header]
        return signed
    return headers


@pytest.mark.parametrize(
    "make_headers",
    [
        lambda path, body: {},
        _without(p.HEADER_TIMESTAMP),
        _without(p.HEADER_NONCE),
        _without(p.HEADER_SIGNATURE),
        lambda path, body: {**sign(path, body), p.HEADER_NONCE: "not-hex"},
        lambda path, body: {"Authorization": f"Bearer {SECRET}"},  # the old scheme: no longer accepted
    ],
    ids=["none", "no-timestamp", "no-nonce", "no-signature", "malformed-nonce", "bearer-secret"],
)
def test_missing_or_malformed_signature_headers_are_401(server, registry, w, rejected, make_headers):
    body = p.to_json(p.Report(w[0], 1, p.Outcome.DONE))
    r = post(server, p.PATH_REPORT, body, headers=make_headers(p.PATH_REPORT, body))
    assert r.status_code == 401
    assert p.decode(p.ErrorReply, r.content).error == "missing or malformed signature headers"
    assert p.HEADER_SIGNATURE not in r.headers  # no verified nonce to sign the reply for
    assert registry.state.workers[w[0]].report is None
    assert rejected() == 1


def _tampered(what: str, worker_id: str) -> tuple[str, bytes, dict[str, str]]:
    """(path, body, headers) of a report whose signature does not match what is sent."""
    path, body = p.PATH_REPORT, p.to_json(p.Report(worker_id, 1, p.Outcome.DONE))
    if what == "wrong-secret":
        return path, body, sign(path, body, secret="f" * 64)
    if what == "body":
        return path, body, sign(path, p.to_json(p.Report(worker_id, 1, p.Outcome.FAILED)))
    if what == "path":
        return path, body, sign(p.PATH_HEARTBEAT, body)
    headers = sign(path, body)
    if what == "timestamp":
        headers[p.HEADER_TIMESTAMP] = str(int(headers[p.HEADER_TIMESTAMP]) - 1)
    elif what == "nonce":
        headers[p.HEADER_NONCE] = "%032x" % (int(headers[p.HEADER_NONCE], 16) ^ 1)
    else:
        headers[p.HEADER_SIGNATURE] = "%064x" % (int(headers[p.HEADER_SIGNATURE], 16) ^ 1)
    return path, body, headers


@pytest.mark.parametrize("what", ["wrong-secret", "body", "path", "timestamp", "nonce", "signature"])
def test_bad_signature_is_401_unsigned_and_never_reaches_the_registry(server, registry, w, rejected, what):
    path, body, headers = _tampered(what, w[0])
    r = post(server, path, body, headers=headers)
    assert r.status_code == 401
    assert p.decode(p.ErrorReply, r.content).error == "bad signature (wrong job secret?)"
    assert p.HEADER_SIGNATURE not in r.headers
    assert registry.state.workers[w[0]].report is None
    assert rejected() == 1


def test_signed_report_is_accepted_and_its_reply_signed(server, registry, w, rejected):
    # The control for the tests above: the same request, correctly signed, goes through.
    report = p.Report(w[0], 1, p.Outcome.DONE)
    r = post(server, p.PATH_REPORT, report)
    assert r.status_code == 200 and signed_by_driver(r)
    assert registry.state.workers[w[0]].report == report
    assert rejected() == 0


def test_replayed_request_is_401_and_counted(server, registry, w, rejected):
    body = p.to_json(p.Report(w[0], 1, p.Outcome.DONE))
    headers = sign(p.PATH_REPORT, body)
    assert post(server, p.PATH_REPORT, body, headers=headers).status_code == 200
    with registry.cond:
        registry.state.workers[w[0]].report = None
    replay = post(server, p.PATH_REPORT, body, headers=headers)
    assert replay.status_code == 401
    assert p.decode(p.ErrorReply, replay.content).error == "replayed request (nonce already seen)"
    assert registry.state.workers[w[0]].report is None
    assert rejected() == 1
    # The same message signed afresh (as the client does when it retries) is accepted.
    assert post(server, p.PATH_REPORT, body).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [("/v1/nope", b"{}", 404), (p.PATH_HEARTBEAT, b"{}", 400), (p.PATH_HEARTBEAT, None, 409)],
    ids=["404", "400", "409"],
)
def test_refusal_of_an_authenticated_request_is_signed(server, path, body, status):
    r = post(server, path, heartbeat("ghost") if body is None else body)
    assert r.status_code == status
    assert signed_by_driver(r)


# ----- timestamps and replays, on a server with a settable wall clock ------------------


class WallClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self.elapsed = 0.0  # monotonic: only time passing moves it

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.elapsed

    def pass_time(self, seconds: float) -> None:
        self.now += seconds
        self.elapsed += seconds


@pytest.fixture(scope="module")
def clocked_service() -> Iterator[tuple[Registry, RendezvousServer, WallClock]]:
    clock = WallClock()
    reg = Registry()
    with reg.cond:
        reg.add_worker("cw", SlotKey("127.0.0.1", 0))
    # The wall clock moved by hand; the monotonic one follows it forward only (as time
    # passing does), never back (as a step of the wall clock does not move it).
    srv = RendezvousServer(reg, SECRET, wall_clock=clock, clock=clock.monotonic)
    srv.start()
    try:
        yield reg, srv, clock
    finally:
        closer = threading.Thread(target=srv.close, daemon=True)
        closer.start()
        closer.join(timeout=10)


@pytest.fixture
def clocked(clocked_service) -> tuple[RendezvousServer, WallClock, Callable[[], int]]:
    """The clocked server, its clock moved a day past anything an earlier test used, and a
    count of its rejections since the test started."""
    _, srv, clock = clocked_service
    clock.pass_time(86_400)
    baseline = srv.rejected
    return srv, clock, lambda: srv.rejected - baseline


def _clocked_heartbeat(srv: RendezvousServer, timestamp: float, headers: dict[str, str] | None = None):
    body = p.to_json(heartbeat("cw"))
    headers = headers or sign(p.PATH_HEARTBEAT, body, timestamp=int(timestamp))
    return post(srv, p.PATH_HEARTBEAT, body, headers=headers), headers


@pytest.mark.parametrize("offset", [-TIMESTAMP_WINDOW, 0, TIMESTAMP_WINDOW])
def test_timestamp_within_the_window_is_accepted(clocked, offset):
    srv, clock, rejected = clocked
    r, _ = _clocked_heartbeat(srv, clock.now + offset)
    assert r.status_code == 200
    assert rejected() == 0


@pytest.mark.parametrize("offset", [-TIMESTAMP_WINDOW - 1, TIMESTAMP_WINDOW + 1, -10 * 86_400],
                         ids=["stale", "future", "old"])
def test_timestamp_outside_the_window_is_401_signed_and_counted(clocked, offset):
    srv, clock, rejected = clocked
    r, _ = _clocked_heartbeat(srv, clock.now + offset)
    assert r.status_code == 401
    assert p.decode(p.ErrorReply, r.content).error.startswith("timestamp outside 300 s of the driver's clock")
    # Signed: the request is genuine, so its sender can trust the reason (its clock is off).
    assert signed_by_driver(r)
    assert rejected() == 1


def test_senders_are_forgotten_after_twice_the_window(clocked):
    srv, clock, _ = clocked
    start = clock.now
    for _ in range(3):  # one-off senders (no NonceSequence): one entry each
        assert _clocked_heartbeat(srv, start)[0].status_code == 200
    assert len(srv._replays) >= 3
    clock.pass_time(2 * TIMESTAMP_WINDOW + 1)
    assert _clocked_heartbeat(srv, clock.now)[0].status_code == 200
    assert len(srv._replays) == 1  # only the newest remains


def test_a_replay_is_refused_however_the_wall_clock_steps(clocked):
    srv, clock, rejected = clocked
    start = clock.now
    first, headers = _clocked_heartbeat(srv, start)
    assert first.status_code == 200
    for step in (TIMESTAMP_WINDOW + 1, -TIMESTAMP_WINDOW - 1, 0):  # NTP steps: the nonce is still known
        clock.now = start + step
        replay, _ = _clocked_heartbeat(srv, start, headers=headers)
        assert replay.status_code == 401
    assert rejected() == 3


@pytest.mark.parametrize("step", [600.0, -600.0], ids=["forward", "back"])
def test_a_driver_clock_step_and_its_correction_lock_nobody_out(clocked, step):
    srv, clock, rejected = clocked
    start = clock.now
    clock.now = start + step  # one request served while the clock was wrong
    assert _clocked_heartbeat(srv, clock.now)[0].status_code == 200
    clock.now = start  # corrected: the workers' correctly stamped requests pass again
    for _ in range(3):
        clock.pass_time(1.0)
        assert _clocked_heartbeat(srv, clock.now)[0].status_code == 200
    assert rejected() == 0


# ----- the client: signs its requests, checks the replies -------------------------------


def test_client_requests_are_accepted_and_replies_verified(server, registry, w, rejected):
    client = DriverClient(server.url, SECRET, w[0])
    try:
        assert client.heartbeat(registry.state.generation, 0, 0.0).generation == registry.state.generation
        client.report(1, p.Outcome.DONE, "fine")
    finally:
        client.close()
    assert registry.state.workers[w[0]].report == p.Report(w[0], 1, p.Outcome.DONE, "fine")
    assert rejected() == 0


def test_client_with_the_wrong_secret_is_refused(server, registry, w, rejected):
    client = DriverClient(server.url, "f" * 64, w[0])
    try:
        with pytest.raises(RendezvousError, match=r"failed authentication: unsigned reply with status 401 .*wrong job secret"):
            client.report(1, p.Outcome.DONE)
    finally:
        client.close()
    assert registry.state.workers[w[0]].report is None
    assert rejected() == 1


class FakeDriver:
    """A raw-socket stand-in for the driver, one connection per answer.

    Records the exact bytes of every request and answers each with
    ``answer(headers, body)`` -> (status, reply body, signature header or None), or None
    to close the connection without a reply. Replies say protocol ``version`` (None: none).
    """

    def __init__(self, *answers: Callable[[dict[str, str], bytes], tuple[int, bytes, str | None] | None],
                 version: str | None = str(p.PROTOCOL_VERSION)) -> None:
        self._version = version
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(TIMEOUT)
        self.url = "http://127.0.0.1:%d" % self._sock.getsockname()[1]
        self.received: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self._thread = threading.Thread(target=self._serve, args=(answers,), daemon=True)
        self._thread.start()

    def _serve(self, answers) -> None:
        for answer in answers:
            conn, _ = self._sock.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    assert chunk, "the client closed the connection before its request was complete"
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:]
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
                while len(body) < int(headers.get("content-length", "0")):
                    body += conn.recv(65536)
                self.received.append(data[: len(head) + 4] + body)
                self.headers.append(headers)
                result = answer(headers, body)
                if result is None:
                    continue
                status, reply, signature = result
                extra = f"{p.HEADER_SIGNATURE}: {signature}\r\n" if signature is not None else ""
                if self._version is not None:
                    extra += f"{p.HEADER_PROTOCOL}: {self._version}\r\n"
                conn.sendall(
                    f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(reply)}\r\n"
                    f"Connection: close\r\n{extra}\r\n".encode() + reply
                )

    def close(self) -> None:
        self._thread.join(TIMEOUT)
        self._sock.close()
        assert not self._thread.is_alive(), "the fake driver did not get all the requests it expected"


ACK = p.to_json(p.Ack())


def _good(headers: dict[str, str], body: bytes) -> tuple[int, bytes, str]:
    return 200, ACK, p.sign_reply(SECRET, 200, headers[p.HEADER_NONCE.lower()], ACK)


def _ask(driver: FakeDriver) -> None:
    client = DriverClient(driver.url, SECRET, "w")
    try:
        client.report(1, p.Outcome.DONE)
    finally:
        client.close()
        driver.close()


def test_client_accepts_a_reply_signed_for_its_request():
    _ask(FakeDriver(_good))  # the control for the tampered replies below


@pytest.mark.parametrize("version", [None, "1", "2", "3", "4", "5", "7"])
def test_client_refuses_a_driver_of_another_protocol_version_saying_so(version):
    said = "an older protocol (no version)" if version is None else f"protocol version {version}"
    with pytest.raises(RendezvousError, match=rf"the driver speaks {re.escape(said)} and the worker version "
                                              rf"{p.PROTOCOL_VERSION}: install the same lightning-elastic version"):
        _ask(FakeDriver(_good, version=version))


@pytest.mark.parametrize("version", [None, "1", "2", "3", "4", "5", "7"])
def test_driver_refuses_a_worker_of_another_protocol_version_saying_so(server, w, rejected, version):
    body = p.to_json(heartbeat(w[0]))
    headers = sign(p.PATH_HEARTBEAT, body)
    if version is None:
        del headers[p.HEADER_PROTOCOL]
    else:
        headers[p.HEADER_PROTOCOL] = version
    r = requests.post(server.url + p.PATH_HEARTBEAT, data=body, headers=headers, timeout=TIMEOUT)
    said = "an older protocol (no version)" if version is None else f"protocol version {version}"
    assert r.status_code == 400 and r.headers[p.HEADER_PROTOCOL] == str(p.PROTOCOL_VERSION)
    assert p.decode(p.ErrorReply, r.content).error == (
        f"the worker speaks {said} and the driver version {p.PROTOCOL_VERSION}: "
        "install the same lightning-elastic version for the driver and on every host")
    assert rejected() == 1


@pytest.mark.parametrize(
    "answer",
    [
        lambda h, b: (200, ACK, None),
        lambda h, b: (200, ACK, p.sign_reply("f" * 64, 200, h[p.HEADER_NONCE.lower()], ACK)),
        lambda h, b: (200, ACK, p.sign_reply(SECRET, 200, secrets.token_hex(16), ACK)),
        lambda h, b: (200, p.to_json(p.Ack(False)), p.sign_reply(SECRET, 200, h[p.HEADER_NONCE.lower()], ACK)),
        lambda h, b: (200, ACK, p.sign_reply(SECRET, 409, h[p.HEADER_NONCE.lower()], ACK)),
        lambda h, b: (200, ACK, "0" * 64),
    ],
    ids=["unsigned", "wrong-secret", "other-request", "tampered-body", "tampered-status", "garbage"],
)
def test_client_refuses_a_reply_not_signed_for_its_request(answer):
    with pytest.raises(RendezvousError, match=r"^reply from the driver at http://127\.0\.0\.1:\d+ failed authentication: "):
        _ask(FakeDriver(answer))


def test_unsigned_409_cannot_stop_a_workers_heartbeats():
    # The heartbeat thread ends on "(409)" in the error; a spoofer must not trigger that.
    driver = FakeDriver(lambda h, b: (409, p.to_json(p.ErrorReply("(409)")), None))
    client = DriverClient(driver.url, SECRET, "w")
    try:
        with pytest.raises(RendezvousError) as info:
            client.heartbeat(0, 0, 0.0)
    finally:
        client.close()
        driver.close()
    assert "(409)" not in str(info.value) and "failed authentication" in str(info.value)


def test_client_never_sends_the_secret_and_signs_what_it_sends():
    driver = FakeDriver(lambda h, b: (200, p.to_json(p.HeartbeatReply(0, 0)),
                                      p.sign_reply(SECRET, 200, h[p.HEADER_NONCE.lower()],
                                                   p.to_json(p.HeartbeatReply(0, 0)))))
    client = DriverClient(driver.url, SECRET, "w")
    try:
        client.heartbeat(5, 3, 0.0)
    finally:
        client.close()
        driver.close()
    (raw,) = driver.received
    assert SECRET.encode() not in raw and SECRET.upper().encode() not in raw
    assert b"Authorization" not in raw
    headers, body = driver.headers[0], raw.partition(b"\r\n\r\n")[2]
    assert p.decode(p.HeartbeatRequest, body) == p.HeartbeatRequest("w", 5, 3, 0.0)
    auth = p.parse_request_auth({k: headers[k.lower()] for k in (p.HEADER_TIMESTAMP, p.HEADER_NONCE, p.HEADER_SIGNATURE)})
    assert auth is not None and p.verify_request(SECRET, "POST", p.PATH_HEARTBEAT, auth, body)


def test_client_signs_every_attempt_afresh():
    driver = FakeDriver(lambda h, b: None, _good)  # the first connection closes unanswered: the client retries
    _ask(driver)
    first, second = (h[p.HEADER_NONCE.lower()] for h in driver.headers)
    assert first != second


# ----- routing and form ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/rendezvous/", "/v2/heartbeat", "/v1/heartbeat?x=1"])
def test_unknown_path_is_404(server, w, rejected, path):
    r = post(server, path, heartbeat(w[0]))
    assert r.status_code == 404
    assert p.decode(p.ErrorReply, r.content).error == f"no such path {path}"
    assert rejected() == 1


def test_get_is_not_supported(server):
    r = requests.get(server.url + p.PATH_HEARTBEAT, headers=sign(p.PATH_HEARTBEAT), timeout=TIMEOUT)
    assert r.status_code == 501


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "HeartbeatRequest: body is not valid JSON"),
        (b"", "HeartbeatRequest: body is not valid JSON"),
        (b"[1, 2]", "HeartbeatRequest: expected a JSON object, got list"),
        (b'{"worker_id": "w", "known_generation": 0, "known_broken_round": 0}',
         "HeartbeatRequest: missing field 'wait_seconds'"),
        (b'{"worker_id": "w", "known_generation": "0", "known_broken_round": 0, "wait_seconds": 0}',
         "HeartbeatRequest.known_generation: expected int, got str"),
        (b'{"worker_id": "w", "known_generation": 0, "known_broken_round": 0, "wait_seconds": 0, "admin": true}',
         "HeartbeatRequest: unknown field(s) admin"),
    ],
)
def test_malformed_body_is_400_naming_the_problem(server, rejected, body, error):
    r = post(server, p.PATH_HEARTBEAT, body)
    assert r.status_code == 400
    assert p.decode(p.ErrorReply, r.content).error.startswith(error)
    assert rejected() == 1


def test_body_for_another_message_type_is_400(server, w):
    r = post(server, p.PATH_REPORT, heartbeat(w[0]))
    assert r.status_code == 400
    assert "Report: unknown field(s)" in p.decode(p.ErrorReply, r.content).error


def test_oversized_body_is_rejected_unread(server, registry, w, rejected):
    body = b"x" * (MAX_BODY + 1)
    r = post(server, p.PATH_REPORT, body)
    assert r.status_code == 400
    assert p.decode(p.ErrorReply, r.content).error == f"Content-Length must be 0..{MAX_BODY}"
    assert p.HEADER_SIGNATURE not in r.headers  # the signature was never checked: the body is unread
    assert rejected() == 1


def test_body_of_max_size_is_read_and_decoded(server, registry, w):
    payload = json.dumps({"worker_id": w[0], "round": 1, "outcome": "done", "message": ""}).encode()
    body = payload[:-1] + b" " * (MAX_BODY - len(payload)) + b"}"
    assert len(body) == MAX_BODY
    r = post(server, p.PATH_REPORT, body)
    assert r.status_code == 200
    assert registry.state.workers[w[0]].report == p.Report(w[0], 1, p.Outcome.DONE)


def _raw_post(server: RendezvousServer, headers: dict[str, str], body: bytes = b"") -> int:
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
    try:
        conn.putrequest("POST", p.PATH_HEARTBEAT, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.mark.parametrize("length", ["-1", "abc", str(MAX_BODY + 1)])
def test_bad_content_length_header_is_400(server, rejected, length):
    assert _raw_post(server, {**sign(p.PATH_HEARTBEAT), "Content-Length": length}) == 400
    assert rejected() == 1


def test_missing_content_length_is_an_empty_body(server):
    assert _raw_post(server, sign(p.PATH_HEARTBEAT)) == 400  # signed, but b"" is not a HeartbeatRequest


def test_unknown_worker_is_409(server):
    r = post(server, p.PATH_HEARTBEAT, heartbeat("ghost"))
    assert r.status_code == 409
    assert "'ghost'" in p.decode(p.ErrorReply, r.content).error


def test_finished_worker_is_409(server, registry, w):
    with registry.cond:
        registry.state.workers[w[0]].state = WorkerState.DONE
    assert post(server, p.PATH_REPORT, p.Report(w[0], 1, p.Outcome.DONE)).status_code == 409


def test_a_heartbeat_answered_after_its_worker_finished_is_no_rejection_nor_warning(caplog):
    # The worker's last heartbeat crossed its exit: routine at the end of every job. A fresh
    # server: the shared one may be inside its rejection log's quiet interval.
    registry = Registry()
    with registry.cond:
        registry.add_worker("done#0", SlotKey("127.0.0.1", 0)).state = WorkerState.DONE
    srv = RendezvousServer(registry, SECRET)
    srv.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="lightning_elastic"):
            r = post(srv, p.PATH_HEARTBEAT, heartbeat("done#0"))
        assert r.status_code == 409 and signed_by_driver(r)
        assert srv.rejected == 0 and srv.late_requests == 1
        assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
        # A worker the driver never knew is still a rejection, said at once.
        with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
            assert post(srv, p.PATH_HEARTBEAT, heartbeat("ghost")).status_code == 409
        assert srv.rejected == 1
        assert any("'ghost'" in rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING)
    finally:
        srv.close()


def test_rejections_are_counted_and_successes_are_not(server, w, rejected):
    post(server, p.PATH_HEARTBEAT, heartbeat(w[0]))
    post(server, p.PATH_HEARTBEAT, heartbeat(w[0]), headers={})
    post(server, "/nope", heartbeat(w[0]))
    post(server, p.PATH_HEARTBEAT, b"{}")
    post(server, p.PATH_HEARTBEAT, heartbeat("ghost"))
    assert rejected() == 4


def test_server_stops_listening_after_close():
    srv = RendezvousServer(Registry(), SECRET)
    srv.start()
    url = srv.url
    srv.close()
    with pytest.raises(requests.ConnectionError):
        body = p.to_json(heartbeat("w"))
        requests.post(url + p.PATH_HEARTBEAT, data=body, headers=sign(p.PATH_HEARTBEAT, body), timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("path", "headers"),
    [("/v1/nope", SECRET), (p.PATH_HEARTBEAT, None), (p.PATH_HEARTBEAT, "f" * 64)],
    ids=["after-404", "after-401-unsigned", "after-401-bad-signature"],
)
def test_rejected_request_does_not_spoil_the_next_one_on_the_connection(server, w, path, headers):
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
    body = p.to_json(heartbeat(w[0]))
    headers = {} if headers is None else sign(path, body, secret=headers)  # the secret to sign with
    try:
        conn.request("POST", path, body=body, headers=headers)
        first = conn.getresponse()
        first.read()
        assert first.status in (401, 404)
        conn.request("POST", p.PATH_HEARTBEAT, body=body, headers=sign(p.PATH_HEARTBEAT, body))  # same connection
        second = conn.getresponse()
        second.read()
        assert second.status == 200
    finally:
        conn.close()


@pytest.mark.parametrize(
    "headers",
    [{"Content-Length": str(MAX_BODY + 1)}, {"Content-Length": "abc"}, {"Transfer-Encoding": "chunked"}],
    ids=["too-large", "not-a-number", "chunked"],
)
def test_body_of_unknown_length_is_left_unread_and_the_connection_closed(server, w, headers):
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
    try:
        conn.putrequest("POST", p.PATH_HEARTBEAT, skip_accept_encoding=True)
        for name, value in {**sign(p.PATH_HEARTBEAT, b"{}"), **headers}.items():
            conn.putheader(name, value)
        conn.endheaders(b"{}")
        first = conn.getresponse()
        first.read()
        assert first.status == 400 and first.getheader("Connection") == "close"
        # http.client opens a new connection for the next request, which is answered.
        body = p.to_json(heartbeat(w[0]))
        conn.request("POST", p.PATH_HEARTBEAT, body=body, headers=sign(p.PATH_HEARTBEAT, body))
        second = conn.getresponse()
        second.read()
        assert second.status == 200
    finally:
        conn.close()


def test_the_listen_queue_holds_every_connection_of_the_fleet(monkeypatch, tmp_path):
    from lightning_elastic.launcher.service import rendezvous_server

    somaxconn = tmp_path / "somaxconn"
    somaxconn.write_text("65535\n")
    monkeypatch.setattr(rendezvous_server, "SOMAXCONN", somaxconn)
    assert rendezvous_server.listen_queue_for(8) == 1024  # a small job keeps the floor
    assert rendezvous_server.listen_queue_for(4096) == 3 * 4096 + 64


def test_the_kernel_cap_on_the_listen_queue_is_said_once_and_applied(monkeypatch, tmp_path, caplog):
    from lightning_elastic.launcher.service import rendezvous_server

    somaxconn = tmp_path / "somaxconn"
    somaxconn.write_text("4096\n")
    monkeypatch.setattr(rendezvous_server, "SOMAXCONN", somaxconn)
    with caplog.at_level("WARNING"):
        assert rendezvous_server.listen_queue_for(4096) == 4096
    assert "sysctl -w net.core.somaxconn=12352" in caplog.text


def test_the_server_listens_with_the_queue_it_was_given():
    srv = RendezvousServer(Registry(), SECRET, listen_queue=3000)
    srv.start()
    try:
        # ss shows a listening socket's queue size as its Send-Q (the kernel caps it at somaxconn).
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{srv.port}"], capture_output=True, text=True,
                                   timeout=30).stdout.split()
        cap = int(open("/proc/sys/net/core/somaxconn").read())
        assert listening[2] == str(min(3000, cap)), listening
    finally:
        srv.close()


def test_a_failure_of_the_service_itself_is_a_500_on_that_connection_only(server, w, monkeypatch, caplog):
    def broken(report: p.Report) -> p.Ack:
        raise RuntimeError("a bug")

    monkeypatch.setitem(server._routes, p.PATH_REPORT, (p.Report, broken))
    with caplog.at_level("ERROR"):
        r = post(server, p.PATH_REPORT, p.Report(w[0], 1, p.Outcome.DONE))
    assert r.status_code == 500 and r.headers["Connection"] == "close"
    assert "RuntimeError: a bug" in caplog.text
    assert post(server, p.PATH_HEARTBEAT, heartbeat(w[0])).status_code == 200  # the service goes on


def test_pending_long_polls_hold_no_server_thread_each(registry, server):
    ids = [f"lp{next(_ids)}" for _ in range(50)]
    with registry.cond:
        for i, worker_id in enumerate(ids):
            registry.add_worker(worker_id, SlotKey("10.0.0.1", i))
        known = (registry.state.generation, max(registry.state.broken_rounds, default=0))  # so that the polls wait
    threads_before = threading.active_count()
    sessions = [requests.Session() for _ in range(50)]
    results: list[int] = []

    def long_poll(i: int) -> None:
        body = p.to_json(p.HeartbeatRequest(ids[i], known[0], known[1], wait_seconds=5.0))
        r = sessions[i % 50].post(server.url + p.PATH_HEARTBEAT, data=body, headers=sign(p.PATH_HEARTBEAT, body),
                                  timeout=TIMEOUT)
        results.append(r.status_code)

    # 50 client threads, each waiting on one long poll at a time: the server side holds them
    # all on its one loop thread.
    pollers = [threading.Thread(target=long_poll, args=(i,)) for i in range(50)]
    for t in pollers:
        t.start()
    deadline = time.monotonic() + TIMEOUT
    while sum(registry.state.workers[i].wake.waiting for i in ids) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(registry.state.workers[i].wake.waiting for i in ids) == 50, "the polls did not all wait"
    assert threading.active_count() - threads_before <= 50  # the clients' only: no server thread per poll
    with registry.cond:
        registry.bump_generation()  # answers every pending poll at once
    for t in pollers:
        t.join(TIMEOUT)
    assert results == [200] * 50


def test_a_request_sent_while_the_server_only_listens_is_answered_once_it_serves():
    """An adopting driver listens before it restores the job: a worker's request meanwhile
    waits in the kernel's queue (its connect succeeds), and is answered once served."""
    reg = Registry()
    with reg.cond:
        reg.add_worker("early", SlotKey("h", 0))
    srv = RendezvousServer(reg, SECRET)
    srv.listen()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(post, srv, p.PATH_HEARTBEAT, heartbeat("early"))
        time.sleep(0.2)  # the request is sent and waits: nothing serves it yet
        assert not sent.done() and reg.state.workers["early"].last_heartbeat is None
        srv.start()
        try:
            assert sent.result(timeout=TIMEOUT).status_code == 200
        finally:
            srv.close()


def test_a_server_that_only_listened_closes_its_socket():
    srv = RendezvousServer(Registry(), SECRET)
    srv.listen()
    port = srv.port
    srv.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
