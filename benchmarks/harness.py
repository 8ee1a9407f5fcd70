"""What every measurement shares: commands, one process launcher with deadlines, statistics.

``Job`` starts a command in its own session with its output in a file, and tags the
environment with a unique value; ``Job.stop()`` ends the command's process group and then
every process still carrying the tag (workers the launchers started in sessions of their
own, orphans), so no benchmark leaves a stray behind. Every wait has a deadline.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKLOADS = BENCH / "workloads"
PYTHON = sys.executable
TAG_VARIABLE = "LIGHTNING_ELASTIC_BENCH_JOB"

if str(WORKLOADS) not in sys.path:
    sys.path.insert(0, str(WORKLOADS))

from steplog import StepReader, read_steps, steady_intervals  # noqa: E402,F401  (re-exported)


class TrialError(Exception):
    """A trial that produced no measurement; the message says why (with the job's last output)."""


# ----- commands -----------------------------------------------------------------------------

def workload(script: str, *args: Any) -> list[str]:
    return [PYTHON, str(WORKLOADS / script), *map(str, args)]


def launcher_command() -> list[str]:
    exe = Path(PYTHON).parent / "lightning-elastic"
    return [str(exe)] if exe.exists() else [PYTHON, "-m", "lightning_elastic.launcher.cli"]


def elastic_launch(workers: int, command: Sequence[str], min_np: int | None = None) -> list[str]:
    """``lightning-elastic launch`` on ``workers`` loopback "hosts" (127.0.0.1, .2, ...), one slot each."""
    hosts = ",".join(f"127.0.0.{i + 1}:1" for i in range(workers))
    extra = ["--min-np", str(min_np)] if min_np is not None else []
    return [*launcher_command(), "launch", "-np", str(workers), *extra, "-H", hosts, *command]


def torchrun(workers: int, command: Sequence[str], max_restarts: int | None = None) -> list[str]:
    """``torchrun --standalone --nproc-per-node N`` (``command`` starts with the interpreter: dropped)."""
    extra = ["--max-restarts", str(max_restarts)] if max_restarts is not None else []
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers), *extra,
            *command[1:]]


# ----- processes ----------------------------------------------------------------------------

_live: set[Job] = set()


