"""Test helper: ``python capture_secret.py OUT COMMAND...`` runs COMMAND as a worker would run.

It reads the job secret from the pipe the launcher passes (as ``le.init()`` would), writes
it to OUT for the test (which then looks for it in ``ps`` output and signs requests with
it), and hands COMMAND the secret through a new pipe, exactly as the launcher does.
"""

import os
import sys

from lightning_elastic.protocol import ENV_SECRET_FD


def main() -> None:
    out, command = sys.argv[1], sys.argv[2:]
    fd = int(os.environ[ENV_SECRET_FD])
    secret = b""
    while chunk := os.read(fd, 4096):
        secret += chunk
    os.close(fd)
    # A temporary file of this process's own: every worker of the job runs this at the same
    # time, and a shared one was moved away under another worker's os.replace (exit 1).
    partial = f"{out}.{os.getpid()}.tmp"
    with open(partial, "wb") as f:
        f.write(secret)
    os.replace(partial, out)
    read_end, write_end = os.pipe()
    os.write(write_end, secret)
    os.close(write_end)
    os.set_inheritable(read_end, True)
    os.environ[ENV_SECRET_FD] = str(read_end)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
