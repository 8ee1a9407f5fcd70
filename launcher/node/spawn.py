"""Starting one worker process on the machine it runs on (used locally and by the ssh supervisor).

The worker runs in its own session (process group), so a signal reaches every process it
started (data-loader workers), and what it leaves there when it exits is ended with it
(``end_leftovers``); it gets SIGKILL when its parent dies (PR_SET_PDEATHSIG), so it never
outlives the driver or the supervisor even when they are SIGKILLed (with
``--state-dir`` a keeper is started without it instead, see keeper.py). The job
secret reaches it through an inherited pipe, never the command line or the environment,
where ``ps`` would show it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO

from lightning_elastic.launcher.errors import StartError

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the driver's own shutdown path still stops workers


def die_with_parent_preexec() -> object:
    """``preexec_fn`` for any child that must not outlive this process (None off Linux)."""
    return _die_with_parent if sys.platform.startswith("linux") else None


def start_supervisor_client(argv: Sequence[str], host: str,
                            env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the local end (``ssh``, ``srun``) of a worker's supervisor on ``host``: pipes
    for the start message and signals, the worker's output and the client's own errors; a
    session of its own (a Ctrl-C at the driver's terminal is the driver's to handle); it
    dies with the driver. A client that cannot run is one line naming it and the host."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(),  # type: ignore[arg-type]
            env=env,
        )
    except OSError as err:  # no ssh client or srun here: no worker can start this way
        raise StartError(f"cannot run {argv[0]} to start a worker on {host}: {err.strerror or err}") from None


def spawn_worker(
    command: Sequence[str],
    env: Mapping[str, str],
    secret: str,
    cwd: str | None,
    stdout: int | IO[bytes],
    secret_fd_variable: str,
    die_with_parent: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``command`` with ``secret`` readable once from the fd in ``secret_fd_variable``.

    stdout and stderr both go to ``stdout`` (a pipe or an inherited descriptor). This module
    is standard-library only: the ssh supervisor imports it on hosts where importing the
    worker runtime (torch) would cost seconds per start. ``die_with_parent`` False: the
    process outlives this one (``--state-dir``'s keeper, see keeper.py).
    """
    read_end, write_end = os.pipe()
    try:
        # 64 bytes fit in any pipe buffer: the write cannot block before the child reads.
        os.write(write_end, secret.encode())
        os.close(write_end)
        write_end = -1
        child_env = dict(env)
        child_env[secret_fd_variable] = str(read_end)
        return subprocess.Popen(
            list(command),
            env=child_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(read_end,),
            preexec_fn=die_with_parent_preexec() if die_with_parent else None,  # type: ignore[arg-type]
        )
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def exited(pid: int, block: bool = False) -> bool:
    """Has this process's child ``pid`` exited, and is it not reaped yet? Asked without
    reaping it (``WNOWAIT``): until it is reaped its pid, and so its process group's id, is
    no other process's, and the group can be signalled safely (see ``end_leftovers``).
    False while it runs, and once it has been reaped (its group's id may be another's then).
    ``block``: wait for the exit."""
    flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
    try:
        return os.waitid(os.P_PID, pid, flags) is not None
    except ChildProcessError:
        return False


def end_leftovers(pid: int) -> None:
    """SIGKILL what an exited worker left in its process group (a data loader's workers, a
    server or tool it started): nothing it started outlives it, as under torchrun. Only
    when ``exited`` says so: the group's id is still the worker's."""
    signal_group(pid, signal.SIGKILL)


def end_leftovers_at_exit(pid: int) -> None:
    """Wait for the child ``pid`` to exit, then end what it left in its group; the caller reaps it."""
    if exited(pid, block=True):
        end_leftovers(pid)


def signal_group(pid: int, sig: int) -> None:
    """Signal the worker's whole process group; a group that is gone is not an error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
