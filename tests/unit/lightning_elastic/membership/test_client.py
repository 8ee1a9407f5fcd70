"""lightning_elastic/membership/client.py: how a worker spreads and retries its requests.

A busy driver (it accepted the request and has not answered yet) is asked again without
a limit; one that cannot be connected to is given up on after the retry period. Retries
back off with jitter so that a fleet does not come back in step.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import requests

from lightning_elastic import protocol as p
from lightning_elastic.membership.client import (
    BACKOFF_CAP,
    DriverClient,
    backoff,
    driver_is_busy,
    first_request_spread,
    heartbeat_hold,
)
from lightning_elastic.errors import RendezvousError

pytestmark = pytest.mark.timeout(30)

SECRET = "ab" * 32


class ScriptedSession:
    """Raises the scripted errors in turn, then answers like the driver."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def post(self, url: str, data: bytes, headers: dict[str, str], timeout: Any) -> requests.Response:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        response = requests.Response()
        response.status_code = 200
        response._content = p.to_json(p.Ack())
        response.headers[p.HEADER_PROTOCOL] = str(p.PROTOCOL_VERSION)
        response.headers[p.HEADER_SIGNATURE] = p.sign_reply(SECRET, 200, headers[p.HEADER_NONCE], response._content)
        return response

    def close(self) -> None:
        pass


def client_with(session: ScriptedSession) -> DriverClient:
    client = DriverClient("http://127.0.0.1:1", SECRET, "w")
    client._session = session  # type: ignore[assignment]
    return client


def test_a_busy_driver_is_asked_again_past_the_retry_period():
    session = ScriptedSession(*(requests.ReadTimeout("slow") for _ in range(3)))
    assert client_with(session)._post(p.PATH_REPORT, p.Report("w", 1, p.Outcome.DONE), p.Ack, retry_for=0.001) == p.Ack()
    assert session.calls == 4


def test_a_driver_that_cannot_be_connected_to_is_given_up_after_the_retry_period():
    session = ScriptedSession(*(requests.ConnectionError("refused") for _ in range(100)))
    with pytest.raises(RendezvousError, match=r"driver at http://127\.0\.0\.1:1 unreachable: refused"):
        client_with(session)._post(p.PATH_REPORT, p.Report("w", 1, p.Outcome.DONE), p.Ack, retry_for=0.3)
    assert 1 < session.calls < 100


def test_an_impatient_request_gives_up_on_a_busy_driver_too():
    # A preempted worker's leave request: it has seconds, not minutes.
    session = ScriptedSession(*(requests.ReadTimeout("slow") for _ in range(100)))
    with pytest.raises(RendezvousError, match="unreachable: slow"):
        client_with(session)._post(p.PATH_LEAVE, p.LeaveRequest("w", "x"), p.LeaveReply, retry_for=0.2,
                                   patient=False)


def test_only_a_read_timeout_means_busy():
    assert driver_is_busy(requests.ReadTimeout())
    assert not driver_is_busy(requests.ConnectTimeout())
    assert not driver_is_busy(requests.ConnectionError())


def test_backoff_grows_to_its_cap_with_jitter_below_each_bound():
    rng = random.Random(0)
    for attempt in range(12):
        bound = min(BACKOFF_CAP, 0.1 * 2 ** attempt)
        delays = [backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= bound for d in delays)
        assert max(delays) > bound / 2 and len(set(delays)) > 100  # spread, not in step


def test_a_fleet_spreads_its_first_requests_in_proportion_to_its_size():
    rng = random.Random(0)
    assert max(first_request_spread(4096, rng) for _ in range(1000)) <= 0.25
    assert max(first_request_spread(4096, rng) for _ in range(1000)) > 0.2
    assert max(first_request_spread(8, rng) for _ in range(1000)) <= 8 / 16384
    assert first_request_spread(0, rng) == 0.0


def test_the_first_heartbeat_hold_spans_the_interval_and_later_ones_its_last_quarter():
    rng = random.Random(0)
    first = [heartbeat_hold(2.0, True, rng) for _ in range(1000)]
    later = [heartbeat_hold(2.0, False, rng) for _ in range(1000)]
    assert 0 <= min(first) < 0.1 and 1.9 < max(first) <= 2.0
    assert 1.5 <= min(later) < 1.6 and 1.9 < max(later) <= 2.0
