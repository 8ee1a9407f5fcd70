"""Start-up: launch -> every worker's first training step, cold, with ``--preload``, and under torchrun.

    flock /tmp/le-cpu.lock benchmarks/.venv/bin/python benchmarks/startup.py --workers 3,6 --trials 2 \\
        --out benchmarks/results/<date>-startup.json

The Lightning workload (workloads/lightning_train.py, small model) on N local workers, three
ways, trials interleaved (trial 1 of each, then trial 2, ...):

- ``le``: ``lightning-elastic launch -np N --min-np 1 --max-np N -H 127.0.0.1:1,...`` with
  N + 1 loopback hosts (one spare listed, unused until a worker is lost), ``elastic_hvd``
  with a commit every 10 steps and a host check every step (as measure/goodput.py);
- ``le+preload``: the same with ``--preload lightning.pytorch``: every worker forked from the
  driver's fork server, which imported Lightning once. A trial whose output shows a worker
  started cold, or no fork server, fails (measure/goodput.check_forked);
- ``torchrun``: ``torchrun --standalone --nproc-per-node N``, Lightning ``ddp``.

Measured per trial, wall clock from the moment the benchmark starts the launcher's process:

- launch -> the first step completed by any worker, and -> every worker's first step (the
  last of the N ranks' first steps: when the whole job trains);
- lightning-elastic only, once every worker has stepped: the process that logged rank N - 1
  gets SIGKILL and the driver starts a replacement on the spare host. From the driver's
  events.jsonl: SIGKILL -> its ``worker_started``, and from that ``worker_started`` -> the
  first step completed by the new process (its start-up, rendezvous, state received and a
  step) and -> the ``round_formed`` listing it;
- what is left once the driver has exited on SIGTERM (up to 30 s): processes carrying the
  job's tag (harness.Job), fork server included, before the benchmark's own sweep kills them.

All "hosts" are this machine: with ``--preload`` every worker, replacement included, forks
from its one warm server; on a fleet each machine has a server of its own, and a machine's
first worker waits for that server's imports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
from harness import (Job, StepReader, Summary, TrialError, interleave, launcher_command, md_table,  # noqa: E402
                     tagged_processes, torchrun, values, wait_until, workload)
from measure.goodput import check_forked, read_events  # noqa: E402

TOOLS = ("le", "le+preload", "torchrun")
PRELOAD = "lightning.pytorch"
STEPS = 10**6  # never reached: the job is stopped once measured
CADENCE = ("--commit-every", "10", "--check-every", "1")
START_TIMEOUT = 300.0
REPLACEMENT_TIMEOUT = 120.0
EXIT_GRACE = 30.0
NO_EXIT = f"the launcher itself (no exit within {EXIT_GRACE:.0f} s of SIGTERM)"


def command(tool: str, workers: int, directory: Path) -> list[str]:
    if tool == "torchrun":
        inner = workload("lightning_train.py", "--strategy", "ddp", "--model", "small", "--steps", STEPS,
                         "--log-dir", directory / "steps")
        return torchrun(workers, inner)
    inner = workload("lightning_train.py", "--strategy", "elastic_hvd", "--model", "small", "--steps", STEPS,
                     "--log-dir", directory / "steps", *CADENCE)
    hosts = ",".join(f"127.0.0.{i + 1}:1" for i in range(workers + 1))  # one spare, for the replacement
    preload = ("--preload", PRELOAD) if tool == "le+preload" else ()
    return [*launcher_command(), "launch", "-np", str(workers), "--min-np", "1", "--max-np", str(workers),
            "-H", hosts, *preload, "--log-dir", str(directory / "launch"), *inner]


def first_steps(records: list[dict]) -> dict[int, dict]:
    """Each process's first step record, by pid."""
    firsts: dict[int, dict] = {}
    for record in sorted(records, key=lambda r: r["t"]):
        firsts.setdefault(record["pid"], record)
    return firsts


def measure(tool: str, workers: int):
    def run(index: int, directory: Path) -> dict[str, Any]:
        reader = StepReader(directory / "steps")
        launched = time.time()
        job = Job(command(tool, workers, directory), directory)
        try:
            def all_stepped() -> bool:
                reader.poll()
                return len({r["rank"] for r in reader.records if r["size"] == workers}) == workers

            if not wait_until(all_stepped, START_TIMEOUT, job, interval=0.1):
                raise TrialError(f"not every worker stepped within {START_TIMEOUT:.0f} s (exit status "
                                 f"{job.poll()}); last output:\n{job.tail()}")
            firsts = [r for r in first_steps(reader.records).values() if r["size"] == workers]
            by_rank: dict[int, float] = {}
            for record in firsts:
                by_rank.setdefault(record["rank"], record["t"])
            result: dict[str, Any] = {
                "first_step_s": round(min(by_rank.values()) - launched, 3),
                "all_stepped_s": round(max(by_rank.values()) - launched, 3),
                "first_step_by_rank_s": {str(k): round(v - launched, 3) for k, v in sorted(by_rank.items())},
            }
            if tool.startswith("le"):
                result["replacement"] = replace_one(job, reader, directory, workers)
                if tool == "le+preload":
                    check_forked(job.output_path.read_text(errors="replace"))
            result["left_after_exit"] = stop_driver(job)
            return result
        finally:
            job.stop()
    return run


