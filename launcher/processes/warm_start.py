"""The driver's end of ``--preload``: this machine's fork server, and workers started through it.

The server (``fork_server.py``) is started with the first local worker, with that worker's
interpreter and environment, and imports the preloaded modules while the first workers'
clients (``fork_client.py``) wait in its listening queue: a job that starts N workers on
one machine imports torch and Lightning once, not N times, and a replacement started
later forks in milliseconds instead of importing for seconds. The driver binds the socket
itself (in a directory only its user can enter) and hands the server the bound socket, so
no client can come before there is somewhere to queue.

Local workers only: a worker on another machine starts cold, as without ``--preload``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_elastic.launcher.processes.spawn import die_with_parent_preexec

log = logging.getLogger(__name__)

CLIENT = Path(__file__).resolve().with_name("fork_client.py")
SERVER_MODULE = "lightning_elastic.launcher.processes.fork_server"
LISTEN_QUEUE = 4096  # clients queue here while the server imports: every worker of a big first round


class WarmStart:
    """One fork server for this machine, started on first use and stopped by ``close()``."""

    def __init__(self, modules: Sequence[str], secret_fd_variable: str) -> None:
        self._modules = tuple(modules)
        self._secret_fd_variable = secret_fd_variable
        self._directory: str | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._tried = False  # a server that could not start is not tried again for every worker

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    def command(self, command: Sequence[str], env: Mapping[str, str], cwd: str) -> list[str]:
        """The command that starts ``command`` forked from the server (started now if none is)."""
        if not self._tried:
            self._tried = True
            self._start(command, env, cwd)
        assert self._directory is not None
        return [sys.executable, "-I", str(CLIENT), os.path.join(self._directory, "socket"),
                self._secret_fd_variable, "--", *command]

    def _start(self, command: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
        python = command[0]
        self._directory = tempfile.mkdtemp(prefix="lightning-elastic-fork-")  # mode 0700
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.path.join(self._directory, "socket"))
            listener.listen(LISTEN_QUEUE)
            server_env = {k: v for k, v in env.items() if k != self._secret_fd_variable}
            try:
                self._server = subprocess.Popen(
                    # The workers' command after "--" is for ps (and the tests' search for
                    # strays): a forked worker shows the server's command line.
                    [python, "-m", SERVER_MODULE, str(listener.fileno()), ",".join(self._modules), "--", *command],
                    env=server_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    pass_fds=(listener.fileno(),), start_new_session=True,
                    preexec_fn=die_with_parent_preexec(),  # type: ignore[arg-type]
                )
            except OSError as err:
                # No server: every client finds nobody listening and starts cold, saying why.
                log.error("--preload: cannot start the fork server with %s: %s", python, err.strerror or err)
                return
            log.info("Workers on this machine fork from a server that preloads %s (pid %d).",
                     ", ".join(self._modules), self._server.pid)
        finally:
            # The server holds the socket now. Ours closed, a server that dies leaves nobody
            # listening: clients are refused at once and start cold, instead of queueing.
            listener.close()

    def close(self) -> None:
        """Stop the server (its workers die with it) and remove its socket."""
        if self._server is not None:
            with contextlib.suppress(ProcessLookupError):
                self._server.send_signal(signal.SIGKILL)
            self._server.wait()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
