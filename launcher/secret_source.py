"""The job secret given to the driver and its agents (``--secret-file`` or the environment).

Pushed workers get a secret the driver draws itself; agents connect on their own, so they
and the driver must be given the same one: a file (a Kubernetes Secret mounted) or
``LIGHTNING_ELASTIC_SECRET``. The value is never printed, and the variable is taken out of
this process's environment once read, so no worker inherits it (a worker reads the secret
from a pipe, never from its environment: see ``node/spawn.py``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from lightning_elastic.launcher.errors import ConfigError

ENV_SECRET = "LIGHTNING_ELASTIC_SECRET"
MIN_CHARS = 16  # a secret guessed is a job taken over: ask for real randomness
MAX_CHARS = 4096


def read_secret(secret_file: Path | None, environ: MutableMapping[str, str] | None = None,
                option: str = "--secret-file") -> str:
    """The secret from ``secret_file``, else from ``LIGHTNING_ELASTIC_SECRET`` (removed from
    ``environ``); ConfigError in one line (never quoting the secret) when neither gives one."""
    environ = os.environ if environ is None else environ
    from_env = environ.pop(ENV_SECRET, None)
    if secret_file is not None:
        try:
            text = secret_file.read_text()
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else "not a text file"
            raise ConfigError(f"{option}: cannot read {secret_file}: {why}") from None
        where = f"{option} {secret_file}"
    elif from_env is not None:
        text, where = from_env, ENV_SECRET
    else:
        raise ConfigError(f"{option}: the job secret is needed (a file, e.g. a mounted Kubernetes Secret, or "
                          f"{ENV_SECRET} in the environment); make one with: openssl rand -hex 32")
    secret = text.strip()
    if not MIN_CHARS <= len(secret) <= MAX_CHARS or any(c.isspace() for c in secret):
        raise ConfigError(f"{where}: expected one word of {MIN_CHARS} to {MAX_CHARS} characters (e.g. from "
                          f"openssl rand -hex 32), got {len(secret)} character(s)")
    return secret
