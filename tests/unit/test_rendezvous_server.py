"""launcher/rendezvous_server.py: the real HTTP service on 127.0.0.1, port 0, with a real Registry."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import requests

from launcher.hosts import SlotAssignment, SlotKey
from launcher.registry import Registry, WorkerState
from launcher.rendezvous_server import MAX_BODY, RendezvousServer
from lightning_elastic import protocol as p

pytestmark = pytest.mark.timeout(60)

SECRET = "0123456789abcdef" * 4
AUTH = {p.AUTH_HEADER: f"{p.AUTH_SCHEME} {SECRET}"}
TIMEOUT = 10.0  # every HTTP call is bounded


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


def post(server: RendezvousServer, path: str, body, headers=AUTH) -> requests.Response:
    data = p.to_json(body) if not isinstance(body, (bytes, str)) else body
    return requests.post(server.url + path, data=data, headers=headers, timeout=TIMEOUT)


def heartbeat(worker_id: str) -> p.HeartbeatRequest:
    return p.HeartbeatRequest(worker_id, known_generation=0, wait_seconds=0.0)


def form_round(registry: Registry, *worker_ids: str, store_port: int = 1) -> int:
    n = len(worker_ids)
    with registry.cond:
        members = [
            (registry.workers[wid], SlotAssignment(registry.workers[wid].slot, i, n, n, 0, 1))
            for i, wid in enumerate(worker_ids)
        ]
        return registry.form_round(members, ("127.0.0.1", store_port)).number


# ----- accepted ------------------------------------------------------------------------


def test_url_is_loopback_with_a_real_port(server):
    parts = urlsplit(server.url)
    assert parts.scheme == "http" and parts.hostname == "127.0.0.1" and parts.port > 0


def test_valid_heartbeat_is_answered(server, registry, w, rejected):
    with registry.cond:
        known = registry.generation
        registry.bump_generation()
    r = post(server, p.PATH_HEARTBEAT, p.HeartbeatRequest(w[0], known, 0.0))
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/json"
    assert p.decode(p.HeartbeatReply, r.content).generation == known + 1
    assert registry.workers[w[0]].last_heartbeat is not None
    assert rejected() == 0


def test_valid_report_reaches_the_registry(server, registry, w):
    report = p.Report(w[1], 1, p.Outcome.DONE, "ok")
    r = post(server, p.PATH_REPORT, report)
    assert r.status_code == 200
    assert p.decode(p.Ack, r.content) == p.Ack(True)
    assert registry.workers[w[1]].report == report


def test_round_lost_is_answered(server, registry, w):
    number = form_round(registry, *w)
    with registry.cond:
        registry.mark_round_broken(number)
    r = post(server, p.PATH_ROUND_LOST, p.RoundLostRequest(w[0], number, 5.0))
    assert r.status_code == 200
    assert p.decode(p.RoundLostReply, r.content) == p.RoundLostReply(True)


def test_rendezvous_is_answered_with_the_assignment_once_the_round_forms(server, registry, w):
    record = registry.workers[w[0]]
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
    registry.workers[w[0]].leave = True
    r = post(server, p.PATH_RENDEZVOUS, p.RendezvousRequest(w[0], 0))
    assert r.status_code == 200
    assert p.decode(p.RendezvousReply, r.content).status == p.RendezvousStatus.EXIT


# ----- authentication ------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {p.AUTH_HEADER: f"{p.AUTH_SCHEME} wrong"},
        {p.AUTH_HEADER: f"{p.AUTH_SCHEME} {SECRET}x"},
        {p.AUTH_HEADER: f"{p.AUTH_SCHEME} {SECRET[:-1]}"},
        {p.AUTH_HEADER: f"Basic {SECRET}"},
        {p.AUTH_HEADER: f"{p.AUTH_SCHEME}"},
        {p.AUTH_HEADER: SECRET},
    ],
    ids=["missing", "wrong", "longer", "shorter", "basic-scheme", "no-token", "no-scheme"],
)
def test_missing_or_wrong_secret_is_401_and_never_reaches_the_registry(server, registry, w, rejected, headers):
    r = post(server, p.PATH_REPORT, p.Report(w[0], 1, p.Outcome.DONE), headers=headers)
    assert r.status_code == 401
    assert p.decode(p.ErrorReply, r.content).error == "missing or wrong job secret"
    assert registry.workers[w[0]].report is None
    assert rejected() == 1


# ----- routing and form ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/rendezvous/", "/v2/heartbeat", "/v1/heartbeat?x=1"])
def test_unknown_path_is_404(server, w, rejected, path):
    r = post(server, path, heartbeat(w[0]))
    assert r.status_code == 404
    assert p.decode(p.ErrorReply, r.content).error == f"no such path {path}"
    assert rejected() == 1


def test_get_is_not_supported(server):
    r = requests.get(server.url + p.PATH_HEARTBEAT, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 501


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "HeartbeatRequest: body is not valid JSON"),
        (b"", "HeartbeatRequest: body is not valid JSON"),
        (b"[1, 2]", "HeartbeatRequest: expected a JSON object, got list"),
        (b'{"worker_id": "w", "known_generation": 0}', "HeartbeatRequest: missing field 'wait_seconds'"),
        (b'{"worker_id": "w", "known_generation": "0", "wait_seconds": 0}',
         "HeartbeatRequest.known_generation: expected int, got str"),
        (b'{"worker_id": "w", "known_generation": 0, "wait_seconds": 0, "admin": true}',
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
    assert rejected() == 1


def test_body_of_max_size_is_read_and_decoded(server, registry, w):
    payload = json.dumps({"worker_id": w[0], "round": 1, "outcome": "done", "message": ""}).encode()
    body = payload[:-1] + b" " * (MAX_BODY - len(payload)) + b"}"
    assert len(body) == MAX_BODY
    r = post(server, p.PATH_REPORT, body)
    assert r.status_code == 200
    assert registry.workers[w[0]].report == p.Report(w[0], 1, p.Outcome.DONE)


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
    assert _raw_post(server, {**AUTH, "Content-Length": length}) == 400
    assert rejected() == 1


def test_missing_content_length_is_an_empty_body(server):
    assert _raw_post(server, AUTH) == 400


def test_unknown_worker_is_409(server):
    r = post(server, p.PATH_HEARTBEAT, heartbeat("ghost"))
    assert r.status_code == 409
    assert "'ghost'" in p.decode(p.ErrorReply, r.content).error


def test_finished_worker_is_409(server, registry, w):
    with registry.cond:
        registry.workers[w[0]].state = WorkerState.DONE
    assert post(server, p.PATH_REPORT, p.Report(w[0], 1, p.Outcome.DONE)).status_code == 409


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
        requests.post(url + p.PATH_HEARTBEAT, data=p.to_json(heartbeat("w")), headers=AUTH, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("path", "headers"),
    [("/v1/nope", AUTH), (p.PATH_HEARTBEAT, {p.AUTH_HEADER: "Bearer wrong"})],
    ids=["after-404", "after-401"],
)
def test_rejected_request_does_not_spoil_the_next_one_on_the_connection(server, w, path, headers):
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
    body = p.to_json(heartbeat(w[0]))
    try:
        conn.request("POST", path, body=body, headers=headers)
        first = conn.getresponse()
        first.read()
        assert first.status in (401, 404)
        conn.request("POST", p.PATH_HEARTBEAT, body=body, headers=AUTH)  # same connection
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
        for name, value in {**AUTH, **headers}.items():
            conn.putheader(name, value)
        conn.endheaders(b"{}")
        first = conn.getresponse()
        first.read()
        assert first.status == 400 and first.getheader("Connection") == "close"
        # http.client opens a new connection for the next request, which is answered.
        conn.request("POST", p.PATH_HEARTBEAT, body=p.to_json(heartbeat(w[0])), headers=AUTH)
        second = conn.getresponse()
        second.read()
        assert second.status == 200
    finally:
        conn.close()
