"""A host's warm interpreter: imports the ``--preload`` modules once, then forks workers.

``python -m lightning_elastic.launcher.processes.fork_server TOKEN MODULE[,MODULE...] [-- COMMAND...]``

(COMMAND, the workers' command, is only shown: ``ps`` then names the job's script for the
workers forked from this server, which show its command line.)

Without it every worker started on a machine imports torch and Lightning itself: about 4 s
of CPU each here, spent again by every replacement, and by every worker of a job that
starts eight on one machine at once. With it, the driver starts one server per machine
(``warm_start.py``), the way it starts a worker there (locally, or through ssh), with the
workers' interpreter and environment. The server makes a directory named by TOKEN that
only its user may enter, listens there, imports the modules once, and serves
``fork_client.py`` requests (peers of another user are refused all the same). For each
request it forks a child that becomes the worker: a session of its own, the client's
descriptors, environment, arguments and working directory, the random generators
reseeded, then COMMAND's script run as ``__main__``.

A worker forked this way differs from one started cold in what the preloaded modules did
at import time, so the server forks only when that cannot matter, and answers ``cold``
(with the reason) otherwise: COMMAND must run this very interpreter on a script or a
module (``python [-u] SCRIPT ...`` or ``python [-u] -m MODULE ...``); the environment
must be the one the server imported under, except the variables that differ per worker
(ranks, ids, interfaces, devices: read after start-up, never at import); and the server
must still be a single thread (a fork copies only the forking thread: a lock another
thread held would stay held forever in the child) without a CUDA context.

The server dies with whatever started it (PR_SET_PDEATHSIG, as a worker: the driver, or
the ssh supervisor whose connection is its lifeline), and each child with the server; a
child whose client has gone (SIGKILLed with its process group) is SIGKILLed. SIGTERM ends
the server and removes its directory. The python hash seed is the server's, shared by the
workers it forks.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import io
import os
import random
import runpy
import selectors
import shutil
import signal
import socket
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from lightning_elastic.launcher.processes.fork_client import (
    DIRECTORY_PREFIX,
    FAILED,
    LineReader,
    send_message,
    server_directory,
)
from lightning_elastic.protocol import ENV_SECRET_FD

_PR_SET_PDEATHSIG = 1
REQUEST_PATIENCE = 5.0  # seconds a connected client gets to send its request
LOCK = "lock"  # in the server's directory: held while it lives (see remove_abandoned)
LISTEN_QUEUE = 4096  # clients queue here while the server imports: every worker of a big first round
# Set per worker by the driver or its launcher, and read by a worker after it starts
# (never by an import): a difference in these does not make a fork differ from a cold start.
PER_WORKER = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES",
    # Set by sshd (and PAM) per connection: each worker on another host has its own ssh session.
    "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "XDG_SESSION_ID",
})
PER_WORKER_PREFIXES = ("LIGHTNING_ELASTIC_",)


def per_worker(name: str) -> bool:
    return name in PER_WORKER or name.startswith(PER_WORKER_PREFIXES)


def environment_difference(ours: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The names, outside the per-worker ones, whose values differ (or exist on one side only)."""
    names = {n for n in ours.keys() | theirs.keys() if not per_worker(n)}
    return sorted(n for n in names if ours.get(n) != theirs.get(n))


@dataclass(frozen=True)
class Program:
    """What COMMAND runs in this interpreter: a script's path or a module's name."""

    script: str | None  # absolute, as ``__main__.__file__`` is
    module: str | None
    args: tuple[str, ...]
    unbuffered: bool
    argv0: str = ""  # the script as COMMAND names it: ``sys.argv[0]`` of a cold start


def parse_command(command: list[str], env: Mapping[str, str], cwd: str) -> Program | str:
    """The program COMMAND runs, or why it cannot be forked from this interpreter."""
    if not command:
        return "an empty command"
    found = shutil.which(command[0], path=env.get("PATH")) if os.sep not in command[0] else command[0]
    executable = os.path.abspath(os.path.join(cwd, found)) if found else None
    # The same file in the same directory: a venv's python is a link to the base
    # interpreter, which another venv links to too.
    if executable is None or not _same_interpreter(executable):
        return f"{command[0]!r} is not this fork server's interpreter ({sys.executable})"
    rest = command[1:]
    unbuffered = bool(rest) and rest[0] == "-u"
    rest = rest[1:] if unbuffered else rest
    if len(rest) >= 2 and rest[0] == "-m":
        return Program(None, rest[1], tuple(rest[2:]), unbuffered)
    if not rest or rest[0].startswith("-"):
        return "only 'python [-u] SCRIPT ...' and 'python [-u] -m MODULE ...' are forked"
    return Program(os.path.join(cwd, rest[0]), None, tuple(rest[1:]), unbuffered, rest[0])


def _same_interpreter(executable: str) -> bool:
    try:
        return (os.path.dirname(executable) == os.path.dirname(os.path.abspath(sys.executable))
                and os.path.samefile(executable, sys.executable))
    except OSError:
        return False


