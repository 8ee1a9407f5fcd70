"""Agents at fleet scale: N workers joining through N/8 agents, and one agent lost, beside the
same N workers pushed by the driver and one host's workers lost.

    .venv/bin/python benchmarks/fleet_agents.py --workers 2048 --out benchmarks/results/<date>-fleet-agents.json

For each N and mode, the real ``Driver`` runs in its own process pinned to CPU 0
(``benchmarks/fleet/driver_process.py``) and the simulated fleet in this one, pinned to CPU 1
(no torch; the real signed protocols), 8 slots per host:

- ``pushed``: the driver starts every worker (the simulator's launcher stands for local or
  ssh processes, ``-H`` of N/8 hosts); the loss: the 8 workers of the last host exit at
  once (SIGKILL), as the processes of a lost machine whose connections drop;
- ``agents``: ``launch --agents`` with no host; N/8 simulated agents join (they retry until
  the driver serves), each gets 8 workers; the loss: the last agent falls silent with its 8
  workers dead (``SimulatedAgent.lose``), which the driver can only learn from the silence.

Measured: the first round (the last worker's first rendezvous request -> every worker holds
its round-1 assignment, as ``fleet_sim.py``; and from the driver's spawn), the
re-formation (the loss -> every survivor holds its round-2 assignment), the driver's CPU
during each, and the job's end. Prints a Markdown table; every figure goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet.simulated_agents import SimulatedAgent  # noqa: E402
from benchmarks.fleet.simulated_workers import Simulator  # noqa: E402
from benchmarks.fleet_sim import busy_seconds, wait_until  # noqa: E402

DRIVER = ROOT / "benchmarks" / "fleet" / "driver_process.py"
SLOTS = 8
SECRET = "f1e2d3c4b5a69788" * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_one(n: int, mode: str, bound: float, workdir: Path, heartbeat_timeout: float) -> dict[str, Any]:
    sim = Simulator()
    control = workdir / f"control-{mode}-{n}.sock"
    server = await sim.serve(str(control))
    log_path = workdir / f"driver-{mode}-{n}.log"
    secret_file = workdir / "secret"
    secret_file.write_text(SECRET)
    port = free_port()
    extra = ["--agents", "--port", str(port), "--secret-file", str(secret_file)] if mode == "agents" else []
    hosts = (n + SLOTS - 1) // SLOTS
    spawned = time.monotonic()
    with open(log_path, "wb") as log:
        driver = await asyncio.create_subprocess_exec(
            sys.executable, str(DRIVER), "--workers", str(n), "--slots-per-host", str(SLOTS), "--control", str(control),
            "--heartbeat-timeout", str(heartbeat_timeout), *extra,
            stdout=asyncio.subprocess.PIPE, stderr=log, preexec_fn=lambda: os.sched_setaffinity(0, {0}),
        )
    proc = psutil.Process(driver.pid)
    agents = [SimulatedAgent(sim, f"agent-{i:04d}", SLOTS, port, SECRET) for i in range(hosts)] if mode == "agents" else []
    for agent in agents:
        agent.start()
    result: dict[str, Any] = {"workers": n, "mode": mode, "hosts": hosts, "heartbeat_timeout": heartbeat_timeout}
    try:
        cpu = busy_seconds(proc.cpu_times())
        formed = await wait_until(lambda: len(sim.assigned.get(1, {})) == n, bound, driver)
        if not formed:
            result["first_round_s"] = None
            result["first_round_assigned"] = len(sim.assigned.get(1, {}))
            return result
        last = max(a.at for a in sim.assigned[1].values())
        result["first_round_s"] = last - max(sim.first_asks.values())
        result["first_round_from_spawn_s"] = last - spawned
        result["first_round_driver_cpu_s"] = busy_seconds(proc.cpu_times()) - cpu
        await asyncio.sleep(2.0)  # a few heartbeats at the steady state
        # The loss: the last host's 8 workers.
        victims = [w for w in sim.workers if w.startswith(f"{'agent' if agents else 'sim'}-{hosts - 1:04d}[")]
        assert len(victims) == SLOTS, victims
        cpu, killed_at = busy_seconds(proc.cpu_times()), time.monotonic()
        if agents:
            agents[-1].lose()
        else:
            for worker_id in victims:
                sim.kill(worker_id)
        survivors = n - len(victims)
        reformed = await wait_until(lambda: len(sim.assigned.get(2, {})) == survivors, bound, driver)
        result["reform_s"] = max(a.at for a in sim.assigned[2].values()) - killed_at if reformed else None
        result["reform_driver_cpu_s"] = busy_seconds(proc.cpu_times()) - cpu
        if not reformed:
            result["reform_assigned"] = len(sim.assigned.get(2, {}))
            return result

        async def finish(worker: Any) -> None:
            try:
                await worker.report_done()
            finally:
                worker.exit(0)

        started = time.monotonic()
        await asyncio.gather(*(finish(w) for w in sim.live()), return_exceptions=True)
        stdout, _ = await asyncio.wait_for(driver.communicate(), bound)
        result["finish_s"] = time.monotonic() - started
        out = stdout.decode().strip().splitlines()
        job = json.loads(out[-1]) if out else {}
        result["job"] = {"success": job.get("success"), "reason": job.get("reason"), "rounds": job.get("rounds")}
        return result
    finally:
        log_text = log_path.read_text(errors="replace")
        result["false_wedged"] = len(sim.unexpected_kills)
        result["connection_errors"] = sim.stats.connection_errors
        result["driver_log_tail"] = log_text.splitlines()[-4:]
        if driver.returncode is None and proc.is_running():
            proc.kill()
        await driver.wait()
        for agent in agents:
            agent.close()
        for worker in sim.live():
            worker.exit(-9)
        server.close()


def fmt(value: Any, spec: str = ".2f") -> str:
    return "not reached" if value is None else format(value, spec)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| workers | hosts | mode | first round | from the driver's spawn | re-formation after a host lost | "
             "driver CPU (first round, re-formation) | job |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        job = r.get("job", {})
        lines.append(
            f"| {r['workers']} | {r['hosts']} | {r['mode']} | {fmt(r.get('first_round_s'))} s | "
            f"{fmt(r.get('first_round_from_spawn_s'))} s | {fmt(r.get('reform_s'))} s | "
            f"{fmt(r.get('first_round_driver_cpu_s'))} s, {fmt(r.get('reform_driver_cpu_s'))} s | "
            f"{'succeeded' if job.get('success') else job.get('reason', 'not reached')} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    os.sched_setaffinity(0, {1} if os.cpu_count() and os.cpu_count() > 1 else {0})
    results = []
    with tempfile.TemporaryDirectory(prefix="fleet-agents-") as tmp:
        for n in args.workers:
            for mode in args.modes:
                result = await run_one(n, mode, args.bound, Path(tmp), args.heartbeat_timeout)
                print(json.dumps({k: v for k, v in result.items() if k != "driver_log_tail"}), flush=True)
                results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default=[2048], type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--modes", default=["pushed", "agents"], type=lambda s: s.split(","))
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--bound", type=float, default=180.0, help="longest a phase may take")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": platform.node(), "python": platform.python_version(),
                                        "cpus": os.cpu_count(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
