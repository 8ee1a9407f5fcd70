"""Machine loss across ssh: fault -> first step of the survivors at the new world size.

    .venv/bin/python benchmarks/machine_loss.py [--repeats 3] [--heartbeat-timeout 10]

Needs root and ``ip``: three remote hosts are network namespaces with their own address,
host name and sshd (tests/integration/namespaces.py, removed afterwards). For each fault,
3 workers (one per host) train examples/elastic_loop.py under ``lightning-elastic launch``
over ssh; after 15 steps the second host is lost:

- partition: its link goes down (no FIN, no RST: only missed heartbeats tell);
- kill-all: every process of the host is SIGKILLed at once, sshd included;
- sigkill: its worker alone is SIGKILLed (the single-fault figure, for comparison).

Reported: wall-clock time from the fault to the first step any survivor completed at world
size 2 (median, max and every trial). Prints a Markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.namespaces import NamespacedHosts  # noqa: E402

EXAMPLE = REPO / "examples" / "elastic_loop.py"
LAUNCHER = Path(sys.executable).parent / "lightning-elastic"


def events(directory: Path, kind: str) -> list[dict]:
    found = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event["kind"] == kind:
                found.append(event)
    return found


def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout} s")
        time.sleep(0.05)


def trial(hosts: NamespacedHosts, fault: str, heartbeat_timeout: float) -> float | None:
    h1, h2, h3 = hosts.names
    with tempfile.TemporaryDirectory() as tmp:
        ev = Path(tmp) / "events"
        cmd = [str(LAUNCHER), "launch", *hosts.ssh_args, "--heartbeat-timeout", str(heartbeat_timeout),
               "-np", "3", "--min-np", "1", "-H", f"{h1}:1,{h2}:1,{h3}:1",
               sys.executable, str(EXAMPLE), "--events", str(ev), "--epochs", "40", "--samples", "192",
               "--step-delay", "0.05"]
        with open(Path(tmp) / "driver.err", "wb") as err:
            driver = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_until(lambda: len(events(ev, "step")) >= 15 * 3, 120)
            at = time.time()
            if fault == "partition":
                hosts.partition(h2)
            elif fault == "kill-all":
                hosts.kill_all(h2)
            else:
                (pid,) = {e["pid"] for e in events(ev, "start") if e["worker"].startswith(h2)}
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: any(e["size"] == 2 and e["time"] > at for e in events(ev, "step")),
                       heartbeat_timeout + 60)
            return min(e["time"] for e in events(ev, "step") if e["size"] == 2 and e["time"] > at) - at
        except TimeoutError:
            return None
        finally:
            driver.send_signal(signal.SIGTERM)
            driver.wait(60)
            hosts.restore_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    args = parser.parse_args()
    hosts = NamespacedHosts()
    hosts.start()
    try:
        rows = []
        for fault in ("sigkill", "kill-all", "partition"):
            times = [trial(hosts, fault, args.heartbeat_timeout) for _ in range(args.repeats)]
            ok = [t for t in times if t is not None]
            median = f"{statistics.median(ok):.2f} s" if ok else "never"
            worst = f"{max(ok):.2f} s" if ok else "never"
            every = ", ".join("failed" if t is None else f"{t:.2f} s" for t in times)
            rows.append(f"| {fault} | {median} | {worst} | {every} |")
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        hosts.close()
    print(f"\n--heartbeat-timeout {args.heartbeat_timeout:g}, 3 workers on 3 namespaced hosts over ssh\n")
    print("| fault on one host | fault -> first step at world size 2 (median) | max | every trial |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
