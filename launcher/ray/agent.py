"""The Ray actor on a node that runs one worker process, as the ssh supervisor does on a host.

``WorkerAgent.start`` starts the unchanged training command as a child process (its own
session, the job secret through an inherited pipe, SIGKILL when the agent dies), so every
script that runs under ``launch`` runs under Ray too. The driver then calls ``read`` in a
loop: it returns the child's output as it comes and, with its last bytes, the exit status.
``signal`` reaches the child's whole process group; it runs next to a pending ``read``
(the actor's ``max_concurrency`` is 2).

For the Python API the agent runs ``lightning_elastic.function_worker`` instead of a
command: the pickled function goes to a file of the agent's own, and the function's return
value comes back through ``result``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence

from lightning_elastic.launcher.hosts.network import collective_interface_env
from lightning_elastic.launcher.node.spawn import end_leftovers_at_exit, signal_group, spawn_worker
from lightning_elastic.launcher.ray.sealed import KeyPair, Sealed, open_sealed
from lightning_elastic import protocol

# Output held for the driver before the child is made to wait (back pressure, as a pipe).
BUFFER_LIMIT = 1 << 20
FUNCTION_FILE = "function.pkl"
RESULT_FILE = "result.pkl"
AUTOLOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(protocol.__file__)), "_autoload")


def node_pythonpath(pythonpath: str | None) -> str:
    """The worker's ``PYTHONPATH`` on this node: this node's own install registers the
    Lightning strategy, wherever the driver's lies.

    The driver puts its install's ``lightning_elastic/_autoload`` first on every worker's
    ``PYTHONPATH``; on a Ray node that path names the driver's machine, which may be another
    install of the package here or none. It is replaced by this node's, so that one copy of
    the ``sitecustomize`` runs in the worker, the one that matches the package it imports.
    """
    kept = [entry for entry in (pythonpath or "").split(os.pathsep) if entry and not _is_autoload_dir(entry)]
    return os.pathsep.join([AUTOLOAD_DIR, *kept])


def _is_autoload_dir(entry: str) -> bool:
    path = os.path.normpath(entry)
    return os.path.basename(path) == "_autoload" and os.path.basename(os.path.dirname(path)) == "lightning_elastic"


@dataclasses.dataclass(frozen=True)
class OutputChunk:
    """What one ``read`` returns: output bytes, and the exit status once the child has ended."""

    data: bytes
    status: int | None  # as Popen.returncode: negative for a signal


class WorkerAgent:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._buffer = bytearray()
        self._status: int | None = None
        self._pid = 0
        self._dir: str | None = None  # scratch files of a function run only
        self._key = KeyPair()  # the job secret comes sealed for it (see sealed.py)

    def public_key(self) -> int:
        """This actor's public value: the driver seals the job secret with it, so the
        secret never crosses Ray's (unencrypted) RPC in clear."""
        return self._key.public

    def start(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        sealed_secret: Sealed,
        cwd: str,
        function: bytes | None = None,
    ) -> int:
        """Start the worker; returns its pid on this node. Raises OSError if it cannot start."""
        secret = open_sealed(self._key, sealed_secret)
        child_env = {**os.environ, **env}
        child_env["PYTHONPATH"] = node_pythonpath(child_env.get("PYTHONPATH"))
        if "MASTER_ADDR" in child_env:  # collectives go out through the interface that reaches the driver
            child_env.update(collective_interface_env(child_env, child_env["MASTER_ADDR"]))
        if function is not None:
            self._dir = tempfile.mkdtemp(prefix="lightning-elastic-agent-")
            path = os.path.join(self._dir, FUNCTION_FILE)
            with open(path, "wb") as f:
                f.write(function)
            command = [sys.executable, "-m", "lightning_elastic.function_worker", path,
                       os.path.join(self._dir, RESULT_FILE)]
        if not os.path.isdir(cwd):
            cwd = os.getcwd()  # not a shared filesystem: Ray's working directory (runtime_env)
        started: queue.Queue[int | OSError] = queue.Queue()
        # The child gets SIGKILL when the *thread* that started it ends (PR_SET_PDEATHSIG),
        # so it is started by a thread that lives exactly as long as it does.
        threading.Thread(
            target=self._run, args=(list(command), child_env, secret, cwd, started), name="worker", daemon=True
        ).start()
        outcome = started.get()
        if isinstance(outcome, OSError):
            raise outcome
        self._pid = outcome
        return outcome

    def read(self, timeout: float) -> OutputChunk:
        """Output so far (waiting up to ``timeout`` s for some), with the status once it ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._buffer or self._status is not None, timeout)
            data = bytes(self._buffer)
            self._buffer.clear()
            self._cond.notify_all()  # the reader may be waiting for room
            # The status is set after the output's end: once it is, the buffer was complete.
            return OutputChunk(data, self._status)

    def signal(self, sig: int) -> None:
        if self._pid and self._status is None:
            signal_group(self._pid, sig)

    def result(self) -> bytes | None:
        """What ``lightning_elastic.function_worker`` wrote: the pickled (rank, return value)."""
        if self._dir is None:
            return None
        try:
            with open(os.path.join(self._dir, RESULT_FILE), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _run(
        self, command: list[str], env: dict[str, str], secret: str, cwd: str, started: queue.Queue[int | OSError]
    ) -> None:
        try:
            proc = spawn_worker(command, env, secret, cwd, subprocess.PIPE, protocol.ENV_SECRET_FD)
        except OSError as err:
            started.put(err)
            return
        started.put(proc.pid)

        # What the worker leaves in its group holds its output pipe open: the read below
        # would never see EOF. Ended at its exit, before the reap below.
        leftovers = threading.Thread(target=end_leftovers_at_exit, args=(proc.pid,), name="worker-leftovers",
                                     daemon=True)
        leftovers.start()
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            with self._cond:
                self._cond.wait_for(lambda: len(self._buffer) < BUFFER_LIMIT)
                self._buffer += chunk
                self._cond.notify_all()
        leftovers.join()  # the worker has exited: bounded
        status = proc.wait()
        with self._cond:
            self._status = status
            self._cond.notify_all()
