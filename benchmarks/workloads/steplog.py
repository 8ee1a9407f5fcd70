"""The one step-log format: a JSON line per completed training step, one file per process.

Written by the workloads (``StepLog``), read by the measurements (``StepReader``). This module
is standard-library only, so the suite can read logs without importing torch.

A record: ``{"t": wall-clock seconds, "step": n, "rank": r, "size": world size, "pid": pid}``, and any
extra fields a workload adds (``sharded_train.py``: ``began``, ``hwm_mb``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class StepLog:
    """Appends one line per step to ``<directory>/<pid>.jsonl`` (line-buffered: readable at once)."""

    def __init__(self, directory: Path | str) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def step(self, step: int, rank: int, size: int, **extra: object) -> None:
        self._file.write(json.dumps({"t": time.time(), "step": step, "rank": rank, "size": size,
                                     "pid": os.getpid(), **extra}) + "\n")


class StepReader:
    """Reads the records of a log directory incrementally (cheap to poll while a job runs)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}
        self.records: list[dict] = []

    def poll(self) -> list[dict]:
        """Records completed since the last call (a half-written last line waits for the next)."""
        new: list[dict] = []
        if not self.directory.is_dir():
            return new
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    pass
            self._offsets[path] = offset + end
        new.sort(key=lambda r: r["t"])
        self.records.extend(new)
        return new


def read_steps(directory: Path | str) -> list[dict]:
    """Every record of a finished job, in time order."""
    reader = StepReader(directory)
    reader.poll()
    return sorted(reader.records, key=lambda r: r["t"])


def steady_intervals(records: list[dict], warmup: int, rank: int = 0) -> list[float]:
    """Intervals between ``rank``'s consecutive steps, after its first ``warmup`` steps."""
    times = [r["t"] for r in records if r["rank"] == rank][warmup:]
    return [b - a for a, b in zip(times, times[1:])]
