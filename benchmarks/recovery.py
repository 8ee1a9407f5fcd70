"""Recovery time and steady-state step time: lightning-elastic against torchrun, in one run.

    .venv/bin/python benchmarks/recovery.py [--repeats 3]

For each tool, on this machine, with benchmarks/loop.py (same model, data and DDP sync):

- steady step time: 2 workers, median time between rank 0's consecutive steps
  (after 20 warm-up steps);
- recovery: 3 workers, SIGKILL one (not rank 0) after step 40, time from the kill to
  the first step completed afterwards. lightning-elastic goes on in the survivors with 2
  workers; torchrun (--max-restarts 1, no checkpoint) restarts all 3 workers from scratch.

Prints a Markdown table; copy it into benchmarks/README.md with the date and machine.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOOP = HERE / "loop.py"
BIN = Path(sys.executable).parent


def read_steps(log_dir: Path) -> list[dict]:
    steps = []
    for path in log_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                steps.append(json.loads(line))
            except ValueError:
                pass
    return sorted(steps, key=lambda s: s["t"])


def command(tool: str, workers: int, log_dir: Path, steps: int) -> list[str]:
    loop = [str(LOOP), "--steps", str(steps), "--log-dir", str(log_dir)]
    if tool == "lightning-elastic":
        hosts = ",".join(f"127.0.0.{i + 1}:1" for i in range(workers))
        return [str(BIN / "lightning-elastic"), "launch", "-np", str(workers), "--min-np", "1", "-H", hosts,
                sys.executable, *loop]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
            "--max-restarts", "1", *loop]


def wait_until(predicate, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """True once ``predicate`` holds; False if ``proc`` ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            return predicate()
        time.sleep(0.02)
    return True


def steady_step_time(tool: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        subprocess.run(command(tool, 2, log_dir, 220), check=True, capture_output=True, timeout=600)
        rank0 = [s["t"] for s in read_steps(log_dir) if s["rank"] == 0][20:]
        return statistics.median(b - a for a, b in zip(rank0, rank0[1:]))


def recovery_time(tool: str) -> float | None:
    """Seconds from SIGKILL to the next step; None if the job never trained again."""
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        proc = subprocess.Popen(command(tool, 3, log_dir, 3000), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if not wait_until(lambda: any(s["step"] >= 40 for s in read_steps(log_dir)), 300, proc):
                raise RuntimeError(f"{tool}: the job did not reach step 40")
            victim = next(s["pid"] for s in read_steps(log_dir) if s["rank"] == 1)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            after = lambda: [s["t"] for s in read_steps(log_dir)  # noqa: E731
                             if s["t"] > killed_at and s["pid"] != victim and _after_reset(s, tool)]
            if not wait_until(after, 300, proc):
                return None
            return min(after()) - killed_at
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def _after_reset(step: dict, tool: str) -> bool:
    # lightning-elastic goes on with 2 workers; torchrun restarts with 3 fresh processes.
    return step["size"] == 2 if tool == "lightning-elastic" else step["step"] <= 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for tool in ("lightning-elastic", "torchrun"):
        step = steady_step_time(tool)
        recoveries = [recovery_time(tool) for _ in range(args.repeats)]
        rows.append((tool, step, recoveries))
    print("| tool | steady step, 2 workers (median) | SIGKILL -> first step after, 3 workers (median of "
          f"{args.repeats}) | all recoveries |")
    print("| --- | --- | --- | --- |")
    for tool, step, recoveries in rows:
        ok = [r for r in recoveries if r is not None]
        median = f"{statistics.median(ok):.2f} s" if ok else "never"
        shown = ", ".join("no recovery" if r is None else f"{r:.2f} s" for r in recoveries)
        print(f"| {tool} | {step * 1000:.1f} ms | {median} | {shown} |")


if __name__ == "__main__":
    main()