def _cuda_initialized() -> bool:
    """Has anything in the server created a CUDA context? A child forked after that cannot
    use CUDA at all (torch refuses: "Cannot re-initialize CUDA in forked subprocess").
    Importing torch and Lightning creates none (Lightning asks NVML, not CUDA, for devices)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch too broken to say: do not fork from it
        return True


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


@dataclass
class _Request:
    conn: socket.socket
    program: Program
    env: dict[str, str]
    cwd: str
    fds: list[int]  # stdin, stdout, stderr, then the secret pipe if any
    secret_fd: int | None


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
        return _Request(conn, why, env, cwd, reader.fds, secret_fd)

    def _examine(self, command: list, env: dict, cwd: str, fds: list[int], secret_fd: object) -> Program | str:
        expected = 3 + (secret_fd is not None)
        if len(fds) != expected:
            return f"{len(fds)} descriptors came with the request, not {expected}"
        difference = environment_difference(self._env, env)
        if difference:
            shown = ", ".join(difference[:5]) + (f" and {len(difference) - 5} more" if len(difference) > 5 else "")
            return f"the environment differs from the fork server's in {shown}"
        threads = _thread_count()
        if threads != 1:
            return f"the fork server runs {threads} threads (started by a preloaded module): forking it is unsafe"
        if _cuda_initialized():
            return "a preloaded module initialised CUDA in the fork server: a forked worker could not use it"
        return parse_command(command, env, cwd)

    def _fork(self, request: _Request) -> bool:
        """Fork the worker; True in the child."""
        try:
            pid = os.fork()
        except OSError as err:
            _close_all(request.fds)
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
        _close_all(request.fds)
        try:
            request.conn.settimeout(REQUEST_PATIENCE)
            send_message(request.conn, {"pid": pid})
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
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self._children.pop(pid, None)
            if conn is not None:
                self._selector.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.setblocking(True)
                    conn.settimeout(REQUEST_PATIENCE)
                    send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _leave_server(self, request: _Request) -> None:
        """In the child: shed everything of the server, take on the client's process."""
        server = os.getppid()
        os.setsid()  # its own process group, as a worker started cold: signals reach all it starts
        _die_with_parent()
        if os.getppid() != server:  # the server died before the line above: so must this
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
        targets = [0, 1, 2] + ([int(request.secret_fd)] if request.secret_fd is not None else [])
        # Received descriptors may sit on the numbers they go to: move them out of the way first.
        moved = [os.dup(fd) for fd in request.fds]
        _close_all(request.fds)
        for fd, target in zip(moved, targets):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request.env)
        os.environ.update(self._import_changes)  # what the imports did to a cold start's environment too
        for name in self._import_removals:
            os.environ.pop(name, None)
        os.chdir(request.cwd)


def run(request: _Request) -> int:
    """Run the request's program as ``__main__`` (in the forked child)."""
    program = request.program
    unbuffered = program.unbuffered or bool(request.env.get("PYTHONUNBUFFERED"))
    _reopen_standard_streams(unbuffered)
    _reseed()
    try:
        if program.module is not None:
            sys.argv = ["-m", *program.args]  # runpy puts the module's path in sys.argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(program.module, run_name="__main__", alter_sys=True)
        else:
            assert program.script is not None
            sys.argv = [program.argv0 or program.script, *program.args]
            sys.path[0] = os.path.dirname(os.path.realpath(program.script))
            runpy.run_path(program.script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling: the exit code, or death by SIGINT
    except BaseException as err:  # noqa: BLE001 - reported as the interpreter would, then exit 1
        trimmed = _user_frames(err.__traceback__)
        sys.excepthook(type(err), err.with_traceback(trimmed), trimmed)
        return 1
    return 0


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the program's first frame: a cold start shows none of ours or runpy's."""
    first = tb
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb or first


def _reopen_standard_streams(unbuffered: bool) -> None:
    """New text streams on descriptors 0-2, buffered as a cold interpreter would buffer them."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    streams = []
    for fd, mode in ((0, "rb"), (1, "wb"), (2, "wb")):
        raw = io.FileIO(fd, mode, closefd=False)
        tty = raw.isatty()
        buffered = io.BufferedReader(raw) if mode == "rb" else io.BufferedWriter(raw)
        streams.append(io.TextIOWrapper(
            buffered, encoding=encoding, errors="backslashreplace" if fd == 2 else errors,
            line_buffering=tty or fd == 2, write_through=unbuffered and mode == "wb"))
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]


def _reseed() -> None:
    """Each worker draws its own random numbers, as a cold start would: ``random`` reseeds
    itself at a fork; numpy's global generator does not."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
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
    listener.bind(os.path.join(directory, "socket"))
    listener.listen(LISTEN_QUEUE)
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
            # Said once here, and to every client, which starts cold at once instead of
            # waiting for a socket that will never answer.
            print(f"lightning-elastic: --preload: {failure}: workers start cold", file=sys.stderr, flush=True)
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
    return run(request)  # in a forked worker only


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
