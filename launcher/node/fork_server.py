"""A host's warm interpreter: imports the ``--preload`` modules once, then forks workers.

``python -m lightning_elastic.launcher.node.fork_server TOKEN MODULE[,MODULE...] [-- COMMAND...]``

(COMMAND, the workers' command, is only shown: ``ps`` then names the job's script for the
workers forked from this server, which show its command line.)

Without it every worker started on a machine imports torch and Lightning itself: about 4 s
of CPU each here, spent again by every replacement, and by every worker of a job that
starts eight on one machine at once. With it, the driver starts one server per machine
(``warm_start.py``), the way it starts a worker there (locally, or through ssh), with the
workers' interpreter and environment. The server makes a directory named by TOKEN that
only its user may enter, listens there, imports the modules once, and serves
``fork_client.py`` requests (peers of another user are refused all the same). For each
request it forks a child that becomes the worker.

It forks only when a fork cannot differ from a cold start (``fork_rules.py``: the same
interpreter on a script or module, the environment it imported under, one thread, no CUDA
context), and answers ``cold`` with the reason otherwise; the child becomes the worker and
runs it (``forked_worker.py``).

The server dies with whatever started it (PR_SET_PDEATHSIG, as a worker: the driver, or
the ssh supervisor whose connection is its lifeline), and each child with the server; a
child whose client has gone (SIGKILLed with its process group) is SIGKILLed, by its pid and
its group (it may not have made its session yet: ``_kill_group``). SIGTERM ends
the server and removes its directory. The python hash seed is the server's, shared by the
workers it forks.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_elastic.launcher.node.fork_client import (
    DIRECTORY_PREFIX,
    FAILED,
    LineReader,
    send_message,
    server_directory,
)
from lightning_elastic.launcher.node.fork_rules import (
    Program,
    cuda_initialized,
    environment_difference,
    parse_command,
    thread_count,
)
from lightning_elastic.launcher.node.forked_worker import WorkerRequest, become, run
from lightning_elastic.protocol import ENV_SECRET_FD

REQUEST_PATIENCE = 5.0  # seconds a connected client gets to send its request
LOCK = "lock"  # in the server's directory: held while it lives (see remove_abandoned)
LISTEN_QUEUE = 4096  # clients queue here while the server imports: every worker of a big first round
@dataclass
class _Request:
    conn: socket.socket  # to the client, which waits for the worker's pid and exit
    worker: WorkerRequest


class Server:
    """The accept, fork and reap loop. ``serve()`` returns only in a forked child, with the
    request it is to run; the server itself runs until it is killed."""

    def __init__(self, listener: socket.socket, env: Mapping[str, str], lock: int) -> None:
        """``env``: the environment the server started with, before the preloaded modules
        changed it (Lightning sets variables of torch's as it is imported); ``lock``: the
        descriptor that holds the directory's lock (a child must not keep it held)."""
        self._listener = listener
        self._lock = lock
        self._env = dict(env)
        self._import_changes = {k: v for k, v in os.environ.items() if env.get(k) != v}
        self._import_removals = [k for k in env if k not in os.environ]
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, socket.socket | None] = {}  # pid -> its client's connection
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)

    def serve(self) -> _Request:
        signal.set_wakeup_fd(self._wake_write)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # a handler, so the wake-up fd is written
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_read, selectors.EVENT_READ, "reap")
        while True:
            for key, _events in self._selector.select():
                if key.data == "accept":
                    request = self._accept()
                    if request is not None and self._fork(request):
                        return request
                elif key.data == "reap":
                    self._reap()
                elif self._children.get(key.data) is key.fileobj:
                    # (Not a connection this batch's reaping already closed: its descriptor
                    # may be a new client's by now.)
                    self._client_gone(key.data, key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> _Request | None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return None
        peer_uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if peer_uid != os.getuid():
            conn.close()
            return None
        conn.settimeout(REQUEST_PATIENCE)
        reader = LineReader(conn)
        try:
            message = reader.next()
            if message is None:
                raise ValueError("no request")
            command, env, cwd, secret_fd = message["command"], message["env"], message["cwd"], message["secret_fd"]
            if not (isinstance(command, list) and isinstance(env, dict) and isinstance(cwd, str)):
                raise ValueError("a malformed request")
        except (OSError, ValueError, KeyError) as err:
            _close_all(reader.fds)
            conn.close()
            print(f"lightning-elastic fork server: a request refused: {err}", file=sys.stderr, flush=True)
            return None
        why = self._examine(command, env, cwd, reader.fds, secret_fd)
        if isinstance(why, str):
            _close_all(reader.fds)
            with contextlib.suppress(OSError):
                send_message(conn, {"cold": why})
            conn.close()
            return None
        return _Request(conn, WorkerRequest(why, env, cwd, reader.fds, secret_fd))

    def _examine(self, command: list, env: dict, cwd: str, fds: list[int], secret_fd: object) -> Program | str:
        expected = 3 + (secret_fd is not None)
        if len(fds) != expected:
            return f"{len(fds)} descriptors came with the request, not {expected}"
        difference = environment_difference(self._env, env)
        if difference:
            shown = ", ".join(difference[:5]) + (f" and {len(difference) - 5} more" if len(difference) > 5 else "")
            return f"the environment differs from the fork server's in {shown}"
        threads = thread_count()
        if threads != 1:
            return f"the fork server runs {threads} threads (started by a preloaded module): forking it is unsafe"
        if cuda_initialized():
            return "a preloaded module initialised CUDA in the fork server: a forked worker could not use it"
        return parse_command(command, env, cwd)

    def _fork(self, request: _Request) -> bool:
        """Fork the worker; True in the child."""
        try:
            pid = os.fork()
        except OSError as err:
            _close_all(request.worker.fds)
            with contextlib.suppress(OSError):
                send_message(request.conn, {"cold": f"fork failed: {err.strerror or err}"})
            request.conn.close()
            return False
        if pid == 0:
            try:
                self._leave_server(request)
            except BaseException as err:  # noqa: BLE001 - never back into the server's code (its clean-up)
                with contextlib.suppress(OSError):
                    os.write(2, f"lightning-elastic: cannot start the worker: {err}\n".encode())
                os._exit(1)
            return True
        _close_all(request.worker.fds)
        try:
            send_message(request.conn, {"pid": pid})  # bounded: the connection still has _accept's timeout
            request.conn.setblocking(False)
            self._selector.register(request.conn, selectors.EVENT_READ, pid)
            self._children[pid] = request.conn
        except OSError:  # the client went away already: so must its worker
            request.conn.close()
            self._children[pid] = None
            _kill_group(pid)
        return False

    def _client_gone(self, pid: int, conn: socket.socket) -> None:
        try:
            if conn.recv(1):
                return  # nothing more is expected; ignore
        except BlockingIOError:
            return
        except OSError:
            pass
        # EOF: the client died (SIGKILLed with its group, most likely) and the worker it
        # stood for must not run on unseen.
        self._selector.unregister(conn)
        conn.close()
        self._children[pid] = None
        _kill_group(pid)

    def _reap(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_read, 4096):
                pass
        while self._children:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if ended is None:
                return
            # What the worker left in its session ends with it; before the reap, while
            # the group's id is still the worker's.
            _kill_group(ended.si_pid)
            pid, status = os.waitpid(ended.si_pid, 0)
            conn = self._children.pop(pid, None)
            if conn is not None:
                self._selector.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.settimeout(REQUEST_PATIENCE)  # blocking again, bounded (the loop made it non-blocking)
                    send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _leave_server(self, request: _Request) -> None:
        """In the child: shed everything of the server's, then become the client's worker."""
        self._selector.close()
        for conn in self._children.values():
            if conn is not None:
                conn.close()
        self._children.clear()
        self._listener.close()
        os.close(self._lock)  # the server's own descriptor keeps the lock
        request.conn.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        become(request.worker, self._import_changes, self._import_removals)


def _kill_group(pid: int) -> None:
    """SIGKILL a forked worker and its session: the worker itself first, by its pid, then
    its process group. A child that has not yet made its session (``setsid`` in
    ``become``) has no group of its own: signalled by group alone, it ran on unsupervised.
    Killed by pid first, it makes none after; and its group's id stays its pid until this
    server reaps it, so the group's signal reaches whatever it started, never another's."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _listen(directory: str) -> tuple[socket.socket, int]:
    """Make the server's directory, this user's alone, hold its lock and listen in it. A
    directory that exists already is never reused: someone else may have made it."""
    os.mkdir(directory, 0o700)
    # Held while the server lives (SIGKILL releases it too), and locked before it has its
    # name: a sweep by another server never finds it free while this one starts.
    lock = os.open(os.path.join(directory, LOCK + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(os.path.join(directory, LOCK + ".new"), os.path.join(directory, LOCK))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound under another name and given its own once listening: a client that finds the
    # socket between bind and listen would be refused (and start cold).
    listener.bind(os.path.join(directory, "socket.new"))
    listener.listen(LISTEN_QUEUE)
    os.rename(os.path.join(directory, "socket.new"), os.path.join(directory, "socket"))
    return listener, lock


def remove_abandoned(parent: str) -> None:
    """Remove the directories of this user's fork servers that died without removing theirs
    (SIGKILLed with their driver): their lock is free. A directory of a live server, or one
    too young to hold its lock yet, is left alone."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(DIRECTORY_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(parent, name)
        try:
            if os.lstat(directory).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(directory, LOCK), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its server lives
        finally:
            os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)


