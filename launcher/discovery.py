"""Where hosts come from: a fixed list or a discovery script, polled from a thread."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading
import time
from pathlib import Path
from typing import Protocol

from launcher.errors import DiscoveryError
from launcher.hosts import HostSlots, parse_discovery_output

log = logging.getLogger(__name__)

SCRIPT_TIMEOUT = 30.0  # a discovery script that runs longer than this has failed


class HostDiscovery(Protocol):
    def discover(self) -> list[HostSlots]:
        """The hosts available now, in the source's order; raises DiscoveryError."""
        ...


@dataclasses.dataclass(frozen=True)
class FixedHosts:
    hosts: tuple[HostSlots, ...]

    def discover(self) -> list[HostSlots]:
        return list(self.hosts)


@dataclasses.dataclass(frozen=True)
class ScriptDiscovery:
    script: Path
    default_slots: int | None

    def discover(self) -> list[HostSlots]:
        try:
            done = subprocess.run(
                [str(self.script)], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT
            )
        except subprocess.TimeoutExpired:
            raise DiscoveryError(
                f"host discovery script {self.script} did not finish within {SCRIPT_TIMEOUT:.0f} s"
            ) from None
        except OSError as err:
            raise DiscoveryError(
                f"host discovery script {self.script} cannot be run: {err.strerror}"
            ) from None
        if done.returncode != 0:
            detail = done.stderr.strip().splitlines()[-1:] or ["no output on stderr"]
            raise DiscoveryError(
                f"host discovery script {self.script} exited with status {done.returncode}: {detail[0]}"
            )
        return parse_discovery_output(done.stdout, self.default_slots)


@dataclasses.dataclass(frozen=True)
class DiscoveryResult:
    hosts: list[HostSlots] | None
    error: str | None
    sequence: int  # increases with every poll, so the driver knows a result is new


class DiscoveryPoller:
    """Runs ``discovery`` every ``interval`` seconds in a thread; the driver reads ``latest``.

    The first poll happens in ``start()`` in the caller's thread, so that a failing script
    fails the launch at once, as the user guide promises.
    """

    def __init__(self, discovery: HostDiscovery, interval: float) -> None:
        self._discovery = discovery
        self._interval = interval
        self._lock = threading.Lock()
        self._latest: DiscoveryResult | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sequence = 0

    def start(self) -> list[HostSlots]:
        hosts = self._discovery.discover()  # raises: a first failure is fatal
        self._publish(hosts, None)
        self._thread = threading.Thread(target=self._loop, name="host-discovery", daemon=True)
        self._thread.start()
        return hosts

    def latest(self) -> DiscoveryResult | None:
        with self._lock:
            return self._latest

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SCRIPT_TIMEOUT + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._publish(self._discovery.discover(), None)
            except DiscoveryError as err:
                log.warning("Host discovery failed, will retry: %s", err)
                self._publish(None, str(err))
            except Exception as err:  # hand every failure to the driver, never die silently
                log.exception("Host discovery raised unexpectedly")
                self._publish(None, f"host discovery raised {type(err).__name__}: {err}")

    def _publish(self, hosts: list[HostSlots] | None, error: str | None) -> None:
        with self._lock:
            self._sequence += 1
            self._latest = DiscoveryResult(hosts, error, self._sequence)