def replace_one(job: Job, reader: StepReader, directory: Path, workers: int) -> dict[str, Any]:
    """SIGKILL the process that last logged rank N - 1; the replacement's start, first step and join."""
    reader.poll()
    victim = next(r for r in reversed(reader.records) if r["rank"] == workers - 1)
    seen = {r["pid"] for r in reader.records}
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)

    def new_process() -> dict | None:
        reader.poll()
        return next((r for r in reader.records if r["pid"] not in seen and r["t"] > killed_at), None)

    stepped = wait_until(new_process, REPLACEMENT_TIMEOUT, job, interval=0.1)
    if stepped is None:
        raise TrialError(f"no step by a replacement within {REPLACEMENT_TIMEOUT:.0f} s of the kill; "
                         f"last output:\n{job.tail()}")
    events = read_events(directory / "launch" / "events.jsonl")
    started = next((e for e in events if e.get("kind") == "worker_started" and e["time"] >= killed_at), None)
    if started is None:
        raise TrialError("a new process stepped, but the driver's events.jsonl has no worker_started after the kill")
    joined = next((e["time"] for e in events if e.get("kind") == "round_formed" and e["time"] >= started["time"]
                   and any(m.get("worker") == started["worker"] for m in e.get("members", []))), None)
    return {
        "kill_to_started_s": round(started["time"] - killed_at, 3),
        "started_to_first_step_s": round(stepped["t"] - started["time"], 3),
        "started_to_joined_s": round(joined - started["time"], 3) if joined else None,
        "first_size": stepped["size"],
    }


def stop_driver(job: Job) -> list[str]:
    """SIGTERM the launcher's process group, wait for it; the job's processes still there after (cmdlines)."""
    try:
        os.killpg(job.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if job.wait(EXIT_GRACE) is None:
        return [NO_EXIT]
    deadline = time.monotonic() + 5
    while (left := tagged_processes(job.tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    shown = []
    for pid in left:
        try:
            shown.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            pass
    return shown


def report(result: dict[str, Any]) -> str:
    rows = []
    for key, entry in result["runs"].items():
        trials = entry["trials"]

        def summary(get, trials=trials) -> str:
            return Summary.of(values(trials, get)).show(unit=" s")

        def replaced(name: str, trials=trials) -> str:
            if not entry["tool"].startswith("le"):
                return ""
            return summary(lambda v: v["replacement"][name])

        lefts = [t["value"]["left_after_exit"] for t in trials if t["ok"]]
        stuck = sum(NO_EXIT in left for left in lefts)
        left = str(sum(len(x) for x in lefts if NO_EXIT not in x))
        if stuck:
            left += f"; launcher still running {EXIT_GRACE:.0f} s after SIGTERM in {stuck} of {len(lefts)}"
        rows.append([entry["label"], str(entry["workers"]), summary(lambda v: v["first_step_s"]),
                     summary(lambda v: v["all_stepped_s"]), replaced("kill_to_started_s"),
                     replaced("started_to_first_step_s"), replaced("started_to_joined_s"), left])
    notes = [f"- {key}: {t['error'].splitlines()[0]}" for key, entry in result["runs"].items()
             for t in entry["trials"] if not t["ok"]]
    return ("Start-up, Lightning small model, N local workers, median (range) over trials:\n\n"
            + md_table(["tool", "N", "launch -> first worker's first step", "launch -> every worker's first step",
                        "replacement: kill -> started", "started -> its first step", "started -> in a round",
                        "processes left after the driver exited"], rows)
            + ("\n\nFailed trials:\n" + "\n".join(notes) if notes else ""))


LABELS = {"le": "lightning-elastic launch (cold)", "le+preload": f"lightning-elastic launch --preload {PRELOAD}",
          "torchrun": "torchrun --standalone (Lightning ddp)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="3,6", help="comma-separated worker counts (default 3,6)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"a subset of {','.join(TOOLS)}")
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    parser.add_argument("--workdir", type=Path, required=True, help="every trial's logs go here")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.workers.split(",") if n]
    except ValueError:
        parser.error(f"--workers: expected counts separated by commas, got {args.workers!r}")
    if not counts or any(n < 2 or n > 250 for n in counts):
        parser.error(f"--workers: expected counts from 2 to 250, got {args.workers!r}")
    tools = [t for t in args.tools.split(",") if t]
    if bad := [t for t in tools if t not in TOOLS]:
        parser.error(f"--tools: unknown tool(s) {', '.join(bad)}; choose from {', '.join(TOOLS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    document: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
                                "environment": harness.environment(), "results": {}}
    began = time.monotonic()
    entries = {f"{tool}/{n}": {"tool": tool, "workers": n, "label": LABELS[tool]} for n in counts for tool in tools}
    try:
        plan = {key: (args.trials, measure(entry["tool"], entry["workers"])) for key, entry in entries.items()}
        results, skipped = interleave("startup", plan, args.workdir,
                                      lambda v: f"every worker stepped {v['all_stepped_s']:.2f} s after launch")
        document["results"] = {"runs": {key: {**entry, "trials": results[key], "skipped": skipped.get(key)}
                                        for key, entry in entries.items()}}
        print("\n" + report(document["results"]))
    finally:
        harness.stop_all()
        document["duration_s"] = round(time.monotonic() - began, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=1))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
