"""Where a worker finds its driver: the URL it was started with, or the one a restarted
driver wrote into the shared ``--state-dir`` (``driver-url``), when it came back elsewhere.

A worker whose requests cannot reach the driver (or get a reply that fails the signature
check) re-reads that file and, when it names another valid ``http://HOST:PORT``, sends its
next requests there. Re-reads back off: the first at once, then after 0.5, 1, 2 ... s up
to ``reread_cap`` (jittered), and from the start again once a reply is verified or the
file named a new address. The cap grows with the fleet, so that a whole fleet waiting out
a long outage reads the shared file at most ~``FLEET_REREADS_PER_S`` times a second (4,096
workers at a fixed 0.5 s: ~8,000 reads/s on the shared filesystem; now ~340 in the
steady part of an outage), while a small job still finds a moved driver within seconds.

The file is only a hint of where to connect: it is read like any untrusted input
(bounded, parsed strictly), and every reply is still verified with the job's secret
(``client.py``), so a file pointing at another server gains that server nothing but
refused replies.
"""

from __future__ import annotations

import logging
import os
import random
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

REREAD_FIRST = 0.5  # seconds from the first re-read of an outage to the second; doubles after
REREAD_CAP = 4.0  # seconds between re-reads at most, for a fleet of up to ...
FLEET_REREADS_PER_S = 256.0  # ... this many workers per second of it: larger fleets wait longer
REREAD_JITTER = 0.25  # each wait is 75-100 % of its bound: a fleet that failed together drifts apart
MAX_BYTES = 512  # an address is a line; anything longer is not one


def parse_url(text: str) -> str | None:
    """``http://HOST:PORT`` (no user, path, query or fragment) normalised, or None."""
    text = text.strip()
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    if (parts.scheme != "http" or not parts.hostname or port is None or port <= 0 or parts.username
            or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment
            or any(c.isspace() for c in text)):
        return None
    return f"http://{parts.netloc}"


def reread_cap(world_size: int) -> float:
    """The longest wait between two re-reads by one worker of a fleet of ``world_size``."""
    return max(REREAD_CAP, max(1, world_size) / FLEET_REREADS_PER_S)


def _read_regular(path: Path) -> bytes | None:
    """At most MAX_BYTES + 1 bytes of a regular file, or None. Never blocks on a FIFO or a
    device put in its place: the heartbeat thread that reads it must keep its deadline."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"\0" * (MAX_BYTES + 1)  # not an address: said once, ignored
        return os.read(fd, MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


class DriverLocator:
    """The driver's current URL, shared by a worker's clients (thread-safe)."""

    def __init__(self, url: str, address_file: Path | None = None,
                 clock: Callable[[], float] = time.monotonic, world_size: int = 1,
                 rng: random.Random | None = None) -> None:
        self._url = url.rstrip("/")
        self._file = address_file
        self._clock = clock
        self._rng = rng or random.Random()
        self._cap = reread_cap(world_size)
        self._lock = threading.Lock()
        self._next_read = float("-inf")  # the first failure reads at once
        self._gap = REREAD_FIRST  # the bound of the wait after the next read
        self._said_bad = False

    def reached(self) -> None:
        """A reply verified with the job's secret: the next failure re-reads at once again.
        Called for every reply: the common case (nothing to reset) takes no lock."""
        if self._gap != REREAD_FIRST:
            with self._lock:
                self._gap, self._next_read = REREAD_FIRST, float("-inf")

    @property
    def url(self) -> str:
        with self._lock:
            return self._url

    def refresh(self) -> bool:
        """The driver could not be reached: look at the address file again. True when the
        URL changed (the next request goes there)."""
        if self._file is None:
            return False
        with self._lock:
            now = self._clock()
            if now < self._next_read:
                return False
            self._next_read = now + self._gap * self._rng.uniform(1.0 - REREAD_JITTER, 1.0)
            self._gap = min(self._cap, 2 * self._gap)
        raw = _read_regular(self._file)
        if raw is None:
            return False  # not written yet (or the share is down): keep the one we have
        url = parse_url(raw.decode(errors="replace")) if len(raw) <= MAX_BYTES else None
        with self._lock:
            if url is None:
                if not self._said_bad:  # once, not at every failed heartbeat
                    log.warning("Ignoring %s: expected one line http://HOST:PORT.", self._file)
                    self._said_bad = True
                return False
            if url == self._url:
                return False
            previous, self._url = self._url, url
            self._gap, self._next_read = REREAD_FIRST, float("-inf")  # it may move again
        log.warning("The driver at %s cannot be reached; %s says it serves at %s now: following it.",
                    previous, self._file, url)
        return True
