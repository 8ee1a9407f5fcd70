"""Goodput under a failure rate: a SIGKILL every P seconds, capacity returned, training kept per second.

Small model, 3 workers, one job per trial run for ``duration`` seconds of training (90 by
default; the clock starts at the first step completed at full size). Every ``period``
seconds (10 by default; ``None``: the failure-free run) the process that last logged rank 1,
then rank 2, then rank 1, ... gets SIGKILL (rank 0 is never the victim, so rank 0's step
records are the job's step executions; a kill waits until the job has trained since the
previous one). Per tool (trials interleaved):

- ``le/loop``: workloads/loop.py in ``@le.run`` (commit every 10 steps, check every step),
  ``lightning-elastic launch -np 3 --min-np 1 --max-np 3 --host-discovery-script FILE
  --discovery-interval 0.2``; the script prints a hosts file the benchmark rewrites
  (127.0.0.1, .2, ..., one slot each). A killed worker's host stays blacklisted, so
  capacity comes back on a new address each time, three ways (``CAPACITY``):
  ``fresh``: 3 hosts; after each kill a new host is added to the discovery output;
  ``spare``: 4 hosts from the start, and a new one after each kill (always a spare listed
  beyond the 3 in use): the driver can start a replacement at once;
  ``spares``: as ``spare``, with ``--spares 1`` (one worker started and waiting at the
  rendezvous); skipped, with the reason, when the installed CLI does not know ``--spares``.
  The failure-free run (``none``) lists 3 hosts.
- ``le/lightning``: workloads/lightning_train.py, ``elastic_hvd``, the same launch and cadence.
- ``le/loop+preload``, ``le/lightning+preload``: the same with ``--preload torch`` and
  ``--preload lightning.pytorch`` (``PRELOAD``): every worker, replacements included, forked
  from the driver's fork server, which imported the module once. On this one machine every
  loopback "host" is the driver's own, so a fresh host forks from the warm server too (on a
  fleet, a new machine would import for itself). A trial whose job printed the launcher's
  "starting cold" line (a worker that was not forked), or that never started a fork server,
  fails with that line.
- ``torchrun/loop``, ``torchrun/lightning`` (Lightning ``ddp``): ``torchrun --standalone
  --nproc-per-node 3 --max-restarts 1000`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (as in measure/recovery.py): a lost worker restarts every worker, which resume from
  the checkpoint on disk that a torchrun user keeps: rank 0 saves every 10 steps (the
  elastic runs' commit cadence; loop.py ``--checkpoint-dir``: ``torch.save`` of model,
  optimizer and step; Lightning: ``ModelCheckpoint(every_n_train_steps=10, save_last=True)``
  and ``fit(ckpt_path=last.ckpt)``).
- ``torchft``: benchmarks/peers/torchft_loop.py, 3 replica groups of one process and a
  lighthouse (peers/torchft_recovery.py's settings); a killed replica is started again at
  once, as torchrun ``--max-restarts`` would restart its group, and heals from a peer.
  Skipped, with the reason, when torchft cannot run here.

Measured per trial, from the step logs (``StepReader``) and the kill times:

- goodput: samples in the final state per second: the steps of the state the job holds
  at the end of the window (a step redone after a rollback counts once, in its last
  execution; a step lost to a rollback after the end does not count), each step's world
  size x batch 64, over the window's seconds. Reported against the same tool's
  failure-free run of the same trial index, and against the run's own full-world pace (3 x
  64 samples per step over the mean interval between consecutive full-size steps of the final
  state, leaving out intervals that span a kill: ``pace_by_size``);
- steps redone per failure: steps executed in the window (rank 0's records) minus steps of
  the final state, over the kills;
- per failure: SIGKILL -> the first step completed by a survivor in the next round (at a
  smaller size, or at full size when a waiting worker took the victim's place; torchrun
  restarts all: its first step after is at full size), and SIGKILL -> the first step back
  at full size (``None`` when the next kill came first); for lightning-elastic also SIGKILL
  -> the driver's ``worker_failed`` and ``round_formed`` events (its events.jsonl:
  ``driver_times``), which split a slow recovery into the driver's part and the workers'.
- the pace below full size split by whether a replacement was starting meanwhile (from
  the driver's ``worker_started`` to the round it joins: ``pace_below_full``): on one
  machine its interpreter and imports take the survivors' cores, which on its own machine
  they would not.

A run that stops training (no step within ``bound`` s of a kill, or the job ended) is a
failed trial, with the job's last output kept in the results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from harness import (Job, Skipped, StepReader, Summary, TrialError, failures, interleave, launcher_command,
                     md_table, torchrun, values, wait_until, workload)

WORKERS = 3
BATCH = 64  # the small model's batch per worker (workloads/_shared.py)
STEPS = 10**6  # never reached: the job is stopped at the end of the window
CADENCE = ("--commit-every", "10", "--check-every", "1")
CHECKPOINT_EVERY = 10  # torchrun's checkpoint to disk, at the elastic runs' commit cadence
MAX_RESTARTS = 1000  # torchrun: more than any run here can use
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
DISCOVERY_INTERVAL = 0.2
POLL = 0.05  # seconds between looks at the step logs while a run goes on

# Capacity modes: hosts listed at the start, extra launch flags.
CAPACITY = {
    "fresh": ("a fresh host added after each kill", WORKERS, ()),
    "spare": ("a spare host listed (4 hosts; one added after each kill)", WORKERS + 1, ()),
    "spares": ("--spares 1 (a worker waiting; a host added after each kill)", WORKERS + 1, ("--spares", "1")),
}
WORKLOADS = {
    "loop": ("loop.py", "@le.run loop", "DDP loop, torchrun (checkpoint every 10)"),
    "lightning": ("lightning_train.py", "Lightning elastic_hvd", "Lightning ddp, torchrun (checkpoint every 10)"),
}
TORCHFT_LABEL = "torchft (peers/torchft_loop.py, replica restarted)"
# --preload for the "+preload" tools by default: what each workload's script imports at its
# top (Settings.preload overrides: the loop's DDP imports torch._dynamo lazily, ~1 s more).
PRELOAD = {"loop": "torch", "lightning": "lightning.pytorch"}
TOOLS = ("le/loop", "le/lightning", "le/loop+preload", "le/lightning+preload", "torchrun/loop",
         "torchrun/lightning", "torchft")
DEFAULT_TOOLS = ("le/loop", "le/lightning", "torchrun/loop", "torchrun/lightning", "torchft")
# The launcher's lines (fork_client.py, warm_start.py, fork_server.py) that tell whether the
# workers of a --preload job were forked.
COLD_MARK = "starting cold"
SERVER_MARK = "fork from a server that preloads"
SERVER_GONE_MARKS = ("the fork server ended while worker process", "--preload: cannot import",
                     "cannot start the fork server")


@dataclasses.dataclass(frozen=True)
class Settings:
    periods: tuple[float, ...]  # seconds between kills; the failure-free run is always added
    duration: float  # seconds of training per run
    trials: int
    modes: tuple[str, ...]  # subset of CAPACITY
    bound: float  # seconds to wait for a step after a kill
    tools: tuple[str, ...] = DEFAULT_TOOLS
    failure_free: bool = True  # also run each tool without kills (the "/ failure-free" column)
    preload: dict[str, str] = dataclasses.field(default_factory=lambda: dict(PRELOAD))  # workload -> --preload
    start_timeout: float = 300.0
    # Workers start at this nice value and take normal priority once joined
    # (workloads/startup_priority.py): a replacement's start-up then takes little of the
    # survivors' cores, as on another machine. None: every process at normal priority.
    startup_nice: int | None = None


# ----- one run --------------------------------------------------------------------------------

class Running(Protocol):
    """A job under test: its step log, its status, what it does after a kill, how to stop it."""

    reader: StepReader

    def poll(self) -> int | None: ...  # the job's exit status, None while it runs

    def tail(self) -> str: ...

    def lost(self, victim: dict) -> None: ...  # right after the SIGKILL: return the capacity

    def stop(self) -> None: ...


class Discovery:
    """A host discovery script printing ``hosts.txt``, which the benchmark rewrites (atomically)."""

    def __init__(self, directory: Path, count: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = directory / "hosts.txt"
        self.script = directory / "discover.sh"
        self.script.write_text(f"#!/bin/sh\nexec cat '{self.file}'\n")
        self.script.chmod(0o755)
        self.count = 0
        self.write(count)

    def write(self, count: int) -> None:
        self.count = count
        tmp = self.file.with_name("hosts.tmp")
        tmp.write_text("".join(f"{loopback(i)}:1\n" for i in range(count)))
        os.replace(tmp, self.file)

    def add(self) -> None:
        self.write(self.count + 1)


def loopback(index: int) -> str:
    """The ``index``-th loopback "host": 127.0.0.1, 127.0.0.2, ... (then 127.0.1.1, ...)."""
    return f"127.0.{index // 254}.{index % 254 + 1}"


class JobRun:
    """A launcher's job (``harness.Job``); after a kill, one more host listed when ``discovery`` is set."""

    def __init__(self, command: Sequence[str], directory: Path, env: dict[str, str] | None = None,
                 discovery: Discovery | None = None) -> None:
        self.job = Job(command, directory, env)
        self.reader = StepReader(directory / "steps")
        self.discovery = discovery

    def poll(self) -> int | None:
        return self.job.poll()

    def tail(self) -> str:
        return self.job.tail()

    def output(self) -> str:
        """The job's whole output (the driver's, with its workers' lines)."""
        try:
            return self.job.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def lost(self, victim: dict) -> None:
        if self.discovery is not None:
            self.discovery.add()

    def stop(self) -> None:
        self.job.stop()


