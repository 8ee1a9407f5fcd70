"""A worker follows its driver to the address a restarted driver wrote in --state-dir, and
still trusts only replies signed with the job's secret."""

from __future__ import annotations

import http.server
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_elastic.membership import driver_locator
from lightning_elastic import protocol as p
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.membership.driver_locator import DriverLocator, parse_url
from lightning_elastic.errors import RendezvousError
from lightning_elastic.launcher.restart.state_dir import StateDir

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("text", "expected"), [
    ("http://10.0.0.2:4711\n", "http://10.0.0.2:4711"),
    ("http://node7:4711/", "http://node7:4711"),
    ("http://[fd00::2]:4711", "http://[fd00::2]:4711"),
    ("https://node7:4711", None),  # the driver serves plain HTTP, signed
    ("http://node7", None),  # no port
    ("http://node7:0", None),
    ("http://node7:99999", None),
    ("http://user:pw@node7:4711", None),
    ("http://node7:4711/elsewhere", None),
    ("http://node7:4711?x=1", None),
    ("http://node 7:4711", None),
    ("", None),
    ("garbage", None),
])
def test_only_a_plain_http_host_and_port_is_an_address(text: str, expected: str | None) -> None:
    assert parse_url(text) == expected


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TopJitter(random.Random):
    """Every wait at its bound: the tests step the clock past it."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_the_locator_follows_the_file_rereading_it_less_often_the_longer_the_driver_is_gone(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    clock = Clock()
    locator = DriverLocator("http://10.0.0.1:4711", state.url_file, clock, rng=TopJitter())
    assert not locator.refresh()  # no file yet: the start URL stays
    state.write_url("http://10.0.0.2:5000")
    clock.now += 0.1
    assert not locator.refresh() and locator.url == "http://10.0.0.1:4711"  # read too soon after the last
    clock.now += 0.5
    assert locator.refresh() and locator.url == "http://10.0.0.2:5000"
    # A new address read: the next failure reads at once (it may have moved again).
    assert not locator.refresh()  # the same address: nothing changes
    state.url_file.write_text("x" * 10_000)  # hostile or torn: ignored, the URL kept
    clock.now += 0.5
    assert not locator.refresh() and locator.url == "http://10.0.0.2:5000"
    state.url_file.unlink()
    os.mkfifo(state.url_file)  # nobody writes to it: a blocking open would hang the heartbeats
    clock.now += 1
    assert not locator.refresh() and locator.url == "http://10.0.0.2:5000"
    assert DriverLocator("http://a:1").refresh() is False  # without --state-dir there is no file


def test_rereads_back_off_to_a_cap_and_start_over_after_a_verified_reply(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    state.write_url("http://10.0.0.1:4711")  # the same address: no read finds anything new
    clock = Clock()
    start = clock.now
    read_at: list[float] = []
    original = driver_locator._read_regular
    monkeypatch.setattr(driver_locator, "_read_regular",
                        lambda path: read_at.append(round(clock.now - start, 1)) or original(path))
    locator = DriverLocator("http://10.0.0.1:4711", state.url_file, clock, rng=TopJitter())
    for tick in range(400):  # 40 s of failed requests, one every 0.1 s
        clock.now = start + 0.1 * tick
        locator.refresh()
    assert read_at == [0.0, 0.5, 1.5, 3.5, 7.5, 11.5, 15.5, 19.5, 23.5, 27.5, 31.5, 35.5, 39.5]
    clock.now += 0.1
    locator.reached()  # the driver answered, signed: the next failure reads at once
    locator.refresh()
    assert read_at[-1] == 40.0


def test_a_large_fleet_waiting_out_an_outage_reads_the_shared_file_a_few_hundred_times_a_second(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """4,096 workers, each failing a request every 0.25 s (the heartbeat's retries) through
    a 120 s outage: with a re-read every 0.5 s that was ~8,000 reads/s. 256 of them are
    simulated (their re-reads do not depend on each other) and scaled up."""
    reads: list[float] = []
    clock = Clock()
    monkeypatch.setattr(driver_locator, "_read_regular", lambda _path: reads.append(clock.now) or None)
    start = clock.now
    fleet = [DriverLocator("http://10.0.0.1:4711", tmp_path / "driver-url", clock, world_size=4096,
                           rng=random.Random(i)) for i in range(256)]
    for tick in range(480):
        clock.now = start + 0.25 * tick
        for locator in fleet:
            locator.refresh()
    scale = 4096 / len(fleet)
    first_10s = scale * sum(1 for t in reads if t < start + 10) / 10
    steady = scale * sum(1 for t in reads if t >= start + 60) / 60
    assert steady <= 360, steady  # ~4,096 / (0.875 x 16 s); 8,192 at a fixed 0.5 s
    assert first_10s <= 2100, first_10s  # at once, then 0.5, 1, 2, 4 s later: five reads each
    # A small job still finds a moved driver within seconds of an outage of any length.
    assert driver_locator.reread_cap(3) == driver_locator.REREAD_CAP == 4.0
    assert driver_locator.reread_cap(4096) == 16.0


def test_a_verified_reply_resets_the_rereads(tmp_path: Path) -> None:
    """The client tells its locator when its driver answered (signed): a later outage
    starts from a re-read at once, not from the previous outage's long wait."""
    from lightning_elastic.launcher.service.registry import Registry
    from lightning_elastic.launcher.job.slots import SlotKey
    from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer
    from tests.unit.launcher.service.test_rendezvous_server import SECRET

    reg = Registry()
    with reg.cond:
        reg.add_worker("w", SlotKey("h", 0)).last_heartbeat = 0.0
    srv = RendezvousServer(reg, SECRET)
    srv.start()
    try:
        clock = Clock()
        locator = DriverLocator(srv.url, tmp_path / "driver-url", clock)
        for _ in range(6):  # an outage long enough to grow the wait
            locator.refresh()
            clock.now += 20
        assert locator._gap == driver_locator.REREAD_CAP
        client = DriverClient(srv.url, SECRET, "w", locator=locator)
        client.heartbeat(0, 0, 0.0)
        client.close()
        assert locator._gap == driver_locator.REREAD_FIRST and locator._next_read == float("-inf")
    finally:
        srv.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def impostor() -> Iterator[str]:
    """A server answering 200 to everything, unsigned: not the driver, whatever a file says."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b'{"generation": 1}'
            self.send_response(200)
            self.send_header(p.HEADER_PROTOCOL, str(p.PROTOCOL_VERSION))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_client_whose_driver_is_gone_switches_to_the_written_address_and_still_verifies_replies(
        tmp_path: Path, impostor: str) -> None:
    state = StateDir(tmp_path)
    state.write_url(impostor)
    gone = f"http://127.0.0.1:{closed_port()}"
    client = DriverClient(gone, "s" * 64, "w#0", retry_for=10.0, locator=DriverLocator(gone, state.url_file))
    # A heartbeat is not retried: it fails, and the client has re-read the file meanwhile.
    with pytest.raises(RendezvousError, match=f"driver at {gone} unreachable"):
        client.heartbeat(0, 0, 0.0)
    # The next goes to the new address, and the unsigned reply it gets there is refused.
    with pytest.raises(RendezvousError, match=f"reply from the driver at {impostor} failed authentication: "
                                              "unsigned reply with status 200"):
        client.heartbeat(0, 0, 0.0)
    client.close()


def test_a_client_answered_by_another_server_at_its_drivers_address_looks_at_the_file_too(
        tmp_path: Path, impostor: str) -> None:
    """The old address reused by another service: a reply that fails authentication also
    makes the client look where a restarted driver may have said it serves."""
    state = StateDir(tmp_path)
    moved = f"http://127.0.0.1:{closed_port()}"
    state.write_url(moved)
    locator = DriverLocator(impostor, state.url_file)
    client = DriverClient(impostor, "s" * 64, "w#0", locator=locator)
    with pytest.raises(RendezvousError, match=f"reply from the driver at {impostor} failed authentication"):
        client.heartbeat(0, 0, 0.0)
    assert locator.url == moved
    client.close()
