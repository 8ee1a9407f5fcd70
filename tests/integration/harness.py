"""Runs ``lightning-elastic launch`` as a user would and reads what happened from its logs.

A ``Job`` owns one launch: a discovery file the test rewrites during the run, the driver's
output, and the example's per-worker JSON-lines events. Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "elastic_loop.py"
LAUNCHER = Path(sys.executable).parent / "lightning-elastic"
CAPTURE_SECRET = Path(__file__).resolve().parent / "capture_secret.py"
LATE_REPLIES = Path(__file__).resolve().parent / "late_replies.py"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Job:
    def __init__(self, workdir: Path, launcher: Path = LAUNCHER) -> None:
        self.dir = workdir
        self.launcher = launcher  # the lightning-elastic executable (another venv's for the wheel test)
        self.events_dir = workdir / "events"
        self.hosts_file = workdir / "hosts.txt"
        self.script = workdir / "discover.sh"
        self.stdout_path = workdir / "driver.out"
        self.stderr_path = workdir / "driver.err"
        self.secret_path = workdir / "secret"
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    # ----- set-up ---------------------------------------------------------------------

    def set_hosts(self, *hosts: str) -> None:
        """Rewrite the discovery file atomically (the script may run at any moment)."""
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}\n" for h in hosts))
        os.replace(tmp, self.hosts_file)

    def discovery_script(self, body: str | None = None) -> Path:
        self.script.write_text(body or f"#!/bin/sh\ncat {self.hosts_file}\n")
        self.script.chmod(0o755)
        return self.script

    def start(self, launch_args: Sequence[str], example_args: Sequence[str] = (),
              command: Sequence[str] | None = None, capture_secret: bool = False,
              env: dict[str, str] | None = None, driver: Sequence[str] | None = None) -> None:
        """Start the driver; ``capture_secret`` lets ``secret()`` read the job secret later;
        ``env``: the driver's environment (default: this process's); ``driver``: the command
        that stands for ``lightning-elastic`` (a test helper that wraps it, say)."""
        cmd = [*(driver or [str(self.launcher)]), "launch", *launch_args]
        if command is None:
            command = [sys.executable, str(EXAMPLE), "--events", str(self.events_dir), *example_args]
        if capture_secret:
            command = [sys.executable, str(CAPTURE_SECRET), str(self.secret_path), *command]
        env = dict(os.environ if env is None else env)
        env.pop("LIGHTNING_ELASTIC_DRIVER_URL", None)
        if self.launcher != LAUNCHER:
            env.pop("PYTHONPATH", None)  # nothing of the checkout: only what the other venv installed
        self.proc = subprocess.Popen(
            [*cmd, *command], cwd=self.dir, env=env,
            stdout=open(self.stdout_path, "wb"), stderr=open(self.stderr_path, "wb"),  # noqa: SIM115
        )

    def run(self, launch_args: Sequence[str], example_args: Sequence[str] = (), timeout: float = 180) -> int:
        self.start(launch_args, example_args)
        return self.wait(timeout)

    def wait(self, timeout: float = 180) -> int:
        assert self.proc is not None
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stacks = self.stacks()  # before the kill: what every process was stuck in
            self.kill()
            raise AssertionError(
                f"the job did not end within {timeout} s:\n{self.stderr()[-3000:]}\n{stacks}"
            ) from None
        return self.returncode

    def stacks(self) -> str:
        """``py-spy dump --native`` of every process of this job still running (driver included)."""
        py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        parts = []
        for proc in self.stray_processes():
            if py_spy is None:
                parts.append(f"--- pid {proc.pid}: py-spy not installed, no stack ---")
                continue
            try:
                out = subprocess.run([py_spy, "dump", "--native", "--pid", str(proc.pid)], capture_output=True,
                                     text=True, timeout=30)
                parts.append(f"--- pid {proc.pid} ---\n{out.stdout}{out.stderr}")
            except (OSError, subprocess.TimeoutExpired) as err:
                parts.append(f"--- pid {proc.pid}: py-spy failed: {err} ---")
        return "\n".join(parts)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    # ----- what happened --------------------------------------------------------------

    def secret(self, timeout: float = 60) -> str:
        """The job secret, as a worker started with ``capture_secret`` received it."""
        wait_for(self.secret_path.exists, timeout, "a worker to receive the job secret")
        return self.secret_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""

    def reason(self) -> str:
        """The last line on stderr: the driver's one-line verdict."""
        lines = [line for line in self.stderr().splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        found = []
        if self.events_dir.exists():
            for path in sorted(self.events_dir.glob("*.jsonl")):
                for line in path.read_text().splitlines():
                    if line.strip():
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue  # a line being written right now
                        if kind is None or event["kind"] == kind:
                            found.append(event)
        return found

    def rounds_formed(self) -> list[int]:
        """World size of each round, from the driver's log."""
        return [int(m) for m in re.findall(r"Round \d+ formed with (\d+) worker", self.stderr())]

    def world_sizes(self) -> list[int]:
        m = re.search(r"world sizes: ([\d >-]+)\)", self.stderr())
        return [int(x) for x in m.group(1).split("->")] if m else []

    def wait_rounds(self, count: int, timeout: float = 90) -> None:
        wait_for(lambda: len(self.rounds_formed()) >= count or self._ended(), timeout, f"round {count}")
        assert len(self.rounds_formed()) >= count, f"job ended before round {count}:\n{self.stderr()[-3000:]}"

    def wait_steps(self, step: int, timeout: float = 90) -> None:
        """Until some worker logged training step ``step`` (after the latest round formed)."""
        wait_for(lambda: max((e["step"] for e in self.events("step")), default=0) >= step or self._ended(),
                 timeout, f"step {step}")
        assert not self._ended(), f"job ended before step {step}:\n{self.stderr()[-3000:]}"

    def worker_pid(self, host: str) -> int:
        starts = [e for e in self.events("start") if e["worker"].startswith(f"{host}[")]
        assert starts, f"no worker started on {host}"
        return starts[-1]["pid"]

    def _ended(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stray_processes(self) -> list[psutil.Process]:
        """Processes still running this job's command (identified by its events directory)."""
        return processes_running(str(self.events_dir))


def processes_running(marker: str) -> list[psutil.Process]:
    """Processes other than this one whose command line contains ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()) and proc.pid != os.getpid():
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_epochs_complete(job: Job, epochs: int) -> None:
    """Every epoch's committed history held each sample exactly once, on every rank."""
    ends = job.events("epoch_end")
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for e in ends:
        by_epoch.setdefault(e["epoch"], []).append(e)
    assert sorted(by_epoch) == list(range(epochs)), f"epochs ended: {sorted(by_epoch)}"
    for epoch, items in by_epoch.items():
        for e in items:
            assert e["complete"], f"epoch {epoch} on rank {e['rank']}: not exactly once: {e}"


def assert_replicas_identical(job: Job) -> None:
    """After every sync (the start of every round) all ranks hold the same parameters."""
    by_round: dict[int, set[float]] = {}
    sizes: dict[int, int] = {}
    counts: dict[int, int] = {}
    for e in job.events("synced"):
        by_round.setdefault(e["round"], set()).add(e["checksum"])
        sizes[e["round"]] = e["size"]
        counts[e["round"]] = counts.get(e["round"], 0) + 1
    assert by_round, "no sync recorded"
    for number, checksums in by_round.items():
        assert len(checksums) == 1, f"round {number}: replicas differ: {checksums}"
    done = {e["checksum"] for e in job.events("done")}
    assert len(done) == 1, f"final replicas differ: {done}"
