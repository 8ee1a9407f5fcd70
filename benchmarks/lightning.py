"""Lightning: steady step time of elastic_hvd against ddp, and recovery after a SIGKILL.

    .venv/bin/python benchmarks/lightning.py [--repeats 3]

Same example (examples/lightning_classifier.py: MLP 2-64-64-3, batch 8 per rank, AdamW),
same machine, one invocation:

- steady step: 2 processes, median interval between rank 0's training steps after 30
  warm-up steps, for ``ddp`` (Lightning's own launcher) and ``elastic_hvd`` under
  ``lightning-elastic launch`` committing every 10 batches and every batch;
- recovery: elastic_hvd with 3 workers, SIGKILL of the worker on 127.0.0.2 once it has
  done 40 steps; the time from the kill to the first training step completed in the new
  world (rank 0's second step record in the new round: the first one is logged before
  that step's optimizer update).

Prints a Markdown table for benchmarks/README.md.
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
EXAMPLE = HERE.parent / "examples" / "lightning_classifier.py"
BIN = Path(sys.executable).parent


def events(directory: Path) -> list[dict]:
    found = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return sorted(found, key=lambda e: e["time"])


def example(directory: Path, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--events", str(directory / "events"), "--log-dir",
            str(directory / "logs"), "--epochs", "1", "--samples", "4800", *extra]


def launch(hosts: int, directory: Path, *extra: str) -> list[str]:
    listing = ",".join(f"127.0.0.{i + 1}:1" for i in range(hosts))
    return [str(BIN / "lightning-elastic"), "launch", "-np", str(hosts), "--min-np", "1", "-H", listing,
            *example(directory, *extra)]


def steady_step(cmd: list[str], directory: Path) -> float:
    subprocess.run(cmd, cwd=directory, check=True, capture_output=True, timeout=600)
    steps = [e for e in events(directory / "events") if e["kind"] == "step" and e["rank"] == 0][30:]
    return statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:]))


def recovery(directory: Path) -> float | None:
    proc = subprocess.Popen(launch(3, directory, "--commit-every", "10"), cwd=directory,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        victim = None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            mine = [e for e in events(directory / "events") if e["worker"].startswith("127.0.0.2[")]
            if sum(e["kind"] == "step" for e in mine) >= 40:
                victim = mine[0]["pid"]
            time.sleep(0.02)
        if victim is None:
            return None
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        proc.wait(300)
        after = [e for e in events(directory / "events")
                 if e["kind"] == "step" and e["rank"] == 0 and e["time"] > killed_at and e["round"] > 1]
        return after[1]["time"] - killed_at if len(after) > 1 else None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {
        "ddp (Lightning's launcher)": lambda d: steady_step(example(d, "--strategy", "ddp", "--devices", "2"), d),
        "elastic_hvd, commit every 10": lambda d: steady_step(launch(2, d, "--commit-every", "10"), d),
        "elastic_hvd, commit every batch": lambda d: steady_step(launch(2, d, "--commit-every", "1"), d),
    }
    print("| strategy | steady step, 2 processes (median of runs) | runs |")
    print("| --- | --- | --- |")
    for name, measure in rows.items():
        values = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                values.append(measure(Path(tmp)))
        print(f"| {name} | {statistics.median(values) * 1000:.1f} ms | "
              + ", ".join(f"{v * 1000:.1f}" for v in values) + " |")
    recoveries = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            recoveries.append(recovery(Path(tmp)))
    shown = ", ".join("no recovery" if r is None else f"{r:.2f} s" for r in recoveries)
    measured = [r for r in recoveries if r is not None]
    median = f"{statistics.median(measured):.2f} s" if measured else "never"
    print(f"\nelastic_hvd, 3 workers, SIGKILL -> first completed step of the new world: {median} (runs: {shown})")


if __name__ == "__main__":
    main()
