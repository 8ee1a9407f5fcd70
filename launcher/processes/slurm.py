"""Workers as Slurm job steps: ``srun --overlap --nodes=1 --ntasks=1 -w NODE --jobid JOB``.

Each worker is one single-task step on its node, running the same supervisor as an ssh
start (``supervisor.py``): srun forwards the step's stdin (the start message with the job
secret, then ``signal N`` lines) and its output, and the supervisor reports the worker's
own exit status and the step's id. Two Slurm facts shape this:

- A single-node step on a node that died exits 0. The step's exit status therefore never
  means success: without the supervisor's ``exit`` report the worker is lost (status 255),
  whatever srun says; the worker's DONE report to the driver is what says it finished.
- SIGTERM sent to the srun process makes Slurm SIGKILL the tasks, and killing srun leaves
  the step running. Signals go to the supervisor over the step's stdin (no round trip to
  slurmctld, no process start on the driver's path); a SIGKILL is also sent through Slurm
  (``scancel --signal=KILL JOB.STEP``, from a thread), which reaches the step's every
  process even when its supervisor cannot act.

Without ``--overlap`` (Slurm 22.05+) a second step on a node waits for the first to end.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import IO

from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, as_sink
from lightning_elastic.launcher.node.spawn import start_supervisor_client
from lightning_elastic.launcher.processes.ssh import SshProcess, start_message
from lightning_elastic.launcher.hosts.slurm import SlurmNodes

log = logging.getLogger(__name__)

LOST = 255  # the status of a worker whose step ended without the supervisor's exit report
SCANCEL_TIMEOUT = 10.0
PENDING_SIGNALS = 1024  # bounded: a flood of kills cannot grow the queue without end


def srun_argv(job_id: str, node: str, cwd: str, worker_id: str, python: str = sys.executable) -> list[str]:
    return [
        "srun", "--jobid", job_id, "--overlap", "--nodes=1", "--ntasks=1", "-w", node,
        "--quiet", "--kill-on-bad-exit=0", "--chdir", cwd, f"--job-name=le-{worker_id}",
        python, "-m", "lightning_elastic.launcher.node.supervisor",
    ]


class Scancel:
    """Runs ``scancel --signal=SIG STEP`` commands in one thread, off the driver's loop."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, int] | None] = queue.Queue(PENDING_SIGNALS)
        self._thread = threading.Thread(target=self._loop, name="scancel", daemon=True)
        self._thread.start()

    def send(self, step: str, sig: int) -> None:
        try:
            self._queue.put_nowait((step, sig))
        except queue.Full:
            log.warning("Too many Slurm signals pending: not sending %s to step %s.", signal.Signals(sig).name, step)

    def close(self, timeout: float = SCANCEL_TIMEOUT) -> None:
        """Send what is queued (bounded), then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _loop(self) -> None:
        for item in iter(self._queue.get, None):
            step, sig = item
            argv = ["scancel", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", step]
            try:
                result = subprocess.run(argv, capture_output=True, text=True, timeout=SCANCEL_TIMEOUT,
                                        stdin=subprocess.DEVNULL)
                if result.returncode != 0:
                    log.debug("%s: %s", shlex.join(argv), result.stderr.strip())
            except (OSError, subprocess.TimeoutExpired) as err:
                log.warning("%s failed: %s", shlex.join(argv), err)


class SlurmLauncher:
    def __init__(self, nodes: SlurmNodes, out: IO[str] | OutputSink | None = None) -> None:
        self._nodes = nodes
        self._sink = as_sink(out)
        self._scancel = Scancel()

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> SlurmProcess:
        job_id = self._nodes.job_of(spec.host)
        start = start_message(spec, dict(spec.env))  # over the driver's own environment, which srun exports
        argv = srun_argv(job_id, spec.host, spec.cwd, spec.worker_id)
        log.debug("Starting worker %s: %s", spec.worker_id, shlex.join(argv))
        proc = start_supervisor_client(argv, spec.host, env=step_environment(os.environ))
        assert proc.stdout is not None
        forwarder = LineForwarder(proc.stdout, prefix, spec.log_file, self._sink, f"srun-output-{proc.pid}")
        forwarder.start()
        process = SlurmProcess(spec.host, job_id, proc, forwarder, self._scancel)
        process.send(json.dumps(start))
        return process

    def close(self) -> None:
        self._scancel.close()


def step_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's environment for srun, without what would make srun misread its request:
    the batch step's task layout (SLURM_NTASKS_PER_NODE=4 against --ntasks=1 is an error)."""
    dropped = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
               "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_CPUS_PER_TASK", "SLURM_DISTRIBUTION",
               "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_EXCLUSIVE", "SLURM_MEM_PER_CPU")
    return {k: v for k, v in environ.items() if k not in dropped}


class SlurmProcess(SshProcess):
    """An srun step: the ssh process's protocol, with Slurm's own ways to end and to signal."""

    def __init__(self, node: str, job_id: str, proc: subprocess.Popen[bytes], forwarder: LineForwarder,
                 scancel: Scancel) -> None:
        self._job_id = job_id
        self._step: str | None = None  # JOB.STEP, once the supervisor has said
        self._scancel = scancel
        super().__init__(node, proc, forwarder)

    def signal(self, sig: int) -> None:
        self.send(f"signal {int(sig)}")
        if sig == signal.SIGKILL and self._proc.poll() is None:
            if self._step is not None:
                self._scancel.send(self._step, signal.SIGKILL)
            # srun itself would wait for a node that may be gone: the driver is done with it.
            self._killed = True
            self._proc.kill()

    def exit_detail(self) -> str:
        if self._status is not None or self._killed or self._proc.returncode is None:
            return ""
        said = "; ".join(self._stderr[-3:]) or "no message"
        return (f"its srun step on {self._host} (job {self._job_id}) ended without the worker's exit status "
                f"(srun status {self._proc.returncode}: {said}): the node or its slurmd is gone")

    def _final_status(self) -> int:
        status = super()._final_status()
        if self._status is None and not self._killed:
            return LOST  # srun's own status, even 0, says nothing of the worker
        return status

    def _on_report(self, verb: str, value: str) -> None:
        if verb == "step":
            self._step = value
