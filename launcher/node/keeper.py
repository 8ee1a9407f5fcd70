"""A local worker's keeper, with ``--state-dir``: ``python -I keeper.py STATUS SECRET_FD_VARIABLE -- COMMAND...``.

Without a state dir a local worker is the driver's child and dies with it. With one it must
outlive the driver, yet a restarted driver must still learn how it ended, and a process
that is not one's child leaves no exit status to read. So the driver starts this small
keeper in a session of its own (no PR_SET_PDEATHSIG), and the keeper starts the worker in
its process group, waits for it, writes its status (as ``Popen.returncode``: negative for a
signal) atomically to the file STATUS, and ends the group (what the worker left there, then
itself: SIGKILL, the status being written).

- Output: the worker inherits the keeper's stdout, a file in the state dir opened for
  appending, which the driver follows. Nothing breaks when the driver dies.
- Signals: the driver signals the keeper's process group, which reaches the worker and
  everything it started. The keeper ignores SIGTERM, SIGINT and SIGHUP itself (a handler,
  not SIG_IGN, which the worker would inherit) so that it stays to write the status; a
  SIGKILL of the group kills it too, and the worker with it (PR_SET_PDEATHSIG).
- The secret: the pipe named by the variable SECRET_FD_VARIABLE passes through to the worker.

Standard library only, and run by its path with ``-I``: it imports nothing of ours (nor the
workers' PYTHONPATH and its sitecustomize), so it starts in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_keeper() -> None:  # in the child, between fork and exec (as spawn.py's)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def write_status(path: str, status: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{status}\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: keeper STATUS SECRET_FD_VARIABLE -- COMMAND...", file=sys.stderr)
        return 2
    status_path, secret_fd_variable, command = argv[0], argv[1], argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda _s, _f: None)
    fd_text = os.environ.get(secret_fd_variable, "")
    pass_fds = (int(fd_text),) if fd_text.isdigit() else ()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=pass_fds,
                                preexec_fn=_die_with_keeper if sys.platform.startswith("linux") else None)
    except OSError as err:
        print(f"lightning-elastic: cannot start {command[0]!r}: {err.strerror or err}", flush=True)
        write_status(status_path, 127)
        return 127
    for fd in pass_fds:
        os.close(fd)  # the worker holds the pipe now; its EOF must not wait for us
    status = proc.wait()
    write_status(status_path, status)
    # What the worker left in the group (a data loader's workers, a tool it started) ends
    # with it, this keeper last: the group is the keeper's own, its id safe while it lives.
    if os.getpgrp() == os.getpid():  # always, as started (a session of its own); never another's group
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
