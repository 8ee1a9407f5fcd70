"""Where hosts come from: a fixed list or a discovery script, polled from a thread."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lightning_elastic.launcher.errors import DiscoveryError
from lightning_elastic.launcher.job.slots import HostSlots, parse_discovery_output

log = logging.getLogger(__name__)

SCRIPT_TIMEOUT = 30.0  # --discovery-timeout's default: a script that runs longer has failed
# Once the script has exited or been killed, how long its output may still take to close: a
# process it started in a session of its own (a daemon) can hold the pipe for ever.
OUTPUT_GRACE = 1.0


class HostDiscovery(Protocol):
    def discover(self) -> list[HostSlots]:
        """The hosts available now, in the source's order; raises DiscoveryError."""
        ...

    def cancel(self) -> None:
        """Abandon a discovery in progress (the job is ending)."""
        ...


@dataclasses.dataclass(frozen=True)
class FixedHosts:
    hosts: tuple[HostSlots, ...]

    def discover(self) -> list[HostSlots]:
        return list(self.hosts)

    def cancel(self) -> None:
        pass


class ScriptDiscovery:
    """Runs the user's script; a run that hangs is killed with everything it started."""

    def __init__(self, script: Path, default_slots: int | None, timeout: float = SCRIPT_TIMEOUT) -> None:
        self.script = script
        self.default_slots = default_slots
        self.timeout = timeout
        self._lock = threading.Lock()
        self._running: subprocess.Popen[str] | None = None
        self._cancelled = False

    def discover(self) -> list[HostSlots]:
        try:
            with self._lock:
                if self._cancelled:
                    raise DiscoveryError("host discovery was cancelled: the job is ending")
                # Its own session: on a timeout, children that still hold its stdout die too.
                proc = subprocess.Popen(
                    [str(self.script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    start_new_session=True,
                )
                self._running = proc
            try:
                stdout, stderr = proc.communicate(timeout=self.timeout)  # reads as it runs: no full pipe
            except subprocess.TimeoutExpired:
                exited = proc.poll() is not None
                _kill_group(proc)
                _abandon(proc)
                if exited:
                    raise DiscoveryError(
                        f"host discovery script {self.script} exited, but a process it started still held its "
                        f"output {self.timeout:g} s later: let the script's children close stdout "
                        "(e.g. redirect a background command's output)"
                    ) from None
                raise DiscoveryError(
                    f"host discovery script {self.script} did not finish within {self.timeout:g} s "
                    "(--discovery-timeout)"
                ) from None
            finally:
                with self._lock:
                    self._running = None
        except OSError as err:
            raise DiscoveryError(
                f"host discovery script {self.script} cannot be run: {err.strerror}"
            ) from None
        if proc.returncode != 0:
            detail = stderr.strip().splitlines()[-1:] or ["no output on stderr"]
            raise DiscoveryError(
                f"host discovery script {self.script} exited with status {proc.returncode}: {detail[0]}"
            )
        return parse_discovery_output(stdout, self.default_slots)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._running is not None:
                _kill_group(self._running)


def _abandon(proc: subprocess.Popen[str]) -> None:
    """Stop reading a script's output within OUTPUT_GRACE, whoever still holds it."""
    try:
        proc.communicate(timeout=OUTPUT_GRACE)
    except subprocess.TimeoutExpired:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()  # the script itself was killed: it is gone


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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

    def __init__(
        self, discovery: HostDiscovery, interval: float, timeout: float = SCRIPT_TIMEOUT,
        prepare: Callable[[str], object] | None = None,
    ) -> None:
        self._discovery = discovery
        # Called with every host name found, in this thread, before the driver reads them:
        # the driver's name lookups (DNS, a cache of each) then never run under its lock.
        self._prepare = prepare
        self._interval = interval
        self._timeout = timeout  # of one discovery: bounds the wait for the thread in close()
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
        self._discovery.cancel()  # a hanging script must not hold the driver's exit
        if self._thread is not None:
            self._thread.join(timeout=self._timeout + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._publish(self._discovery.discover(), None)
            except DiscoveryError as err:
                if self._stop.is_set():
                    return  # cancelled by close()
                log.warning("Host discovery failed, will retry: %s", err)
                self._publish(None, str(err))
            except Exception as err:  # hand every failure to the driver, never die silently
                log.exception("Host discovery raised unexpectedly")
                self._publish(None, f"host discovery raised {type(err).__name__}: {err}")

    def _publish(self, hosts: list[HostSlots] | None, error: str | None) -> None:
        if hosts and self._prepare is not None:
            for host in hosts:
                self._prepare(host.host)
        with self._lock:
            self._sequence += 1
            self._latest = DiscoveryResult(hosts, error, self._sequence)