class TorchftRun:
    """torchft's lighthouse and replica groups (peers/torchft_recovery.Trial); a lost replica starts again."""

    def __init__(self, directory: Path) -> None:
        try:
            from peers import PeerUnavailable, torchft_recovery
        except Exception as err:  # noqa: BLE001  (any import failure: the peer cannot run here)
            raise Skipped(f"cannot import benchmarks/peers/torchft_recovery.py: {type(err).__name__}: {err}") from None
        try:
            binary = torchft_recovery.lighthouse_binary()
        except PeerUnavailable as err:
            raise Skipped(str(err)) from None
        self.trial = torchft_recovery.Trial(directory, torchft_recovery.LIGHTHOUSE, torchft_recovery.REPLICA)
        self.replicas = {}
        try:
            self.replicas = dict(enumerate(self.trial.start(binary)))
        except BaseException:
            self.trial.stop()
            raise
        self.reader = StepReader(self.trial.log_dir)

    def poll(self) -> int | None:
        return self.trial.procs[0].poll()  # the lighthouse: replicas come and go

    def tail(self) -> str:
        lines = []
        for replica in self.replicas:
            try:
                text = (self.trial.dir / f"replica-{replica}.log").read_text(errors="replace")
            except OSError:
                continue
            lines += [f"[replica {replica}] {line}" for line in text.splitlines()[-5:]]
        return "\n".join(lines)

    def lost(self, victim: dict) -> None:
        replica = victim["rank"]
        proc = self.replicas.get(replica)
        if proc is not None and proc.pid == victim["pid"]:
            try:
                proc.wait(10)  # reaped: its store port and lighthouse entry are free again
            except Exception:  # noqa: BLE001  (a stuck exit: start the new one anyway)
                pass
        self.replicas[replica] = self.trial.start_replica(replica)

    def stop(self) -> None:
        self.trial.stop()


