"""What a fork server may fork: the same interpreter on a script or module, in the
environment it imported under, from a process that is still one thread without CUDA.

A worker forked from the server differs from one started cold in what the preloaded
modules did at import time; these are the conditions under which that cannot matter. Each
answer that refuses says why, for the worker's "starting cold" line.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass

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


def cuda_initialized() -> bool:
    """Has anything in the server created a CUDA context? A child forked after that cannot
    use CUDA at all (torch refuses: "Cannot re-initialize CUDA in forked subprocess").
    Importing torch and Lightning creates none (Lightning asks NVML, not CUDA, for devices)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch too broken to say: do not fork from it
        return True


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1
