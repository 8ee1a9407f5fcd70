"""lightning_elastic/membership/group_sockets.py: finding and shutting down the group's own TCP connections.

Real loopback connections opened in this process stand in for gloo's.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from lightning_elastic.membership import group_sockets
from lightning_elastic.membership.group_sockets import established, new_connections, shut_down

pytestmark = pytest.mark.timeout(30)

BOUND = 5.0


class Pair:
    """A connected loopback TCP pair: ``client`` connected to ``server`` (the accepted end)."""

    def __init__(self, family: int = socket.AF_INET, listen_on: str = "127.0.0.1") -> None:
        with socket.socket(family, socket.SOCK_STREAM) as listener:
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            listener.bind((listen_on, 0))
            listener.listen()
            self.client = socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=BOUND)
            self.server, _ = listener.accept()
        self.client.settimeout(None)
        self.server.settimeout(BOUND)
        c_local, c_remote = self.client.getsockname(), self.client.getpeername()
        # Both ends as established() names them: (local, remote), IPv4 text addresses.
        self.client_side = ((c_local[0], c_local[1]), (c_remote[0], c_remote[1]))
        self.server_side = (self.client_side[1], self.client_side[0])

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def pairs():
    opened: list[Pair] = []

    def open_pair(**kwargs) -> Pair:
        pair = Pair(**kwargs)
        opened.append(pair)
        return pair

    yield open_pair
    for pair in opened:
        pair.close()


def recv_in_thread(sock: socket.socket) -> tuple[threading.Thread, list]:
    result: list = []

    def receive() -> None:
        try:
            result.append(sock.recv(10))
        except OSError as err:
            result.append(err)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    return thread, result


# ----- established ---------------------------------------------------------------------


def test_established_lists_both_ends_of_a_loopback_connection_with_their_descriptors(pairs):
    pair = pairs()
    found = established()
    assert found[pair.client_side] == pair.client.fileno()
    assert found[pair.server_side] == pair.server.fileno()


def test_established_leaves_out_listeners_and_closed_connections(pairs):
    pair = pairs()
    client_side = pair.client_side
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        pair.close()
        found = established()
    assert client_side not in found
    assert all(local != ("127.0.0.1", port) for local, _ in found)


def test_established_gives_plain_ipv4_for_a_dual_stack_socket(pairs):
    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 here")
    pair = pairs(family=socket.AF_INET6, listen_on="::")
    assert pair.server.getsockname()[0] == "::ffff:127.0.0.1"
    found = established()
    assert found[pair.server_side] == pair.server.fileno()
    assert found[pair.client_side] == pair.client.fileno()


# ----- new_connections -----------------------------------------------------------------


def test_new_connections_keeps_only_those_opened_in_between(pairs):
    old = pairs()
    before = established()
    new = pairs()
    after = established()
    assert new_connections(before, after, ()) == frozenset({new.client_side, new.server_side})
    assert old.client_side not in new_connections(before, after, ())


def test_new_connections_drops_excluded_remote_endpoints(pairs):
    before = established()
    driver = pairs()  # the client end's remote is the "driver"
    peer = pairs()
    after = established()
    excluded = [driver.client_side[1]]
    assert new_connections(before, after, excluded) == frozenset(
        {driver.server_side, peer.client_side, peer.server_side}
    )


def test_new_connections_on_plain_tuples():
    a = (("10.0.0.1", 5000), ("10.0.0.2", 6000))
    b = (("10.0.0.1", 5001), ("10.0.0.3", 29500))
    c = (("10.0.0.1", 5002), ("10.0.0.4", 7000))
    assert new_connections({a}, {a, b, c}, {("10.0.0.3", 29500)}) == frozenset({c})
    assert new_connections({a, b}, {a, b}, ()) == frozenset()


# ----- shut_down -----------------------------------------------------------------------


def test_shut_down_unblocks_the_peers_receive(pairs):
    pair = pairs()
    thread, result = recv_in_thread(pair.server)
    assert shut_down({pair.client_side}) == 1
    thread.join(BOUND)
    assert not thread.is_alive()
    assert result == [b""]


def test_shut_down_unblocks_a_receive_on_the_connection_itself(pairs):
    pair = pairs()
    thread, result = recv_in_thread(pair.client)  # as gloo's own thread waits on its socket
    assert shut_down({pair.client_side}) == 1
    thread.join(BOUND)
    assert not thread.is_alive()
    assert result == [b""]


def test_shut_down_keeps_the_descriptor_open(pairs):
    pair = pairs()
    fd = pair.client.fileno()
    assert shut_down({pair.client_side}) == 1
    assert pair.client.fileno() == fd
    assert established().get(pair.client_side) is None  # no longer established
    with pytest.raises(OSError):
        pair.client.send(b"x")
    pair.client.getsockname()  # the descriptor is still a valid socket


def test_shut_down_of_a_closed_connection_returns_0_and_touches_nothing_else(pairs):
    gone = pairs()
    gone_side = gone.client_side
    gone.close()
    other = pairs()
    assert shut_down({gone_side}) == 0
    other.client.sendall(b"still")
    assert other.server.recv(10) == b"still"
    other.server.sendall(b"works")
    assert other.client.recv(10) == b"works"


def test_shut_down_counts_only_the_connections_still_open(pairs):
    gone = pairs()
    gone_side = gone.client_side
    gone.close()
    live = pairs()
    untouched = pairs()
    assert shut_down({gone_side, live.client_side}) == 1
    assert live.server.recv(10) == b""
    untouched.client.sendall(b"ok")
    assert untouched.server.recv(10) == b"ok"


def test_shut_down_of_nothing_returns_0(pairs):
    pair = pairs()
    assert shut_down(frozenset()) == 0
    pair.client.sendall(b"ok")
    assert pair.server.recv(10) == b"ok"


def test_shut_down_checks_the_descriptor_still_belongs_to_the_connection(pairs, monkeypatch):
    # Between the listing and the shutdown, gloo may close the socket and the descriptor
    # number may be reused by another one: that other socket must be left alone.
    closed = pairs()
    closed_side = closed.client_side
    closed.close()
    reused = pairs()
    monkeypatch.setattr(group_sockets, "established", lambda states=(): {closed_side: reused.client.fileno()})
    assert shut_down({closed_side}) == 0
    reused.client.sendall(b"ok")
    assert reused.server.recv(10) == b"ok"


# ----- a real gloo group formed through the real store, with another thread connecting --

FORM_SCRIPT = """
import datetime, json, socket, sys, threading
from lightning_elastic.membership import group_sockets
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.membership.driver_store import DriverStore
from lightning_elastic.membership.process_group import BackendChoice, init_round_group
import torch, torch.distributed as dist

