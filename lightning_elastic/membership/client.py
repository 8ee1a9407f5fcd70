"""HTTP client of the driver's rendezvous service (worker side).

Requests are signed and replies verified with the job's secret (``protocol.sign_request``,
``protocol.verify_reply``); the secret itself is never sent.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any, NoReturn, TypeVar

import requests

from lightning_elastic import protocol as p
from lightning_elastic.membership.driver_locator import DriverLocator
from lightning_elastic.errors import DriverUnreachable, RendezvousError

T = TypeVar("T")

CONNECT_TIMEOUT = 5.0
RETRY_FOR = 30.0  # keep retrying a request this long while the driver cannot be connected to
# Retries back off exponentially from BACKOFF_BASE to BACKOFF_CAP seconds, each delay drawn
# at random below its bound ("full jitter"): a fleet that failed together (the driver was
# briefly unreachable) must not come back together.
BACKOFF_BASE = 0.1
BACKOFF_CAP = 2.0
# A fleet started at once spreads its first request over world_size / this many seconds
# (0.25 s at 4,096 workers, under a millisecond at 8).
FIRST_REQUEST_SPREAD_RATE = 16384.0
HEARTBEAT_HOLD_JITTER = 0.25  # a heartbeat long poll is held for 75-100 % of the interval
_RANDOM = random.Random()  # this process's own: seeded from the OS, as every worker's must differ


def backoff(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (0 for the first retry)."""
    return (rng or _RANDOM).uniform(0.0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt))


# A failed heartbeat is retried within this (or the interval, if shorter): an adopting
# driver (--state-dir) hears from every worker within it of listening again.
HEARTBEAT_RETRY_CAP = 0.5


def heartbeat_retry_delay(interval: float, failures: int, rng: random.Random | None = None) -> float:
    """Seconds before a failed heartbeat is sent again (``failures`` in a row before it): at
    a random point of a growing bound, at most HEARTBEAT_RETRY_CAP, so that a restarted
    driver is found again within a second, by a fleet not all at once."""
    return min(interval, HEARTBEAT_RETRY_CAP, backoff(failures, rng))


def first_request_spread(world_size: int, rng: random.Random | None = None) -> float:
    """Seconds a worker waits before its first request, so that a fleet does not arrive at once."""
    return (rng or _RANDOM).uniform(0.0, max(0, world_size) / FIRST_REQUEST_SPREAD_RATE)


def heartbeat_hold(interval: float, first: bool, rng: random.Random | None = None) -> float:
    """How long a heartbeat long poll is held: a random part of the interval for the first
    (the fleet's heartbeats start spread over a whole interval, not in one wave), then 75
    to 100 % of it, so that polls all answered at once on a change drift apart again."""
    low = 0.0 if first else 1.0 - HEARTBEAT_HOLD_JITTER
    return interval * (rng or _RANDOM).uniform(low, 1.0)


