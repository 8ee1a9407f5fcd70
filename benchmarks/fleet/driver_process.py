"""The real driver, in a process of its own, starting simulated workers instead of processes.

    python benchmarks/fleet/driver_process.py --workers N --slots-per-host 8 --control SOCKET

Run by ``benchmarks/fleet_sim.py``, never by hand. ``Driver`` is the one ``launch`` runs; only
its ``WorkerLauncher`` is replaced: ``SimulatedLauncher`` asks the simulator (over the Unix
socket ``--control``) to start a worker, and learns from it when one exits, so every
decision (rounds, heartbeats, verdicts) is the real driver's, over its real service.
At the end it prints the job's result as one JSON line.

With ``--state-dir`` it keeps the job there as ``launch --state-dir`` does; started again
with the same directory (the previous one SIGKILLed) it adopts the simulated workers,
which ran on meanwhile: ``SimulatedLauncher.adopt`` stands for the keeper or the ssh
supervisor a real driver finds again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.fleet.gc_pauses import GcPauses  # noqa: E402
from lightning_elastic import protocol as p  # noqa: E402
from lightning_elastic.launcher.restart.adoption import StateKeeping  # noqa: E402
from lightning_elastic.launcher.config import AgentsSettings, LaunchConfig, Timeouts  # noqa: E402
from lightning_elastic.launcher.processes.agent import AgentLauncher  # noqa: E402
from lightning_elastic.launcher.processes.output import OutputSink  # noqa: E402
from lightning_elastic.launcher.service.agent_board import AgentBoard  # noqa: E402
from lightning_elastic.launcher.hosts.discovery import FixedHosts  # noqa: E402
from lightning_elastic.launcher.driver.driver import Driver  # noqa: E402
from lightning_elastic.launcher.job.slots import HostSlots  # noqa: E402
from lightning_elastic.launcher.processes.base import WorkerSpec  # noqa: E402
from lightning_elastic.launcher.job.state import WorkerRecord  # noqa: E402
from lightning_elastic.launcher.restart.state_dir import StateDir  # noqa: E402


class SimulatedLauncher:
    """Starts a worker by asking the simulator; a reader thread takes its exits."""

    def __init__(self, control: socket.socket) -> None:
        self._control = control
        # Sent by a thread of its own: the simulator, busy with thousands of workers retrying
        # an absent driver, reads its socket late, and the driver must not wait on it where
        # a real launcher would not (adopting 4,096 local workers reads 4,096 /proc files).
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._processes: dict[str, SimulatedProcess] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read_exits, name="simulator-exits", daemon=True).start()
        threading.Thread(target=self._send_all, name="simulator-control", daemon=True).start()

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> SimulatedProcess:
        process = SimulatedProcess(self, spec.worker_id)
        with self._lock:
            self._processes[spec.worker_id] = process
        self.send({"op": "start", "worker_id": spec.worker_id, "host": spec.host,
                   "url": spec.env[p.ENV_DRIVER_URL], "secret": spec.secret,
                   "heartbeat_interval": float(spec.env[p.ENV_HEARTBEAT_INTERVAL]),
                   "world_size": int(spec.env["WORLD_SIZE"])})
        return process

    def adopt(self, record: WorkerRecord, prefix: Callable[[], str]) -> SimulatedProcess:
        """A worker the previous driver started: the simulator says at once if it has ended."""
        process = SimulatedProcess(self, record.worker_id)
        with self._lock:
            self._processes[record.worker_id] = process
        self.send({"op": "adopt", "worker_id": record.worker_id})
        return process

    def send(self, message: dict) -> None:
        self._outbox.put(json.dumps(message).encode() + b"\n")

    def _send_all(self) -> None:
        while True:
            self._control.sendall(self._outbox.get())

    def _read_exits(self) -> None:
        for line in self._control.makefile("rb"):
            message = json.loads(line)
            with self._lock:
                process = self._processes.get(message["worker_id"])
            if process is not None:
                process.exited(message["status"])


class SimulatedProcess:
    """A simulated worker as the driver sees it (``WorkerProcess``)."""

    pid = 0

    def __init__(self, launcher: SimulatedLauncher, worker_id: str) -> None:
        self._launcher = launcher
        self._worker_id = worker_id
        self._status: int | None = None
        self._ended = threading.Event()

    def exited(self, status: int) -> None:
        self._status = status
        self._ended.set()

    def poll(self) -> int | None:
        return self._status if self._ended.is_set() else None

    def wait(self, timeout: float) -> int | None:
        self._ended.wait(timeout)
        return self.poll()

    def signal(self, sig: int) -> None:
        if not self._ended.is_set():
            self._launcher.send({"op": "signal", "worker_id": self._worker_id, "signal": int(sig)})

    def finish_output(self, timeout: float = 5.0) -> None:
        pass

    def exit_detail(self) -> str:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--slots-per-host", type=int, default=8)
    parser.add_argument("--control", required=True, help="the simulator's Unix socket")
    parser.add_argument("--heartbeat-timeout", type=float, default=Timeouts.heartbeat_timeout)
    parser.add_argument("--heartbeat-interval", type=float, help="default: the driver's own choice")
    parser.add_argument("--elastic-timeout", type=float, default=300.0)
    parser.add_argument("--state-dir", type=Path, help="as launch --state-dir: a second start adopts the job")
    parser.add_argument("--agents", action="store_true",
                        help="as launch --agents with no other host: the simulator's agents join on --port")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--secret-file", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="driver %(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    # The wall clock once the imports are done: the simulator subtracts the process's spawn.
    logging.getLogger("fleet").info("driver process ready at %.3f", time.time())
    hosts = [HostSlots(f"sim-{i:04d}", args.slots_per_host)
             for i in range((args.workers + args.slots_per_host - 1) // args.slots_per_host)]
    config = LaunchConfig(
        command=("simulated",), np=args.workers, min_np=1, max_np=args.workers, hosts=tuple(hosts),
        elastic_timeout=args.elastic_timeout, state_dir=args.state_dir,
        timeouts=Timeouts(heartbeat_timeout=args.heartbeat_timeout, heartbeat_interval=args.heartbeat_interval),
    )
    if args.agents:
        return run_with_agents(args)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.connect(args.control)
    launcher = SimulatedLauncher(control)
    keeping = None
    if args.state_dir is not None:
        state_dir = StateDir(args.state_dir)
        state_dir.lock()
        keeping = StateKeeping(state_dir, adopt=launcher.adopt)
    driver = Driver(config, FixedHosts(config.hosts), launcher, is_local=lambda _host: True, keeping=keeping)
    gc_pauses = GcPauses()
    result = driver.run()
    print(json.dumps({**dataclasses.asdict(result), "gc_pauses": gc_pauses.pauses}), flush=True)
    return 0 if result.success else 1


def run_with_agents(args: argparse.Namespace) -> int:
    """The real driver of ``launch --agents``, its workers started by the simulator's agents
    (``benchmarks/fleet/simulated_agents.py``) over the real agent protocol."""
    secret = args.secret_file.read_text().strip()
    config = LaunchConfig(
        command=("simulated",), np=args.workers, min_np=1, max_np=args.workers, hosts=None,
        agents=AgentsSettings(secret), port=args.port, driver_address="127.0.0.1",
        elastic_timeout=args.elastic_timeout,
        timeouts=Timeouts(heartbeat_timeout=args.heartbeat_timeout, heartbeat_interval=args.heartbeat_interval),
    )
    t = config.timeouts
    board = AgentBoard(config.max_np, t.heartbeat_timeout, t.heartbeat_period)
    launcher = AgentLauncher(board, None, OutputSink(open("/dev/null", "w")))  # noqa: SIM115 - for the run
    driver = Driver(config, FixedHosts(()), launcher, is_local=lambda _host: True, agents=board, secret=secret)
    gc_pauses = GcPauses()
    result = driver.run()
    print(json.dumps({**dataclasses.asdict(result), "gc_pauses": gc_pauses.pauses}), flush=True)
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main())