class Job:
    """One command in its own session; output to ``<workdir>/output.log``; stopped for sure."""

    def __init__(self, command: Sequence[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.command = list(command)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.output_path = workdir / "output.log"
        self.tag = uuid.uuid4().hex
        child_env = {**os.environ, "PYTHONPATH": _pythonpath(), **(env or {}), TAG_VARIABLE: self.tag}
        with open(self.output_path, "ab") as out:
            self.proc = subprocess.Popen(self.command, cwd=workdir, env=child_env, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()
        _live.add(self)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if still running after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.output_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the command's group, SIGKILL whatever still runs after ``grace`` s, reap it."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            if self.wait(grace) is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.wait(10)
        # Processes of other sessions started by the command (the launchers' workers) or
        # left behind by it: found by the tag in their environment.
        deadline = time.monotonic() + grace
        while (strays := tagged_processes(self.tag)) and time.monotonic() < deadline:
            for pid in strays:
                _signal(pid, signal.SIGTERM)
            time.sleep(0.1)
        for pid in tagged_processes(self.tag):
            _signal(pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while tagged_processes(self.tag) and time.monotonic() < end:
            time.sleep(0.05)
        left = tagged_processes(self.tag)
        _live.discard(self)
        if left:
            print(f"warning: processes {left} of job {self.command[:4]} survived SIGKILL", file=sys.stderr)

    def run(self, timeout: float) -> None:
        """Wait for a successful exit within ``timeout`` s; else stop and raise TrialError."""
        try:
            code = self.wait(timeout)
            if code is None:
                raise TrialError(f"timed out after {timeout:.0f} s; last output:\n{self.tail()}")
            if code != 0:
                raise TrialError(f"exit status {code}; last output:\n{self.tail()}")
        finally:
            self.stop()


def _pythonpath() -> str:
    # The project's packages even when the interpreter's venv has no editable install.
    parts = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(parts))


def tagged_processes(tag: str) -> list[int]:
    """Processes (not zombies) whose environment has ``TAG_VARIABLE=tag``."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all() -> None:
    for job in list(_live):
        job.stop(grace=2.0)


atexit.register(stop_all)


def wait_until(predicate: Callable[[], Any], timeout: float, job: Job | None = None, interval: float = 0.01) -> Any:
    """``predicate()``'s first truthy value; None once ``timeout`` s passed or ``job`` exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline or (job is not None and job.poll() is not None):
            return predicate() or None
        time.sleep(interval)


def steady_step(command: Sequence[str], workdir: Path, warmup: int, timeout: float,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a training job to its end; rank 0's step intervals after ``warmup`` steps.

    ``command`` must write its step log to ``<workdir>/steps``.
    """
    started = time.monotonic()
    Job(command, workdir, env).run(timeout)
    intervals = steady_intervals(read_steps(workdir / "steps"), warmup)
    if len(intervals) < 3:
        raise TrialError(f"only {len(intervals)} step interval(s) of rank 0 after {warmup} warm-up steps")
    return {"median_s": statistics.median(intervals), "intervals_s": [round(i, 6) for i in intervals],
            "wall_s": round(time.monotonic() - started, 2)}


# ----- trials and statistics ------------------------------------------------------------------

class Skipped(Exception):
    """Raised by a measurement that cannot run at all here: no further trials of it."""


def trial(measure: Callable[[], Any]) -> dict[str, Any]:
    """Run one measurement: ``{"ok": True, "value": ...}`` or ``{"ok": False, "error": ...}``."""
    started = time.time()
    try:
        value = measure()
    except Skipped:
        raise
    except TrialError as err:
        return {"ok": False, "error": str(err), "started": started}
    except Exception as err:  # a bug in a measurement is reported as a failed trial, never hidden
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "started": started}
    return {"ok": True, "value": value, "started": started}


def interleave(
    section: str,
    plan: dict[str, tuple[int, Callable[[int, Path], Any]]],
    workdir: Path,
    show: Callable[[Any], str] = str,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Trial 0 of every entry, then trial 1 of every entry, ...: machine noise hits all alike.

    ``plan[key] = (trials, measure)``; ``measure(trial_index, directory)`` returns a value or
    raises. Returns every trial's record per key, and the reason of each key that raised
    ``Skipped`` (not run again). Prints one progress line per trial to stderr.
    """
    results: dict[str, list[dict[str, Any]]] = {key: [] for key in plan}
    skipped: dict[str, str] = {}
    for index in range(max((n for n, _ in plan.values()), default=0)):
        for key, (trials, measure) in plan.items():
            if index >= trials or key in skipped:
                continue
            directory = workdir / section / key.replace("/", "-") / str(index)
            try:
                record = trial(lambda: measure(index, directory))
            except Skipped as reason:
                skipped[key] = str(reason)
                progress(f"[{section}] {key}: skipped ({reason})")
                continue
            results[key].append(record)
            shown = show(record["value"]) if record["ok"] else "FAILED: " + record["error"].splitlines()[0]
            progress(f"[{section}] trial {index + 1}/{trials} {key}: {shown}")
    return results, skipped


def progress(message: str) -> None:
    print(time.strftime("%H:%M:%S ") + message, file=sys.stderr, flush=True)


def values(records: Sequence[dict[str, Any]], get: Callable[[Any], float | None] = lambda v: v) -> list[float | None]:
    """One number per trial (None for a failed one)."""
    return [get(r["value"]) if r["ok"] else None for r in records]


def failures(records: Sequence[dict[str, Any]]) -> list[str]:
    return [r["error"] for r in records if not r["ok"]]


@dataclasses.dataclass
class Summary:
    n: int  # trials with a value
    failed: int
    median: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Summary:
        ok = [v for v in values if v is not None]
        if not ok:
            return cls(0, len(values), None, None, None)
        return cls(len(ok), len(values) - len(ok), statistics.median(ok), min(ok), max(ok))

    def show(self, scale: float = 1.0, fmt: str = "{:.2f}", unit: str = "") -> str:
        if self.median is None:
            return f"none of {self.failed} trial(s)"
        text = f"{fmt.format(self.median * scale)}{unit} ({fmt.format(self.low * scale)}–{fmt.format(self.high * scale)})"
        return text + (f", {self.failed} failed" if self.failed else "")


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": sys.version.split()[0],
        "interpreter": PYTHON,
        "torch": version("torch"),
        "lightning": version("lightning"),
        "lightning_elastic": version("lightning-elastic"),
        "torchft": version("torchft"),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "loadavg_start": os.getloadavg(),
    }