def _preload(modules: list[str]) -> str | None:
    """Import the modules; why one could not be, or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as err:  # noqa: BLE001 - any failure of the import is the user's to see
            return f"the fork server cannot import {name!r} ({type(err).__name__}: {err})"
    return None


def _stop(_sig: int, _frame: object) -> None:
    raise SystemExit(0)  # to the clean-up below: the directory goes with the server


def main(argv: list[str]) -> int:
    if len(argv) < 2 or (len(argv) > 2 and argv[2] != "--"):
        print("usage: fork_server TOKEN MODULE[,MODULE...] [-- COMMAND...]", file=sys.stderr)
        return 2
    token, modules = argv[0], [m for m in argv[1].split(",") if m]
    # Started as a worker is (spawn.py): the job's secret pipe came along; it is no business of ours.
    secret_fd = os.environ.pop(ENV_SECRET_FD, "")
    if secret_fd.isdigit():
        with contextlib.suppress(OSError):
            os.close(int(secret_fd))
    env = dict(os.environ)
    directory = server_directory(token)
    signal.signal(signal.SIGTERM, _stop)
    remove_abandoned(os.path.dirname(directory))
    try:
        listener, lock = _listen(directory)
    except OSError as err:
        print(f"lightning-elastic: --preload: cannot listen in {directory}: {err}", file=sys.stderr, flush=True)
        return 1
    try:
        failure = _preload(modules)
        if failure is not None:
            # Said to every client, which starts cold at once instead of waiting for a socket
            # that will never answer, and says why in its one line: not here too (two lines,
            # "workers start cold" and "starting cold", for one fact).
            listener.close()
            with open(os.path.join(directory, FAILED), "w") as f:
                f.write(failure)
            os.unlink(os.path.join(directory, "socket"))
            while True:
                signal.pause()  # until the driver stops the server
        request = Server(listener, env, lock).serve()
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return run(request.worker)  # in a forked worker only


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