def drive(run: Running, period: float | None, duration: float, bound: float, start_timeout: float,
          workers: int = WORKERS, jitter: Sequence[float] = ()) -> tuple[float, list[dict]]:
    """Train ``duration`` s from the first full-size step, SIGKILL every ``period`` s; (t0, kills).

    ``jitter``: seconds added to each kill's time in turn (none: every ``period`` s exactly;
    with steps of seconds, a period that is a multiple of the commit cycle would hit the same
    point of it every time). Returns once the job has trained after its last kill (so the
    final state is known), or raises TrialError. The caller stops the job.
    """
    reader = run.reader

    def full_size() -> dict | None:
        reader.poll()
        return next((r for r in reader.records if r["size"] == workers), None)

    first = wait_until(full_size, start_timeout, run)
    if first is None:
        raise TrialError(f"no step at world size {workers} within {start_timeout:.0f} s "
                         f"(exit status {run.poll()}); last output:\n{run.tail()}")
    t0 = first["t"]
    end = t0 + duration
    kills: list[dict] = []
    while period and t0 + (len(kills) + 1) * period < end:
        shift = jitter[len(kills)] if len(kills) < len(jitter) else 0.0
        _sleep_until(t0 + (len(kills) + 1) * period + shift, run)
        if kills:
            _await_recovery(run, kills[-1], bound)
        victim = _victim(reader, 1 + len(kills) % (workers - 1), {k["pid"] for k in kills})
        if victim is None:  # a world of one: killing rank 0 would end the job, not test recovery
            kills.append({"skipped": True, "at": time.time()})
            continue
        seen = len(reader.records)  # what the reader held before the kill: later records come after
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        kills.append({"at": killed_at, "pid": victim["pid"], "rank": victim["rank"], "size": victim["size"],
                      "step": victim["step"], "seen": seen})
        run.lost(victim)
    _sleep_until(end, run)
    real = [k for k in kills if not k.get("skipped")]
    if real:
        _await_recovery(run, real[-1], bound)
    return t0, kills


