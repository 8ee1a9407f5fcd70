"""A worker started warm: ``python -m lightning_elastic.launcher.node.fork_client TOKEN SECRET_FD_VARIABLE -- COMMAND...``.

With ``--preload`` the driver starts each worker as this small client instead of COMMAND
itself, on the worker's host, in the worker's environment. The client asks the host's fork
server (``fork_server.py``, which has imported the preloaded modules once, and listens in
the directory that TOKEN names) to fork a process that runs COMMAND's script, and then
stands in for that process towards whoever started it (the driver, or an ssh supervisor):

- its exit status is the worker's (``exit`` from the server; a worker killed by a signal
  is reproduced by the client killing itself with that signal, so ``Popen.returncode``
  reads the same as for a worker started cold);
- signals sent to it (the driver signals its process group) are forwarded to the
  worker's process group; SIGKILL cannot be, so the server kills the worker when this
  client's connection closes (the client died);
- the worker gets the client's own stdin, stdout, stderr and secret pipe (passed over the
  socket), its environment, arguments and working directory.

The server's directory must be this user's alone (mode 0700): the client hands over its
descriptors and the job's secret, and a directory another user made (it could have read
TOKEN in ``ps``) is refused. Whenever no server can serve the request (none listening, a
preload that failed, a COMMAND it does not run, an environment other than the one it
imported under), the client says why in one line and execs COMMAND itself: a cold start,
as without ``--preload``.

Standard library only: it starts in a few tens of milliseconds. The messages, one JSON
object per line, are defined here and used by the server too:

- client -> server: ``{"command", "env", "cwd", "secret_fd"}``, the descriptors 0, 1, 2
  (and the secret pipe, when ``secret_fd`` is set) attached to its first bytes;
- server -> client: ``{"pid": N}`` then ``{"exit": STATUS}``, or ``{"cold": "why"}``.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import stat
import sys
import time

MARK = "lightning-elastic:"
# A server still importing queues the connection: how long the client waits for its answer
# before it starts cold. Generous: the preload is what a cold start would spend anyway.
ANSWER_PATIENCE = 300.0
# The driver starts the server just before the first workers: how long a client waits for
# its socket to appear (a server that failed says so at once, in FAILED).
SERVER_APPEARANCE = 15.0
FAILED = "failed"
DIRECTORY_PREFIX = "lightning-elastic-fork-"  # the file in the server's directory that says why it serves nobody
MAX_MESSAGE = 1 << 20  # bytes: an environment, arguments and a path fit many times over
MAX_DESCRIPTORS = 4
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def send_message(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:  # sendall(b"") still sends: a server that has answered and closed makes it EPIPE
        sock.sendall(data)


class LineReader:
    """One JSON object per line from a stream socket; the descriptors that came with them."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""
        self.fds: list[int] = []

    def next(self) -> dict | None:
        """The next message, or None at EOF. Raises ValueError on a malformed one."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_MESSAGE:
                raise ValueError(f"a message longer than {MAX_MESSAGE} bytes")
            data, ancillary, _flags, _address = self._sock.recvmsg(
                65536, socket.CMSG_SPACE(MAX_DESCRIPTORS * array.array("i").itemsize))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                    self.fds.extend(fds)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError(f"expected a JSON object, got {type(message).__name__}")
        return message


def server_directory(token: str, env: dict[str, str] | os._Environ = os.environ) -> str:
    """Where the fork server of TOKEN listens, on the host both run on."""
    return os.path.join(env.get("TMPDIR") or "/tmp", f"{DIRECTORY_PREFIX}{token}")


def _find_server(token: str) -> str:
    """The server's socket path, once it listens. Raises OSError saying why there is none."""
    directory = server_directory(token)
    path = os.path.join(directory, "socket")
    deadline = time.monotonic() + SERVER_APPEARANCE
    while True:
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise OSError(f"{directory} is not a directory of this user's alone")
            try:
                with open(os.path.join(directory, FAILED)) as f:
                    raise OSError(f.read().strip() or "the fork server failed")
            except FileNotFoundError:
                pass
            if os.path.exists(path):
                return path
        if time.monotonic() > deadline:
            raise OSError(f"no fork server at {directory} after {SERVER_APPEARANCE:g} s")
        time.sleep(0.02)


def _cold(command: list[str], why: str) -> int:
    print(f"{MARK} --preload: {why}: starting cold", file=sys.stderr, flush=True)
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"{MARK} cannot start {command[0]!r}: {err.strerror or err}", file=sys.stderr, flush=True)
        return 127


def _exit_like(status: int) -> int:
    """Exit as the worker did: its code, or killed by its signal."""
    if status < 0:
        try:
            signal.signal(-status, signal.SIG_DFL)  # ours forwards it; SIGKILL has no handler
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -status)
        return 128 - status  # a signal that does not end a process: the shell's convention
    return status


def _forward(pid: int) -> None:
    def handler(sig: int, _frame: object) -> None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # it has ended: its exit is on its way

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: fork_client TOKEN SECRET_FD_VARIABLE -- COMMAND...", file=sys.stderr)
        return 2
    token, secret_fd_variable, command = argv[0], argv[1], argv[3:]
    fd_text = os.environ.get(secret_fd_variable, "")
    secret_fd = int(fd_text) if fd_text.isdigit() else None
    request = {"command": command, "env": dict(os.environ), "cwd": os.getcwd(), "secret_fd": secret_fd}
    try:
        path = _find_server(token)
    except OSError as err:
        return _cold(command, str(err))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ANSWER_PATIENCE)
        sock.connect(path)
        send_message(sock, request, (0, 1, 2) + ((secret_fd,) if secret_fd is not None else ()))
        reader = LineReader(sock)
        answer = reader.next()
    except (OSError, ValueError) as err:  # socket.timeout is an OSError
        sock.close()
        return _cold(command, f"the fork server did not answer ({err})")
    if answer is None or "pid" not in answer:
        sock.close()
        why = answer.get("cold", "the fork server did not say") if answer else "the fork server closed the connection"
        return _cold(command, str(why))
    pid = int(answer["pid"])
    _forward(pid)
    sock.settimeout(None)
    try:
        ended = reader.next()
    except (OSError, ValueError):
        ended = None
    if ended is None or "exit" not in ended:
        # The server is gone, and its workers with it (they die with it): nobody can say
        # how this one ended.
        print(f"{MARK} the fork server ended while worker process {pid} ran", file=sys.stderr, flush=True)
        return 1
    return _exit_like(int(ended["exit"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
