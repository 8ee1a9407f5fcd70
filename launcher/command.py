"""The training command: how a bare ``train.py`` runs, and whether the command can run at all.

Checked before anything starts, so that a typo is one line with exit status 2 and not a
traceback from the first worker's start. The check is the one ``exec`` makes on this
machine, with the driver's ``PATH`` and working directory, which every worker shares (local
workers inherit them; remote ones get the driver's ``PATH`` and directory, on hosts with the
same paths). A job on Ray is not checked: its nodes may lay files out differently.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_elastic.launcher.errors import ConfigError


def with_python(command: Sequence[str], python: str = sys.executable) -> tuple[str, ...]:
    """``train.py ARGS`` as torchrun runs it, with the driver's Python; any other command as given.

    A script is rarely executable and its shebang may name another interpreter than the
    venv's: the driver's own interpreter is the one the job's hosts are known to have.
    """
    if command and command[0].endswith(".py"):
        return (python, *command)
    return tuple(command)


def check_command(command: Sequence[str], cwd: str | Path, path: str | None) -> None:
    """Raise ConfigError unless ``command[0]`` is a program a worker here can execute.

    ``path`` is the ``PATH`` the worker searches (the driver's); a name without a slash is
    looked up there only, never in ``cwd``, as ``exec`` does.
    """
    if not command:
        return  # LaunchConfig says that the command is missing
    program = command[0]
    if os.sep not in program:
        if shutil.which(program, path=path) is None:
            here = os.path.isfile(os.path.join(cwd, program))  # (False for any error: only a hint)
            hint = f" (to run the file here, write ./{program})" if here else ""
            raise ConfigError(f"COMMAND: {program}: no such program on PATH{hint}")
        return
    file = Path(cwd, program)
    st = _stat(program, file)
    if st is None:
        raise ConfigError(f"COMMAND: {program}: no such file")
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"COMMAND: {program}: is a directory, expected a program or a script")
    if not os.access(file, os.X_OK):
        raise ConfigError(f"COMMAND: {program}: not executable (chmod +x it, or name its interpreter first)")


def check_script(command: Sequence[str], cwd: str | Path) -> None:
    """For ``train.py`` run with the driver's Python (``with_python``): the script must exist."""
    st = _stat(command[1], Path(cwd, command[1]))
    if st is None or not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"COMMAND: {command[1]}: no such file")


def _stat(given: str, file: Path) -> os.stat_result | None:
    """``file``'s status (following links), None when it does not exist; any other reason
    it cannot be looked at (a directory on the way this user cannot search, a name too
    long, a loop of symbolic links) is one line naming the input as given."""
    try:
        return file.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"COMMAND: {given}: cannot be examined ({reason}), expected a program or a script "
                          "this user can reach") from None
