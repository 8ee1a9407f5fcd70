"""The driver's end of ``--preload``: a fork server per machine, and workers started through it.

``WarmStarts`` wraps the launcher that starts workers (local, or ssh for other hosts). On
a machine's first worker it starts that machine's fork server (``fork_server.py``) the way
it starts a worker there, with the worker's interpreter and environment, and then starts
every worker of the machine as the small client (``fork_client.py``) that has the server
fork it. The server imports the preloaded modules once while the first clients wait for
it: N workers on one machine import torch and Lightning once, not N times, and a
replacement forks in milliseconds instead of importing for seconds. ``prepare`` starts a
machine's server before any worker needs it (a listed spare host), so that its first
worker is warm too.

The hosts the driver runs itself are one machine, one server; any other host has its own.
A server that has ended (its host gone) is forgotten, and started again if its host comes
back: the table holds live servers only.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import signal
from collections.abc import Callable, Sequence

from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.processes.base import WorkerLauncher, WorkerProcess, WorkerSpec

log = logging.getLogger(__name__)

SERVER_MODULE = "lightning_elastic.launcher.node.fork_server"
CLIENT_MODULE = "lightning_elastic.launcher.node.fork_client"
STOP_GRACE = 5.0  # seconds a server gets to remove its directory after SIGTERM
LOCAL = "this machine"


@dataclasses.dataclass
class _Server:
    token: str  # names its directory on its host (fork_client.server_directory)
    process: WorkerProcess


class WarmStarts:
    """A ``WorkerLauncher`` that forks each worker from its machine's fork server."""

    def __init__(self, inner: WorkerLauncher, modules: Sequence[str], is_local: Callable[[str], bool],
                 secret_fd_variable: str) -> None:
        self._inner = inner
        self._modules = ",".join(modules)
        self._is_local = is_local
        self._secret_fd_variable = secret_fd_variable
        self._servers: dict[str, _Server] = {}
        self._calls_since_sweep = 0

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> WorkerProcess:
        server = self._server_for(spec)
        if server is None:  # no server could be started there: as without --preload
            return self._inner.start(spec, prefix)
        command = (spec.command[0], "-m", CLIENT_MODULE, server.token, self._secret_fd_variable, "--", *spec.command)
        return self._inner.start(dataclasses.replace(spec, command=command), prefix)

    def prepare(self, spec: WorkerSpec) -> None:
        """Start the fork server of ``spec.host``'s machine now, if it has none (no worker starts)."""
        self._server_for(spec)

    def _machine(self, host: str) -> str:
        return LOCAL if self._is_local(host) else host

    def _server_for(self, spec: WorkerSpec) -> _Server | None:
        self._forget_ended()
        machine = self._machine(spec.host)
        server = self._servers.get(machine)
        if server is not None and server.process.poll() is None:
            return server
        token = secrets.token_hex(16)
        command = (spec.command[0], "-m", SERVER_MODULE, token, self._modules, "--", *spec.command)
        server_spec = dataclasses.replace(spec, worker_id=f"fork server on {machine}", command=command,
                                          log_file=None)
        try:
            process = self._inner.start(server_spec, lambda: "[fork server] ")
        except StartError as err:
            log.error("--preload: cannot start the fork server on %s: %s", machine, err)
            return None
        # (An agent's host: its pid is known once the agent reported the start, not yet.)
        log.info("Workers on %s fork from a server that preloads %s (%s).", machine, self._modules,
                 f"pid {process.pid}" if process.pid else "started by its agent")
        server = self._servers[machine] = _Server(token, process)
        return server

    def _forget_ended(self) -> None:
        """Drop the servers that ended (their host lost, their connection cut): one sweep
        every as many calls as there are servers, so a start costs O(1) amortised and the
        table holds at most the live servers and those that ended since the last sweep."""
        self._calls_since_sweep += 1
        if self._calls_since_sweep < len(self._servers):
            return
        self._calls_since_sweep = 0
        for machine, known in list(self._servers.items()):
            if known.process.poll() is not None:
                del self._servers[machine]

    def close(self) -> None:
        """Stop every server (the driver has stopped the workers first): SIGTERM, so that it
        removes its directory, then SIGKILL after a bound."""
        servers = [s.process for s in self._servers.values()]
        for process in servers:
            process.signal(signal.SIGTERM)
        for process in servers:
            if process.wait(STOP_GRACE) is None:
                process.signal(signal.SIGKILL)
                process.wait(STOP_GRACE)
            process.finish_output()
        self._servers.clear()