url, secret, rank, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = DriverStore(DriverClient(url, secret, f"w{rank}"), datetime.timedelta(seconds=20))
unrelated = []
# Another thread of the process (a logger, a data stream) connects while the group forms.
other = threading.Thread(target=lambda: unrelated.append(socket.create_connection(("127.0.0.1", port), timeout=10)))
before = group_sockets.established()
with store.recording() as published:
    other.start()
    init_round_group(store, 1, rank, 2, BackendChoice("gloo", torch.device("cpu")), datetime.timedelta(seconds=20))
    other.join(10)
opened = group_sockets.new_connections(before, group_sockets.established(), {("127.0.0.1", int(url.rsplit(":", 1)[1]))})
group = group_sockets.published_by(opened, published)
mine = unrelated[0].getsockname()[:2], unrelated[0].getpeername()[:2]
print(json.dumps({"opened": len(opened), "group": len(group), "unrelated_opened": mine in opened,
                  "unrelated_in_group": mine in group}), flush=True)
dist.barrier()  # neither rank leaves while the other may still be forming the group
dist.destroy_process_group()
"""


def test_the_groups_connections_leave_out_one_another_thread_opened_during_formation():
    import json
    import subprocess
    import sys

    from lightning_elastic.launcher.service.registry import Registry
    from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer

    secret = "cd" * 32
    service = RendezvousServer(Registry(), secret)
    service.start()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.listen(8)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", FORM_SCRIPT, service.url, secret, str(rank),
                                   str(listener.getsockname()[1])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for rank in range(2)]
        outputs = [proc.communicate(timeout=25) for proc in procs]
    finally:
        listener.close()
        service.close()
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    for out, _ in outputs:
        seen = json.loads(out)
        # The unrelated connection was new during the formation (the old rule cut it), but
        # it goes to no address the ranks published; the group keeps its one peer connection.
        assert seen == {"opened": 2, "group": 1, "unrelated_opened": True, "unrelated_in_group": False}, seen


def test_published_by_finds_ipv4_and_ipv6_sockaddrs_inside_opaque_values():
    v4 = b"\x02\x00\x00\x00" + struct.pack("!H", 35911) + socket.inet_pton(socket.AF_INET, "10.0.0.7") + b"\x00" * 8
    v6 = (b"\x0a\x00" + struct.pack("!H", 4242) + b"\x00\x00\x00\x00"
          + socket.inet_pton(socket.AF_INET6, "fd00::5") + b"\x00" * 4)
    peer4 = (("10.0.0.1", 50000), ("10.0.0.7", 35911))  # this rank connected to a peer's listener
    accepted4 = (("10.0.0.7", 35911), ("10.0.0.9", 50001))  # a peer connected to this rank's
    peer6 = (("fd00::1", 50002), ("fd00::5", 4242))
    other = (("10.0.0.1", 50003), ("10.0.0.7", 443))  # same host, another port
    assert group_sockets.published_by({peer4, accepted4, peer6, other}, [v4, v6]) == {peer4, accepted4, peer6}


def test_shut_down_also_takes_a_connection_whose_peer_has_closed(pairs):
    # The peer left the round first (its group destroyed): our end waits in CLOSE_WAIT,
    # where an operation gloo left pending on it may stay; shutting it down wakes gloo's poll.
    pair = pairs()
    pair.server.close()
    deadline = time.monotonic() + BOUND
    while established((group_sockets.TCP_CLOSE_WAIT,)).get(pair.client_side) is None:
        assert time.monotonic() < deadline, "the client end never reached CLOSE_WAIT"
        time.sleep(0.01)
    assert pair.client_side not in established()  # not established any more
    assert shut_down({pair.client_side}) == 1
    assert pair.client_side not in established((group_sockets.TCP_ESTABLISHED, group_sockets.TCP_CLOSE_WAIT))
