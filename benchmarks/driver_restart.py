"""A driver restart with --state-dir: adoption time, and the step time during the outage.

    flock /tmp/le-cpu.lock .venv/bin/python benchmarks/driver_restart.py [--workers 3] [--outage 5]

N workers of examples/elastic_loop.py on loopback hosts under ``lightning-elastic launch
--state-dir``; after ``--kill-after`` steps the driver is SIGKILLed, and started again with
the same command ``--outage`` seconds later. Reported, from the new driver's
``events.jsonl`` and the workers' own step events:

- from the new driver's start to every adopted worker's first request (``workers_adopted``);
- the median step interval with a driver, during the outage, and after the adoption.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = Path(sys.executable).parent / "lightning-elastic"
EXAMPLE = REPO / "examples" / "elastic_loop.py"


def steps(events: Path) -> dict[int, list[float]]:
    """Worker pid -> the times of its steps."""
    found: dict[int, list[float]] = {}
    for path in events.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line being written
            if e["kind"] == "step":
                found.setdefault(e["pid"], []).append(e["time"])
    return found


def intervals(by_pid: dict[int, list[float]], low: float, high: float) -> list[float]:
    gaps = []
    for times in by_pid.values():
        times.sort()
        gaps += [b - a for a, b in zip(times, times[1:]) if low <= a and b <= high]
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--outage", type=float, default=5.0)
    parser.add_argument("--kill-after", type=int, default=30, help="steps per worker before the kill")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        hosts = ",".join(f"127.0.0.{i + 1}:1" for i in range(args.workers))
        command = [str(LAUNCHER), "launch", "-H", hosts, "-np", str(args.workers), "--state-dir", str(d / "state"),
                   "--log-dir", str(d / "logs"), sys.executable, str(EXAMPLE), "--events", str(d / "events"),
                   "--step-delay", "0.05", "--samples", str(96 * args.workers), "--batch-size", "8",
                   "--commit-every", "2", "--epochs", "12"]
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while sum(map(len, steps(d / "events").values())) < args.kill_after * args.workers:
            if time.monotonic() > deadline or first.poll() is not None:
                sys.exit("the job did not reach the kill point")
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        time.sleep(args.outage)
        second = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        if second.returncode != 0:
            sys.exit(f"the restarted job failed:\n{second.stderr[-2000:]}")
        driver = [json.loads(line) for line in (d / "logs" / "events.jsonl").read_text().splitlines() if line]
        restarted = next(e for e in driver if e["kind"] == "driver_restarted")
        adopted = next(e for e in driver if e["kind"] == "workers_adopted")
        back = restarted["time"]
        gone = back - restarted["outage_s"]
        by_pid = steps(d / "events")
        rows = [("with a driver", intervals(by_pid, 0, gone)), ("during the outage", intervals(by_pid, gone + 0.5, back)),
                ("after adoption", intervals(by_pid, back + 2, float("inf")))]
    print(f"| {args.workers} workers, outage {restarted['outage_s']:.1f} s | value |")
    print("| --- | --- |")
    print(f"| new driver's start -> every adopted worker's first request | {adopted['after_s']:.2f} s |")
    for name, gaps in rows:
        if gaps:
            print(f"| median step interval {name} | {1000 * statistics.median(gaps):.1f} ms ({len(gaps)} intervals) |")


if __name__ == "__main__":
    main()