def _sleep_until(moment: float, run: Running) -> None:
    while (left := moment - time.time()) > 0:
        if run.poll() is not None:
            raise TrialError(f"the job ended (status {run.poll()}) during the run; last output:\n{run.tail()}")
        time.sleep(min(left, POLL))
    run.reader.poll()


def _await_recovery(run: Running, kill: dict, bound: float) -> None:
    """Wait until the round after ``kill`` completed a step (``next_round``); TrialError if none in ``bound``."""
    if kill.get("skipped"):
        return
    records = run.reader.records
    before = {r["pid"] for r in records[:kill["seen"]]}
    cursor = kill["seen"]  # records are appended in the order read: look at each once

    def trained() -> bool:
        nonlocal cursor
        run.reader.poll()
        new, cursor = records[cursor:], len(records)
        return any(next_round(r, kill, before) for r in new)

    if not wait_until(trained, bound, run, interval=POLL):
        ended = run.poll()
        why = f"the job ended (status {ended})" if ended is not None else f"none within {bound:.0f} s"
        raise TrialError(f"no recovery: {why} after the kill at step {kill['step']}; last output:\n{run.tail()}")


def _victim(reader: StepReader, rank: int, dead: set[int]) -> dict | None:
    """The live process that last logged ``rank`` (else another non-zero rank) in the latest round."""
    reader.poll()
    recent = reader.records[-200:]
    zero = {r["pid"] for r in recent if r["rank"] == 0}  # never the victim, whatever rank it had before
    latest: dict[int, dict] = {}
    for record in reversed(recent):
        if record["pid"] not in dead | zero and record["rank"] not in latest:
            latest[record["rank"]] = record
    alive = {k: r for k, r in latest.items() if k != 0 and _alive(r["pid"])}
    if not alive:
        return None
    return alive.get(rank) or alive[max(alive)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----- what a run's records say ---------------------------------------------------------------

def final_state(executions: list[dict]) -> list[dict]:
    """The executions whose steps make the final state: each step's last execution on the surviving line.

    ``executions`` are rank 0's records in time order. A step ``s`` is trained from the state
    after step ``s - 1``: an execution of ``s`` replaces every step from ``s`` on.
    """
    line: list[dict | None] = []
    for record in executions:
        del line[record["step"] - 1:]
        line += [None] * (record["step"] - 1 - len(line))  # steps before the log began (none here)
        line.append(record)
    return [r for r in line if r is not None]


def analyse(records: list[dict], kills: list[dict], t0: float, end: float, workers: int = WORKERS,
            batch: int = BATCH) -> dict[str, Any]:
    """Goodput, steps redone, full-world pace and per-failure times of one run."""
    records = sorted(records, key=lambda r: r["t"])
    executions = [r for r in records if r["rank"] == 0]
    # The line as finally observed (the run went on until it trained after its last kill),
    # cut at the end of the window: what the job held at ``end``.
    kept = [r for r in final_state(executions) if t0 < r["t"] <= end]
    executed = [r for r in executions if t0 < r["t"] <= end]
    samples = sum(r["size"] * batch for r in kept)
    real = [k for k in kills if not k.get("skipped")]
    paces = pace_by_size(kept, [k["at"] for k in real], batch)
    pace = paces.get(workers)
    goodput = samples / (end - t0)
    return {
        "t0": t0,  # with the kills' times, what it takes to analyse the step logs again
        "kill_times": [k["at"] for k in real],
        "window_s": round(end - t0, 3),
        "samples": samples,
        "goodput": goodput,
        "full_pace": pace,
        "pace_ratio": goodput / pace if pace else None,
        "pace_by_size": {str(size): round(value, 1) for size, value in sorted(paces.items())},
        "steps_final": len(kept),
        "steps_executed": len(executed),
        "redone_per_failure": (len(executed) - len(kept)) / len(real) if real else None,
        "kills": len(real),
        "kills_skipped": len(kills) - len(real),
        "failures": [failure(records, kill, nxt, t0, workers) for kill, nxt in zip(real, [*real[1:], None])],
    }


def next_round(record: dict, kill: dict, before: set[int]) -> bool:
    """Whether ``record`` is a step of a round formed after ``kill``.

    Completed after the kill, not by the victim, and at another size than the kill's or by a
    process that had not logged before it (``before``): a step completed at the old size by
    survivors just after the kill, with the victim's share already in, is the old round's.
    """
    return (record["t"] > kill["at"] and record["pid"] != kill["pid"]
            and (record["size"] != kill["size"] or record["pid"] not in before))


def pace_by_size(kept: list[dict], kills: list[float], batch: int) -> dict[int, float]:
    """Samples per second at each world size, over consecutive steps of the final state at that size.

    A mean over the intervals (commits, checks and stalls included: what a run at that size
    keeps up), leaving out those that span a kill or a change of size (the failures' cost).
    """
    spans: dict[int, list[float]] = {}
    for a, b in zip(kept, kept[1:]):
        if a["size"] != b["size"] or any(a["t"] < k < b["t"] for k in kills):
            continue
        steps_seconds = spans.setdefault(b["size"], [0, 0.0])
        steps_seconds[0] += 1
        steps_seconds[1] += b["t"] - a["t"]
    return {size: n * size * batch / seconds for size, (n, seconds) in spans.items() if seconds > 0}


def failure(records: list[dict], kill: dict, following: dict | None, t0: float, workers: int) -> dict[str, Any]:
    """SIGKILL -> the first step of the next round (``next_round``), and -> the first step back at full size."""
    at = kill["at"]
    before = {r["pid"] for r in records if r["t"] <= at}
    horizon = following["at"] if following else float("inf")
    after = [r for r in records if at < r["t"] < horizon and r["pid"] != kill["pid"]]
    first = next((r for r in after if next_round(r, kill, before)), None)
    back = next((r for r in after if first and r["t"] >= first["t"] and r["size"] == workers), None)
    return {
        "at_s": round(at - t0, 3), "victim_rank": kill["rank"], "size_at_kill": kill["size"],
        "step_at_kill": kill["step"],
        "first_step_s": first["t"] - at if first else None,
        "first_size": first["size"] if first else None,
        "first_resumed_step": first["step"] if first else None,
        "full_size_s": back["t"] - at if back else None,
    }


def read_events(events_path: Path) -> list[dict]:
    """The driver's events.jsonl (empty when the tool has no such driver)."""
    if not events_path.exists():
        return []
    events = []
    for line in events_path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the job's stop
    return events


def driver_times(result: dict[str, Any], events: list[dict]) -> None:
    """Add to each failure when the driver saw it and formed the next round (its events.jsonl), if it ran.

    ``noticed_s``: SIGKILL -> the driver's ``worker_failed``; ``formed_s``: -> the next
    ``round_formed``. What is left up to ``first_step_s`` is the workers' own re-formation
    (process group, state restored) and the step itself.
    """
    for at, failed in zip(result["kill_times"], result["failures"]):
        after = [e for e in events if e.get("time", 0) >= at]
        noticed = next((e["time"] for e in after if e["kind"] == "worker_failed"), None)
        formed = next((e["time"] for e in after if e["kind"] == "round_formed"), None)
        failed["noticed_s"] = round(noticed - at, 4) if noticed else None
        failed["formed_s"] = round(formed - at, 4) if formed else None


def pace_below_full(records: list[dict], events: list[dict], result: dict[str, Any], workers: int = WORKERS,
                    batch: int = BATCH) -> None:
    """Split the pace below full size by whether a replacement was starting meanwhile.

    A worker is "starting" from the driver's ``worker_started`` until the first
    ``round_formed`` that lists it among its members: the time its interpreter and imports
    share the machine's cores with the survivors. Intervals of consecutive steps of the final
    state at one size below ``workers``, none spanning a kill, as in ``pace_by_size``, each
    counted as "starting" when one started when the interval began, else "idle"; samples per
    second per size and split (``None`` without such steps).
    """
    starting: list[tuple[float, float]] = []
    for event in events:
        if event.get("kind") != "worker_started":
            continue
        joined = next((e["time"] for e in events if e.get("kind") == "round_formed" and e["time"] >= event["time"]
                       and any(m.get("worker") == event.get("worker") for m in e.get("members", []))),
                      float("inf"))
        starting.append((event["time"], joined))
    if not starting:
        return
    executions = [r for r in sorted(records, key=lambda r: r["t"]) if r["rank"] == 0]
    kept = [r for r in final_state(executions) if result["t0"] < r["t"] <= result["t0"] + result["window_s"]]
    kills = result["kill_times"]
    spans: dict[int, dict[str, list[float]]] = {}
    for a, b in zip(kept, kept[1:]):
        if a["size"] != b["size"] or b["size"] >= workers or any(a["t"] < k < b["t"] for k in kills):
            continue
        busy = any(begun <= a["t"] < joined for begun, joined in starting)
        split = spans.setdefault(b["size"], {"starting": [0, 0.0], "idle": [0, 0.0]})["starting" if busy else "idle"]
        split[0] += b["size"] * batch
        split[1] += b["t"] - a["t"]
    result["pace_below_full"] = {
        str(size): {name: round(samples / seconds, 1) if seconds > 0 else None
                    for name, (samples, seconds) in splits.items()}
        for size, splits in sorted(spans.items())}


# ----- the section ----------------------------------------------------------------------------

def period_key(period: float | None) -> str:
    return "none" if not period else f"every-{period:g}s"


def plan_entries(settings: Settings) -> dict[str, dict[str, Any]]:
    """Every run of the section: key -> its description (tool, capacity, period, label)."""
    entries: dict[str, dict[str, Any]] = {}
    periods: list[float | None] = [None, *settings.periods] if settings.failure_free else list(settings.periods)
    for workload_name, (_, elastic_label, torchrun_label) in WORKLOADS.items():
        modules = settings.preload[workload_name]
        for tool, label, preload in ((f"le/{workload_name}", elastic_label, None),
                                     (f"le/{workload_name}+preload", f"{elastic_label} --preload {modules}", modules)):
            for period in periods:
                modes = ["none"] if period is None else list(settings.modes)
                for mode in modes:
                    entries[f"{tool}/{mode}/{period_key(period)}"] = {
                        "tool": tool, "workload": workload_name, "capacity": mode, "period": period,
                        "preload": preload,
                        "label": f"{label}, " + ("3 hosts" if mode == "none" else CAPACITY[mode][0])}
        for period in periods:
            entries[f"torchrun/{workload_name}/{period_key(period)}"] = {
                "tool": f"torchrun/{workload_name}", "workload": workload_name, "capacity": "restart",
                "period": period, "label": torchrun_label}
    for period in periods:
        entries[f"torchft/{period_key(period)}"] = {"tool": "torchft", "workload": "loop", "capacity": "restart",
                                                    "period": period, "label": TORCHFT_LABEL}
    return {key: entry for key, entry in entries.items() if entry["tool"] in settings.tools}


def run(settings: Settings, workdir: Path) -> dict[str, Any]:
    entries = plan_entries(settings)
    plan = {key: (settings.trials, _measure(entry, settings)) for key, entry in entries.items()}
    results, skipped = interleave("goodput", plan, workdir, _show)
    for key, reason in skipped.items():
        print(f"{key}: skipped ({reason})", flush=True)
    return {"workers": WORKERS, "batch": BATCH, "run_s": settings.duration, "periods_s": list(settings.periods),
            "bound_s": settings.bound, "startup_nice": settings.startup_nice, "failure_free": settings.failure_free,
            "preload": settings.preload,
            "runs": {key: {**entry, "trials": results[key], "skipped": skipped.get(key)}
                     for key, entry in entries.items()}}


def _show(value: dict[str, Any]) -> str:
    times = [f["first_step_s"] for f in value["failures"] if f["first_step_s"] is not None]
    return (f"{value['goodput']:.0f} samples/s, {value['kills']} kills"
            + (f", first step after a kill {max(times):.2f} s at most" if times else ""))


def _measure(entry: dict[str, Any], settings: Settings):
    def measure(index: int, directory: Path) -> dict[str, Any]:
        started = _start(entry, directory, settings.startup_nice)
        try:
            t0, kills = drive(started, entry["period"], settings.duration, settings.bound, settings.start_timeout)
        except TrialError:
            started.stop()
            _skip_unknown_option(started, entry)
            raise
        finally:
            started.stop()
        if entry.get("preload"):
            assert isinstance(started, JobRun)
            check_forked(started.output())
        started.reader.poll()
        result = analyse(started.reader.records, kills, t0, t0 + settings.duration)
        events = read_events(directory / "launch" / "events.jsonl")
        driver_times(result, events)
        pace_below_full(started.reader.records, events, result)
        return result
    return measure


def check_forked(output: str) -> None:
    """TrialError unless the job's output shows a fork server and no worker started cold (--preload)."""
    lines = output.splitlines()
    bad = [line for line in lines if COLD_MARK in line or any(mark in line for mark in SERVER_GONE_MARKS)]
    if bad:
        raise TrialError(f"--preload: {len(bad)} worker(s) not forked from the fork server: {bad[0].strip()}")
    if not any(SERVER_MARK in line for line in lines):
        raise TrialError("--preload: the launcher never said it started a fork server "
                         f"({SERVER_MARK!r} not in its output)")


def _start(entry: dict[str, Any], directory: Path, startup_nice: int | None = None) -> Running:
    if entry["tool"] == "torchft":
        return TorchftRun(directory)
    script = WORKLOADS[entry["workload"]][0]
    inner_args: tuple[str, ...]
    if entry["tool"].startswith("le/"):
        inner_args = CADENCE if script == "loop.py" else ("--strategy", "elastic_hvd", *CADENCE)
    else:
        inner_args = ("--checkpoint-dir", directory / "checkpoint", "--checkpoint-every", CHECKPOINT_EVERY)
        if script == "lightning_train.py":
            inner_args = ("--strategy", "ddp", *inner_args)
    inner = workload(script, "--model", "small", "--steps", STEPS, "--log-dir", directory / "steps", *inner_args)
    if entry["tool"].startswith("torchrun/"):
        return JobRun(torchrun(WORKERS, inner, max_restarts=MAX_RESTARTS), directory, TORCHRUN_ENV)
    mode = entry["capacity"]
    hosts, flags = (WORKERS, ()) if mode == "none" else CAPACITY[mode][1:]
    discovery = Discovery(directory / "discovery", hosts)
    preload = ("--preload", entry["preload"]) if entry.get("preload") else ()
    command = [*launcher_command(), "launch", "-np", str(WORKERS), "--min-np", "1", "--max-np", str(WORKERS),
               "--host-discovery-script", str(discovery.script), "--discovery-interval", str(DISCOVERY_INTERVAL),
               *flags, *preload, "--log-dir", str(directory / "launch"), *inner]
    env = {"BENCH_STARTUP_NICE": str(startup_nice)} if startup_nice else None
    return JobRun(command, directory, env, discovery=discovery if mode != "none" else None)


def _skip_unknown_option(started: Running, entry: dict[str, Any]) -> None:
    """A launcher without ``--spares`` exits 2 with argparse's message: no further trials of the mode."""
    if entry["capacity"] == "spares" and started.poll() == 2 and "unrecognized arguments" in started.tail():
        raise Skipped("the installed lightning-elastic does not know --spares (launch exited 2: "
                      "unrecognized arguments)")


# ----- the report -----------------------------------------------------------------------------

def paired(trials: list[dict], baseline: list[dict], get) -> list[float | None]:
    """value / the failure-free run's value, per trial index (None where either failed)."""
    mine, theirs = values(trials, get), values(baseline, get)
    return [a / b if a is not None and b else None for a, b in zip(mine, theirs)]


def _pooled(trials: list[dict], key: str) -> list[float | None]:
    return [f.get(key) for t in trials if t["ok"] for f in t["value"]["failures"]]


def _times(got: list[float | None]) -> str:
    ok = [v for v in got if v is not None]
    if not got:
        return ""
    text = f"{statistics.median(ok):.2f} / {max(ok):.2f} s" if ok else "none"
    return text + (f" ({len(got) - len(ok)} none)" if len(ok) < len(got) else "")


def _every(period: float | None) -> str:
    return f"every {period:g} s" if period else "none"


def baseline_key(key: str, entry: dict[str, Any]) -> str:
    """The key of the failure-free run of the same tool (le/loop/fresh/every-10s -> le/loop/none/none)."""
    return key.rsplit("/", 2)[0] + "/none/none" if entry["tool"].startswith("le/") else key.rsplit("/", 1)[0] + "/none"


def _paces(trials: list[dict], workers: int) -> str:
    """Median samples/s at full size, then at each smaller size seen."""
    sizes = sorted({int(size) for t in trials if t["ok"] for size in t["value"]["pace_by_size"]}, reverse=True)
    shown = []
    for size in sizes:
        got = [t["value"]["pace_by_size"].get(str(size)) for t in trials if t["ok"]]
        ok = [g for g in got if g is not None]
        if ok:
            shown.append(f"{statistics.median(ok):.0f} at {size}")
    return ", ".join(shown)


def report(result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows, notes, goals = [], [], []
    for key, entry in runs.items():
        period = entry["period"]
        capacity = entry["capacity"]
        if entry["skipped"] and not entry["trials"]:
            rows.append([entry["label"], _every(period), f"skipped ({entry['skipped']})", *[""] * 7])
            continue
        trials = entry["trials"]
        baseline = runs.get(baseline_key(key, entry), {}).get("trials", [])
        goodput = Summary.of(values(trials, lambda v: v["goodput"]))
        ratio = Summary.of(paired(trials, baseline, lambda v: v["goodput"])) if period and baseline else None
        pace = Summary.of(values(trials, lambda v: v["pace_ratio"]))
        redone = Summary.of(values(trials, lambda v: v["redone_per_failure"]))
        first = _pooled(trials, "first_step_s")
        sizes = sorted({s for s in _pooled(trials, "first_size") if s is not None})
        rows.append([
            entry["label"], _every(period), goodput.show(fmt="{:.0f}"),
            ratio.show(fmt="{:.3f}") if ratio else ("1" if not period else "-"),
            pace.show(fmt="{:.3f}"),
            _paces(trials, result["workers"]),
            redone.show(fmt="{:.1f}") if period else "",
            _times(first) + (f" (size {'/'.join(map(str, sizes))})" if sizes else ""),
            _times(_pooled(trials, "full_size_s")),
            str(sum(t["value"]["kills"] for t in trials if t["ok"])) if period else "",
        ])
        notes += [f"- {key}: {e.splitlines()[0]}" for e in failures(trials)]
        if entry["tool"].startswith("le/") and period == 10 and capacity != "none":
            goals.append(_goal_line(entry, pace, ratio, first, trials))
    periods = ", ".join(f"{p:g} s" for p in result["periods_s"])
    nice = result.get("startup_nice")
    startup = (f"lightning-elastic's workers start at nice {nice} and take normal priority once joined "
               "(a replacement's start-up off the survivors' cores, as on another machine); ") if nice else ""
    return (f"Goodput, {result['workers']} workers, small model, {result['run_s']:.0f} s of training per run, "
            f"SIGKILL of rank 1 or 2 every {periods} (none: failure-free); {startup}medians over trials (range); "
            f"per-failure times pooled over trials, median / max:\n\n"
            + md_table(["tool, capacity", "SIGKILL", "goodput (samples/s)", "/ failure-free", "/ own full-world pace",
                        "pace by world size (samples/s)", "steps redone per failure",
                        "kill -> first step of next round", "kill -> full size", "failures"], rows)
            + ("\n\nAgainst the goals (issue 24), one failure per 10 s:\n" + "\n".join(goals) if goals else "")
            + ("\n\nFailed trials:\n" + "\n".join(notes) if notes else ""))


def _below_full(trials: list[dict], workers: int = WORKERS) -> str:
    """The median pace one short of full size while a replacement starts, and while none does."""
    shown = []
    for name, what in (("starting", "while a replacement starts"), ("idle", "while none does")):
        got = [t["value"].get("pace_below_full", {}).get(str(workers - 1), {}).get(name) for t in trials if t["ok"]]
        ok = [g for g in got if g is not None]
        if ok:
            shown.append(f"{statistics.median(ok):.0f} samples/s {what}")
    return f"pace at {workers - 1}: " + ", ".join(shown) if shown else ""


def _goal_line(entry: dict[str, Any], pace: Summary, ratio: Summary | None, first: list[float | None],
               trials: list[dict]) -> str:
    """Goodput >= 0.95 of the full-world pace; with a spare listed, every recovery <= 0.2 s (and where it went)."""
    line = (f"- {entry['label']}: goodput / own full-world pace {pace.show(fmt='{:.3f}')} (goal >= 0.95), "
            f"/ failure-free run {ratio.show(fmt='{:.3f}') if ratio else '-'}")
    below = _below_full(trials)
    if below:
        line += f"; {below}"
    seen = [v for v in first if v is not None]
    if entry["capacity"] == "fresh" or not first:
        return line
    slow = sum(v > 0.2 for v in seen) + len(first) - len(seen)
    line += (f"; kill -> first step of the next round {_times(first)} (median / max), {slow} of {len(first)} "
             f"over 0.2 s (goal: none)")
    noticed, formed = _pooled(trials, "noticed_s"), _pooled(trials, "formed_s")
    if any(v is not None for v in noticed + formed):
        line += f"; the driver saw the loss after {_times(noticed)}, formed the next round after {_times(formed)}"
    return line
