"""In a child of the fork server: becoming the worker a client asked for, and running it.

``become`` makes the forked process what a cold start would have been: a session of its own
(signals to its group reach all it starts), death with the server (as a cold worker dies
with its parent), default signal handling, the client's descriptors 0-2 and secret pipe,
its environment (with what the preloaded modules set at import, as a cold start's imports
would), and its working directory. ``run`` then runs COMMAND's script or module as
``__main__``, with standard streams buffered as a cold interpreter's and fresh random
seeds; an uncaught exception is shown as Python shows it, from the script's own frame.
"""

from __future__ import annotations

import io
import os
import random
import runpy
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from lightning_elastic.launcher.node.fork_rules import Program
from lightning_elastic.launcher.node.spawn import die_with_parent_preexec


@dataclass(frozen=True)
class WorkerRequest:
    """What a client asked for, as the child needs it."""

    program: Program
    env: dict[str, str]
    cwd: str
    fds: list[int]  # received: stdin, stdout, stderr, then the secret pipe if any
    secret_fd: int | None  # the number the secret pipe must have (named by the environment)


def become(request: WorkerRequest, import_changes: Mapping[str, str], import_removals: Sequence[str]) -> None:
    """Take on the client's process (the server's own resources are closed already)."""
    server = os.getppid()
    os.setsid()  # its own process group, as a worker started cold: signals reach all it starts
    die = die_with_parent_preexec()
    if die is not None:
        die()  # type: ignore[operator]
    if os.getppid() != server:  # the server died before the line above: so must this
        os._exit(1)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    targets = [0, 1, 2] + ([int(request.secret_fd)] if request.secret_fd is not None else [])
    # Received descriptors may sit on the numbers they go to: move them out of the way first.
    moved = [os.dup(fd) for fd in request.fds]
    for fd in request.fds:
        os.close(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request.env)
    os.environ.update(import_changes)  # what the imports did to a cold start's environment too
    for name in import_removals:
        os.environ.pop(name, None)
    os.chdir(request.cwd)


def run(request: WorkerRequest) -> int:
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
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
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


def _ours(filename: str) -> bool:
    """A frame of the fork server's (this package's) or runpy's, above the program's own."""
    return (os.path.dirname(filename) == os.path.dirname(__file__)
            or filename in (runpy.__file__, "<frozen runpy>"))
