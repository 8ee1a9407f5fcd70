"""The agent's side of the wire (launcher/agent/channel.py) against the real rendezvous service:
authentication both ways, replays, and messages that are not the protocol's."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import requests

from lightning_elastic import protocol as p
from lightning_elastic.launcher.agent.channel import DriverChannel, NotTheDriver, Refused, Unreachable
from lightning_elastic.launcher.service.agent_board import AgentBoard
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.service.rendezvous_server import MAX_BODY, RendezvousServer

pytestmark = pytest.mark.timeout(60)

SECRET = "0123456789abcdef" * 4
OTHER = "fedcba9876543210" * 4
TIMEOUT = 10.0


def serve(secret: str) -> tuple[RendezvousServer, AgentBoard]:
    board = AgentBoard(max_slots=8, heartbeat_timeout=10.0, poll_seconds=0.2)
    server = RendezvousServer(Registry(), secret, agents=board)
    server.start()
    return server, board


def close(server: RendezvousServer) -> None:
    closer = threading.Thread(target=server.close, daemon=True)
    closer.start()
    closer.join(timeout=10)


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[RendezvousServer, AgentBoard]]:
    server, board = serve(SECRET)
    try:
        yield server, board
    finally:
        close(server)


def channel(server: RendezvousServer, secret: str = SECRET) -> DriverChannel:
    return DriverChannel("127.0.0.1", server.port, secret, p.NonceSequence())


def join(n: int, host: str) -> p.AgentJoin:
    return p.AgentJoin(f"{n:032x}", host, 1)


def test_an_agent_with_the_secret_joins_and_trusts_the_signed_reply(service):
    server, board = service
    c = channel(server)
    reply = c.post(p.PATH_AGENT_JOIN, join(1, "h-ok"), p.AgentJoinReply)
    assert reply.accepted and board.serves("h-ok")
    polled = c.post(p.PATH_AGENT_POLL, p.AgentPoll(f"{1:032x}", 0.1, 0), p.AgentPollReply, wait=0.1)
    assert polled == p.AgentPollReply()
    c.close()


def test_an_agent_with_a_wrong_secret_is_refused_and_nothing_says_the_secret(service):
    server, board = service
    rejected = server.rejected
    c = channel(server, secret=OTHER)
    with pytest.raises(NotTheDriver) as caught:
        c.post(p.PATH_AGENT_JOIN, join(2, "h-wrong"), p.AgentJoinReply)
    said = str(caught.value)
    assert "did not accept this agent's signature: wrong job secret" in said
    assert OTHER not in said and SECRET not in said
    assert not board.serves("h-wrong") and server.rejected == rejected + 1


def test_an_agent_trusts_no_driver_without_the_secret():
    # A driver that does not know the agent's secret (a spoofer on its address) cannot
    # sign a reply for the agent's nonce: the agent refuses to act on anything it says.
    spoof, _ = serve(OTHER)
    try:
        c = DriverChannel("127.0.0.1", spoof.port, SECRET, p.NonceSequence())
        with pytest.raises(NotTheDriver):
            c.post(p.PATH_AGENT_JOIN, join(3, "h-spoofed"), p.AgentJoinReply)
    finally:
        close(spoof)


def test_a_replayed_agent_request_is_refused(service):
    server, board = service
    body = p.to_json(join(4, "h-replay"))
    headers = {"Content-Type": "application/json", **p.sign_request(SECRET, "POST", p.PATH_AGENT_JOIN, body)}
    first = requests.post(server.url + p.PATH_AGENT_JOIN, data=body, headers=headers, timeout=TIMEOUT)
    again = requests.post(server.url + p.PATH_AGENT_JOIN, data=body, headers=headers, timeout=TIMEOUT)
    assert first.status_code == 200 and again.status_code == 401
    assert "replayed" in again.json()["error"]


def test_a_recorded_reply_is_worth_nothing_to_the_agent(service):
    # The driver signs a reply for the request's own nonce: replayed to the agent for
    # another request (a man in the middle's orders), it fails the check.
    server, _ = service
    body = p.to_json(join(5, "h-rec"))
    headers = p.sign_request(SECRET, "POST", p.PATH_AGENT_JOIN, body)
    reply = requests.post(server.url + p.PATH_AGENT_JOIN, data=body, headers=headers, timeout=TIMEOUT)
    other_nonce = p.sign_request(SECRET, "POST", p.PATH_AGENT_JOIN, body)[p.HEADER_NONCE]
    assert p.verify_reply(SECRET, 200, headers[p.HEADER_NONCE], reply.content, reply.headers[p.HEADER_SIGNATURE])
    assert not p.verify_reply(SECRET, 200, other_nonce, reply.content, reply.headers[p.HEADER_SIGNATURE])


@pytest.mark.parametrize("body, status, said", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"agent_id": "00", "host": "h", "slots": 1, "admin": true}', 400, "unknown field(s) admin"),
    (b'{"agent_id": "00", "host": "h", "slots": -3}', 400, "expected a non-negative number"),
    (b'[1, 2]', 400, "expected a JSON object"),
])
def test_garbage_from_a_secret_holder_is_refused_before_the_board(service, body, status, said):
    server, board = service
    c = channel(server)
    headers = {"Content-Type": "application/json", **p.sign_request(SECRET, "POST", p.PATH_AGENT_JOIN, body)}
    r = requests.post(server.url + p.PATH_AGENT_JOIN, data=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == status and said in r.json()["error"]
    assert not board.serves("h")
    c.close()


def test_an_oversized_message_is_refused_unread(service):
    server, _ = service
    body = b'{"agent_id": "' + b"0" * (MAX_BODY + 1) + b'"}'
    headers = {"Content-Type": "application/json", **p.sign_request(SECRET, "POST", p.PATH_AGENT_REPORT, body)}
    r = requests.post(server.url + p.PATH_AGENT_REPORT, data=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 400 and "Content-Length must be 0..65536" in r.json()["error"]
    assert p.HEADER_SIGNATURE not in r.headers


def test_an_unsigned_request_is_refused_and_its_refusal_unsigned(service):
    server, _ = service
    r = requests.post(server.url + p.PATH_AGENT_JOIN, data=p.to_json(join(6, "h-unsigned")), timeout=TIMEOUT)
    assert r.status_code == 401 and p.HEADER_SIGNATURE not in r.headers


def test_a_signed_refusal_reaches_the_agent_as_the_drivers_word(service):
    server, _ = service
    c = channel(server)
    with pytest.raises(Refused) as caught:
        c.post("/v1/agent/nowhere", join(7, "h"), p.AgentJoinReply)
    assert caught.value.status == 404
    c.close()


def test_no_driver_listening_is_unreachable_not_a_refusal():
    server, _ = serve(SECRET)
    port = server.port
    close(server)
    with pytest.raises(Unreachable):
        DriverChannel("127.0.0.1", port, SECRET, p.NonceSequence()).post(p.PATH_AGENT_JOIN, join(8, "h"),
                                                                        p.AgentJoinReply)
