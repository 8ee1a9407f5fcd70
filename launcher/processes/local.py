"""Worker processes on this machine: a subprocess per worker, its output prefixed."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from typing import IO

from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.hosts.network import collective_interface_env
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, as_sink
from lightning_elastic.launcher.node.spawn import end_leftovers, exited, signal_group, spawn_worker
from lightning_elastic.protocol import ENV_SECRET_FD


class LocalLauncher:
    """Starts workers as children of the driver, with the driver's environment underneath."""

    def __init__(self, out: IO[str] | OutputSink | None = None) -> None:
        self._sink = as_sink(out)  # one for all its workers: a broken stdout is reported once

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> LocalProcess:
        env = {**os.environ, **spec.env}
        if "MASTER_ADDR" in env:  # collectives go out through the interface that reaches the driver
            env.update(collective_interface_env(env, env["MASTER_ADDR"]))
        try:
            proc = spawn_worker(spec.command, env, spec.secret, spec.cwd, subprocess.PIPE, ENV_SECRET_FD)
        except OSError as err:  # the command cannot be executed here (gone, or not executable)
            raise StartError(f"COMMAND: {spec.command[0]}: {err.strerror or err}") from None
        assert proc.stdout is not None
        forwarder = LineForwarder(proc.stdout, prefix, spec.log_file, self._sink, f"output-{proc.pid}")
        forwarder.start()
        return LocalProcess(proc, forwarder)


class LocalProcess:
    def __init__(self, proc: subprocess.Popen[bytes], forwarder: LineForwarder) -> None:
        self._proc = proc
        self._forwarder = forwarder

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def child_pid(self) -> int | None:
        return self._proc.pid

    def poll(self) -> int | None:
        if self._proc.returncode is None and exited(self._proc.pid):
            end_leftovers(self._proc.pid)  # before the reap, while the group's id is the worker's
        return self._proc.poll()

    def signal(self, sig: int) -> None:
        signal_group(self._proc.pid, sig)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.02)  # Popen.wait would reap before the group's leftovers are ended
        return status

    def finish_output(self, timeout: float = 5.0) -> None:
        self._forwarder.join(timeout)

    def last_line(self) -> str:
        return self._forwarder.last_line

    def exit_detail(self) -> str:
        return ""