def exit_driver_gone(waited: float) -> NoReturn:
    """End this worker because its driver stayed unreachable for ``waited`` seconds, with
    the status that says so (``protocol.EXIT_DRIVER_GONE``): a restarted driver counts it
    as gone for its own absence, not as a failure. ``os._exit``: no driver is left to tell,
    and the training thread may be blocked in a collective."""
    print(f"lightning-elastic: driver unreachable for {waited:g} s: exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(p.EXIT_DRIVER_GONE)


def driver_is_busy(err: requests.RequestException) -> bool:
    """Did the driver accept the request and not answer in time (busy, not gone)?

    A worker never gives up on a busy driver: it asks again. One it cannot connect to
    (refused, unreachable, a connect timeout) is retried for RETRY_FOR seconds, then the
    request fails. A driver that accepts and never answers (stopped, wedged) is caught by
    the heartbeat thread, which ends the worker (``DRIVER_LOST_AFTER_TIMEOUTS``).
    """
    return isinstance(err, requests.ReadTimeout)


class DriverClient:
    def __init__(self, url: str, secret: str, worker_id: str, retry_for: float = RETRY_FOR,
                 locator: DriverLocator | None = None) -> None:
        self.worker_id = worker_id
        self._retry_for = retry_for  # how long a request waits out a driver it cannot connect to
        # Shared by the worker's clients: where the driver is now (--state-dir: a restarted
        # driver may serve elsewhere, and says where in the state dir).
        self._locator = locator if locator is not None else DriverLocator(url)
        self._secret = secret
        self._nonces = p.NonceSequence()  # the driver remembers senders, not every nonce
        self._session = requests.Session()
        # Never through a proxy from the login environment (http_proxy is common on
        # clusters): the driver is reached directly, and long polls must not be relayed.
        self._session.trust_env = False

    def rendezvous(self, after_round: int) -> p.RendezvousReply:
        return self._post(p.PATH_RENDEZVOUS, p.RendezvousRequest(self.worker_id, after_round),
                          p.RendezvousReply, wait=p.RENDEZVOUS_POLL)

    def heartbeat(self, known_generation: int, known_broken_round: int, wait: float,
                  stepped: tuple[int, float] = (0, 0.0), snapshots: Any = None) -> p.HeartbeatReply:
        written, failed, error = (snapshots.written, snapshots.failed, p.clip(snapshots.last_error, 200)) if snapshots \
            else (0, 0, "")
        request = p.HeartbeatRequest(self.worker_id, known_generation, known_broken_round, wait, *stepped,
                                     written, failed, error)
        return self._post(p.PATH_HEARTBEAT, request, p.HeartbeatReply, wait=wait, retry_for=0.0)

    def round_lost(self, round_number: int, wait: float, collective: bool = False, error: str = "",
                   commits: int = 0, verdict_wait: float = 0.0) -> p.RoundLostReply:
        """Was ``round_number`` lost? ``wait``: --error-wait; ``verdict_wait``: how long the
        answer may wait for the driver's verdict on a peer silent since the question (see
        ``RoundLostRequest``)."""
        request = p.RoundLostRequest(self.worker_id, round_number, wait, collective, p.clip(error, 2000), commits,
                                     verdict_wait)
        return self._post(p.PATH_ROUND_LOST, request, p.RoundLostReply, wait=max(wait, verdict_wait))

    def leave(self, reason: str) -> bool:
        """Ask to leave gracefully; False: exit now. A short retry: a preempted worker has little time."""
        return self._post(p.PATH_LEAVE, p.LeaveRequest(self.worker_id, reason), p.LeaveReply, retry_for=2.0,
                          patient=False).graceful

    def report(self, round_number: int, outcome: p.Outcome, message: str = "", snapshots: Any = None) -> None:
        written, failed, error = (snapshots.written, snapshots.failed, p.clip(snapshots.last_error, 200)) if snapshots \
            else (0, 0, "")
        self._post(p.PATH_REPORT, p.Report(self.worker_id, round_number, outcome, p.clip(message, 2000), written, failed,
                                           error), p.Ack)

    def store(self, request: p.StoreRequest) -> p.StoreReply:
        return self._post(p.PATH_STORE, request, p.StoreReply, wait=request.wait_seconds)

    @property
    def _url(self) -> str:
        return self._locator.url

    def close(self) -> None:
        self._session.close()

    def _post(self, path: str, message: Any, reply_type: type[T], wait: float = 0.0,
              retry_for: float | None = None, patient: bool = True) -> T:
        """Send, retrying for ``retry_for`` seconds (default: the client's) while the driver
        cannot be reached, and without a limit while it is busy if ``patient`` (see
        ``driver_is_busy``)."""
        if retry_for is None:
            retry_for = self._retry_for
        deadline = time.monotonic() + retry_for
        body = p.to_json(message)
        attempt = 0
        while True:
            # Signed afresh for every attempt: the driver refuses a nonce it has seen.
            auth = p.sign_request(self._secret, "POST", path, body, self._nonces)
            url = self._url  # this attempt's: a failed one may make the locator move on
            try:
                response = self._session.post(
                    url + path, data=body,
                    headers={"Content-Type": "application/json", **auth},
                    timeout=(CONNECT_TIMEOUT, wait + 30.0),
                )
            except requests.RequestException as err:
                busy = patient and driver_is_busy(err)
                if not busy:  # gone: a restarted driver may have said where it serves now
                    self._locator.refresh()
                if retry_for <= 0 or (not busy and time.monotonic() >= deadline):
                    # A patient request that waited it out: the driver is gone, not one request.
                    if retry_for > 0 and patient:
                        raise DriverUnreachable(f"driver at {url} unreachable: {err}", retry_for) from None
                    raise RendezvousError(f"driver at {url} unreachable: {err}") from None
                time.sleep(backoff(attempt))
                attempt += 1
                continue
            version = response.headers.get(p.HEADER_PROTOCOL)
            if version != str(p.PROTOCOL_VERSION):
                # Said before the signature check: another version may sign differently. A
                # spoofer gains nothing by it: an unsigned reply ends the request too.
                raise RendezvousError(f"driver at {url}: {p.version_mismatch(version, side='driver')}")
            try:
                self._check_signature(response, auth[p.HEADER_NONCE], url)
            except RendezvousError:
                # Not our driver (its old address now serves something else, say): the
                # next request goes where a restarted driver said it serves, if it did.
                self._locator.refresh()
                raise
            self._locator.reached()  # our driver (whatever the status): a later outage re-reads at once
            if response.status_code != 200:
                raise RendezvousError(
                    f"driver refused {path} ({response.status_code}): {response.text.strip()[:300]}"
                )
            return p.decode(reply_type, response.content)

    def _check_signature(self, response: requests.Response, nonce: str, url: str) -> None:
        """Refuse a reply the driver did not sign for this request (a spoofed driver).

        The message never quotes the unverified reply: the worker acts on error texts
        (a "(409)" ends its heartbeats), and a spoofer must not choose them.
        """
        signature = response.headers.get(p.HEADER_SIGNATURE)
        if p.verify_reply(self._secret, response.status_code, nonce, response.content, signature):
            return
        why = "unsigned" if signature is None else "wrongly signed"
        hint = (" (the driver did not accept this worker's signature: wrong job secret?)"
                if response.status_code == 401 else "")
        raise RendezvousError(
            f"reply from the driver at {url} failed authentication: "
            f"{why} reply with status {response.status_code}{hint}"
        )
