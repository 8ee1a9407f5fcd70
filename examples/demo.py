"""The README's demo: an elastic job on this machine that loses a worker and gains a host.

It starts ``lightning-elastic launch`` on two loopback "hosts" with a discovery script,
SIGKILLs the worker on 127.0.0.2 once training is under way, then adds 127.0.0.3 to the
discovery output. The job goes on in the surviving process, grows to the new host, and the
driver ends with its summary; ``lightning-elastic timeline`` then draws the job's events
as a PNG. The demo's exit status is the driver's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "elastic_loop.py"


def say(text: str) -> None:
    print(f"\n>>> demo: {text}\n", file=sys.stderr, flush=True)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="lightning-elastic-demo-"))
    hosts = work / "hosts.txt"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    script = work / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    launcher = Path(sys.executable).parent / "lightning-elastic"
    command = [
        str(launcher), "launch", "-np", "2", "--min-np", "1", "--max-np", "3",
        "--host-discovery-script", str(script), "--log-dir", str(work / "logs"),
        sys.executable, str(EXAMPLE), "--epochs", "10", "--step-delay", "0.05", "--samples", "192",
    ]
    say(f"launching: {' '.join(command[1:])}")
    driver = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert driver.stderr is not None
    pids: dict[str, int] = {}
    stage = "wait-round-1"
    timers: list[threading.Timer] = []

    def kill_worker() -> None:
        pid = pids.get("127.0.0.2")
        if pid:
            say(f"killing the worker on 127.0.0.2 (pid {pid}) with SIGKILL")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def add_host() -> None:
        say("adding host 127.0.0.3 to the discovery output")
        hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n")

    for line in driver.stderr:
        sys.stderr.write(line)
        started = re.search(r"Started worker ([\d.]+)\[\d+\]#\d+ \(pid (\d+)\)", line)
        if started:
            pids[started.group(1)] = int(started.group(2))
        if stage == "wait-round-1" and "Round 1 formed" in line:
            stage = "wait-round-2"
            timers.append(threading.Timer(2.0, kill_worker))
        elif stage == "wait-round-2" and "Round 2 formed" in line:
            stage = "done"
            timers.append(threading.Timer(1.5, add_host))
        else:
            continue
        timers[-1].start()
    code = driver.wait()
    for t in timers:
        t.cancel()
    say(f"driver exited with status {code}; worker logs and events.jsonl are in {work / 'logs'}")
    drawn = subprocess.run([str(launcher), "timeline", str(work / "logs")], stderr=subprocess.PIPE, text=True)
    sys.stderr.write(drawn.stderr)  # where the PNG went, or why it could not be drawn
    return code


if __name__ == "__main__":
    sys.exit(main())
