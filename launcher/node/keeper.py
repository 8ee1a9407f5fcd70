"""A local worker's keeper, with ``--state-dir``: ``python -I keeper.py STATUS SECRET_FD_VARIABLE MARK -- COMMAND...``.

Without a state dir a local worker is the driver's child and dies with it. With one it must
outlive the driver, yet a restarted driver must still learn how it ended, and a process
that is not one's child leaves no exit status to read. So the driver starts this small
keeper in a session of its own (no PR_SET_PDEATHSIG), and the keeper starts the worker in
its process group, waits for it, writes its status (as ``Popen.returncode``: negative for a
signal) atomically to the file STATUS, and ends the group (what the worker left there, then
itself: SIGKILL, the status being written). When STATUS cannot be written (a full or
failing state dir) it ends the rest of the group and then exits as the worker did (its
status, or its signal), so that the driver, its parent, still learns the real exit; only
a driver that adopts it later sees it as killed.

- Output: the worker inherits the keeper's stdout, a file in the state dir opened for
  appending, which the driver follows. Nothing breaks when the driver dies.
- Signals: the driver signals the keeper's process group, which reaches the worker and
  everything it started. The keeper ignores SIGTERM, SIGINT and SIGHUP itself (a handler,
  not SIG_IGN, which the worker would inherit) so that it stays to write the status; a
  SIGKILL of the group kills it too, and the worker with it (PR_SET_PDEATHSIG).
- The secret: the pipe named by the variable SECRET_FD_VARIABLE passes through to the worker.
- MARK: derived from the job's secret and the worker's id (``processes/detached.py``
  ``keeper_mark``); unused here, it is on the command line for a restarted driver to check
  that a pid its state names is this job's keeper before it adopts (and signals) it.

Standard library only, and run by its path with ``-I``: it imports nothing of ours (nor the
workers' PYTHONPATH and its sitecustomize), so it starts in a few milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
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
    try:
        with open(tmp, "w") as f:
            f.write(f"{status}\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _end_group_but_me() -> None:
    """SIGKILL every other process of this keeper's process group (what the worker left),
    found in /proc, until none is left (a process forking meanwhile is found next round)."""
    me = os.getpid()
    for _ in range(100):  # bounded: a fork bomb outrunning the scan is left to the kernel's limits
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == me and fields[0] not in (b"Z", b"X"):  # field 5, pgrp: our group
                found = True
                with contextlib.suppress(OSError):
                    os.kill(int(entry), signal.SIGKILL)
        if not found:
            return


def _exit_as(status: int) -> None:
    """End this process as the worker ended: its exit status, or killed by its signal (the
    driver, our parent, reads it then, as ``Popen.returncode``)."""
    if status >= 0:
        os._exit(status)
    sig = -status
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker's SIGSEGV is no core of ours
    with contextlib.suppress(OSError, ValueError):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is not to end a process: the shell's convention


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print("usage: keeper STATUS SECRET_FD_VARIABLE MARK -- COMMAND...", file=sys.stderr)
        return 2
    status_path, secret_fd_variable, command = argv[0], argv[1], argv[4:]
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
    try:
        write_status(status_path, status)
    except OSError as err:
        # A full or failing state dir (ENOSPC, EIO): what the worker left must still end, and
        # the driver, our parent, still learn the real exit, from our own.
        with contextlib.suppress(OSError, ValueError):  # our stdout is a file there too
            print(f"lightning-elastic: cannot write {status_path} ({err.strerror or err}): the worker's exit "
                  f"status ({status}) is this keeper's own", file=sys.stderr, flush=True)
        if os.getpgrp() == os.getpid():
            _end_group_but_me()
        _exit_as(status)
    # What the worker left in the group (a data loader's workers, a tool it started) ends
    # with it, this keeper last: the group is the keeper's own, its id safe while it lives.
    if os.getpgrp() == os.getpid():  # always, as started (a session of its own); never another's group
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
