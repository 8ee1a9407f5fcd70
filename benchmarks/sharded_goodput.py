"""Sharded (FSDP2) training under a SIGKILL every 30 s: lightning-elastic against torchrun and DCP (issue 35).

    flock /tmp/le-cpu.lock .venv/bin/python benchmarks/sharded_goodput.py --workdir /tmp/sharded-goodput \\
        --out benchmarks/results/<date>-sharded-goodput.json

One command, every arm one after the other on this machine, the same model and data in
every arm (workloads/sharded_train.py: 24 Linear(2048, 2048) blocks and a head, 100.7M
parameters, each block and the root ``fully_shard``ed on a 1-D mesh, AdamW: 1.2 GB of
state; batch 8 per rank; gloo), 4 ranks:

- ``reference``: the failure-free pace: ``torchrun --standalone --nnodes 1 --nproc-per-node 4``,
  no checkpoint, no kill. Every goodput is divided by its samples per second.
- ``le``: ``lightning-elastic launch -np 4 --min-np 1 --max-np 4 --host-discovery-script FILE``
  on loopback hosts of one slot each (127.0.0.1 ... 127.0.0.4), ``le.ShardedState`` with a
  commit every ``--commit-every`` steps and a host check at every other step. A SIGKILL every
  ``--every`` seconds (of rank 1, 2, 3, 1, ...; never rank 0; each moved by a seeded offset of up
  to ``--jitter`` s either way, the same offsets in every arm: with steps of seconds, kills at
  exact multiples of 30 s would land at the same point of the commit cycle every time); the
  killed host stays blacklisted
  and the benchmark adds a fresh one to the discovery output at once (capacity returned, as
  measure/goodput.py's ``fresh`` mode): the survivors restore the last commit re-sharded to 3
  in their own processes, the driver starts a replacement on the new host, and the job takes
  it in at a later step with the live state (no rollback), the joiner receiving its rows in
  memory.
- ``le+preload``: the same with ``--preload`` (``--preload-modules``): the replacement is forked
  from a server that imported torch and FSDP once, instead of importing them itself on the
  survivors' cores (skipped with the reason if the CLI has no ``--preload``).
- ``torchrun/ckpt-N``, one run per N of ``--checkpoint-every``: ``torchrun --standalone --nnodes 1
  --nproc-per-node 4 --max-restarts 1000`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as the
  other torchrun measurements here); every N steps the ranks save a DCP checkpoint
  (``torch.distributed.checkpoint.save`` of ``get_state_dict``, on this machine's disk); a SIGKILL
  of one worker every ``--every`` seconds, and torchrun restarts all four, which load the newest
  complete checkpoint. The best N is torchrun's figure.

Measured per arm (``measure/goodput.py``'s accounting: ``drive``, ``analyse``): goodput = samples
of the state the job holds at the end of the window (a step redone after a rollback counts
once) per second, over the window (``--duration``, from the first step at full size), against
the reference's samples per second and against the arm's own pace at full size; steps redone
per failure; per kill: SIGKILL -> the first step completed after it by the next round (at 3 for
lightning-elastic, at 4 after torchrun's restart), -> that step's start (``began`` in the step
log: training resumed), and -> the first step back at 4; for lightning-elastic the driver's
``worker_failed`` and ``round_formed`` (events.jsonl) and the survivors' restore
(``Rank N: restored commit ...`` lines with their timestamps: bytes received from peers, the
transfer's time, the rebuild's, the whole restore's), the same for the joiner's restore; for
torchrun the DCP save per checkpoint and the load at each restart (bytes in the checkpoint);
peak RSS per process (VmHWM, logged at every step). A lightning-elastic job that ends because
it lost its sharded state (a commit no longer whole in memory, and no snapshot to fall back
on) is reported with what it trained until then and its own message.

Limits of this machine: 2 cores for 4 ranks (5 processes while a replacement starts), so
steps take seconds (gloo moves 400 MB per collective through loopback TCP) and a process
that imports torch slows the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
from harness import PYTHON, Skipped, TrialError, launcher_command, md_table, progress, workload  # noqa: E402
from measure import goodput  # noqa: E402

WORKERS = 4
BATCH = 8  # workloads/sharded_train.py's default batch per rank
SCRIPT = "sharded_train.py"
STEPS = 10**6  # never reached: each job is stopped at the end of its window
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
MAX_RESTARTS = 1000
DISCOVERY_INTERVAL = 0.2
PRELOAD = "torch,torch.distributed.fsdp,torch._dynamo"  # what the workload imports (FSDP2 imports dynamo lazily)
# The workload's log format for lightning-elastic's lines (workloads/sharded_train.py).
STAMPED = re.compile(r"lightning-elastic \[(?P<t>\d+\.\d+)\]: (?P<message>.*)")
RESTORED = re.compile(r"Rank (?P<rank>\d+): restored commit (?P<version>\d+) \(world size (?P<old>\d+) -> "
                      r"(?P<new>\d+)\); (?P<mb>[\d.]+) MB received from peers in (?P<transfer>[\d.]+) s "
                      r"\(whole restore (?P<whole>[\d.]+) s, of which model and optimizer rebuilt in "
                      r"(?P<rebuild>[\d.]+) s\)")
SAVED = re.compile(r"rank (?P<rank>\d+): saved checkpoint step (?P<step>\d+) in (?P<s>[\d.]+) s")
LOADED = re.compile(r"rank (?P<rank>\d+): loaded checkpoint step (?P<step>\d+) in (?P<s>[\d.]+) s "
                    r"\((?P<mb>[\d.]+) MB in the checkpoint\)")


@dataclasses.dataclass(frozen=True)
class Settings:
    every: float  # seconds between SIGKILLs
    duration: float  # seconds of training per lightning-elastic arm
    torchrun_duration: float  # per torchrun arm
    reference_duration: float
    commit_every: int
    checkpoint_every: tuple[int, ...]
    preload: str | None  # modules for le+preload; None: no such arm
    bound: float  # seconds to wait for a step after a kill
    start_timeout: float
    workload_args: tuple[str, ...]  # passed to the workload in every arm (the model)
    jitter: float = 0.0  # each kill moved by up to this many seconds either way (seeded)
    seed: int = 35


# ----- the arms -----------------------------------------------------------------------------------

def arms(settings: Settings) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {
        "reference": {"kind": "reference", "label": "failure-free: torchrun, no checkpoint (the reference)",
                      "duration": settings.reference_duration, "period": None},
        "le": {"kind": "le", "label": f"lightning-elastic, commit every {settings.commit_every}, a fresh host "
                                      "after each kill", "duration": settings.duration, "period": settings.every},
    }
    torchruns = {f"torchrun/ckpt-{n}": {"kind": "torchrun", "checkpoint_every": n,
                                        "label": f"torchrun --max-restarts {MAX_RESTARTS}, DCP checkpoint every {n} "
                                                 "steps, restart all", "duration": settings.torchrun_duration,
                                        "period": settings.every} for n in settings.checkpoint_every}
    later = list(torchruns.items())
    found.update(later[:1])  # the arms alternate, so a change in the machine's load falls on both tools
    if settings.preload:
        found["le+preload"] = {"kind": "le", "preload": settings.preload,
                               "label": f"lightning-elastic --preload {settings.preload}, commit every "
                                        f"{settings.commit_every}, a fresh host after each kill",
                               "duration": settings.duration, "period": settings.every}
    found.update(later[1:])
    return found


class Run(goodput.JobRun):
    """A job that remembers its kills (``drive`` keeps them to itself until it returns)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kills: list[dict[str, Any]] = []

    def lost(self, victim: dict) -> None:
        self.kills.append({"at": time.time(), "pid": victim["pid"], "rank": victim["rank"], "size": victim["size"],
                           "step": victim["step"]})
        super().lost(victim)


def start(entry: dict[str, Any], directory: Path, settings: Settings) -> Run:
    inner = workload(SCRIPT, "--steps", STEPS, "--log-dir", directory / "steps", *settings.workload_args)
    if entry["kind"] == "reference":
        return Run(torchrun_command(inner), directory, TORCHRUN_ENV)
    if entry["kind"] == "torchrun":
        inner += ["--checkpoint-dir", str(directory / "checkpoints"), "--checkpoint-every",
                  str(entry["checkpoint_every"])]
        return Run(torchrun_command(inner, MAX_RESTARTS), directory, TORCHRUN_ENV)
    discovery = goodput.Discovery(directory / "discovery", WORKERS)
    preload = ("--preload", entry["preload"]) if entry.get("preload") else ()
    command = [*launcher_command(), "launch", "-np", str(WORKERS), "--min-np", "1", "--max-np", str(WORKERS),
               "--host-discovery-script", str(discovery.script), "--discovery-interval", str(DISCOVERY_INTERVAL),
               *preload, "--log-dir", str(directory / "launch"), *inner, "--commit-every",
               str(settings.commit_every)]
    return Run(command, directory, discovery=discovery)


def jitters(settings: Settings) -> list[float]:
    """Each kill's offset from its multiple of ``every``: uniform in +-``jitter`` s, the same list in every arm."""
    rng = random.Random(settings.seed)
    return [round(rng.uniform(-settings.jitter, settings.jitter), 3) for _ in range(1000)]


def torchrun_command(inner: list[str], max_restarts: int | None = None) -> list[str]:
    """``torchrun --standalone --nnodes 1 --nproc-per-node 4`` (``inner`` starts with the interpreter: dropped)."""
    extra = ["--max-restarts", str(max_restarts)] if max_restarts is not None else []
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
            str(WORKERS), *extra, *inner[1:]]


def preload_supported() -> str | None:
    """None if ``lightning-elastic launch`` knows ``--preload``, else why not."""
    try:
        out = subprocess.run([*launcher_command(), "launch", "--help"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(harness.ROOT)})
    except (OSError, subprocess.SubprocessError) as err:
        return f"lightning-elastic launch --help failed: {err}"
    return None if "--preload" in out.stdout else "the installed lightning-elastic launch has no --preload"


def measure(entry: dict[str, Any], directory: Path, settings: Settings) -> dict[str, Any]:
    if directory.exists():
        shutil.rmtree(directory)
    loadavg = os.getloadavg()
    run = start(entry, directory, settings)
    lost = None
    try:
        t0, kills = goodput.drive(run, entry["period"], entry["duration"], settings.bound, settings.start_timeout,
                                  workers=WORKERS, jitter=jitters(settings))
        end = t0 + entry["duration"]
    except TrialError as err:
        # A lightning-elastic job that lost a commit ends: what it trained until then is kept,
        # with the reason, instead of a run with no figures (the failure is a finding).
        if entry["kind"] != "le" or not (lost := job_lost(run.output())) or not run.kills:
            raise
        run.reader.poll()
        t0 = next(r["t"] for r in sorted(run.reader.records, key=lambda r: r["t"]) if r["size"] == WORKERS)
        kills, end = run.kills, max(r["t"] for r in run.reader.records)
        progress(f"[sharded] the job ended after kill {len(kills)}: {lost} ({str(err).splitlines()[0]})")
    finally:
        run.stop()
    output = run.output()
    if entry.get("preload"):
        goodput.check_forked(output)
    run.reader.poll()
    records = sorted(run.reader.records, key=lambda r: r["t"])
    result = goodput.analyse(records, kills, t0, end, workers=WORKERS, batch=BATCH)
    result["job_lost"] = lost and {"after_kill": len(kills), "reason": lost, "at_s": round(end - t0, 1)}
    result["loadavg_start"], result["loadavg_end"] = loadavg, os.getloadavg()
    full = result["full_pace"]
    result["steady_step_s"] = WORKERS * BATCH / full if full else None
    result["peak_rss_mb"] = peak_rss(records)
    resumed_times(result, records, kills)
    if entry["kind"] == "le":
        goodput.driver_times(result, goodput.read_events(directory / "launch" / "events.jsonl"))
        resets = restores(output)
        result["resets"] = resets
        attribute_resets(result, resets, records)
    if entry["kind"] == "torchrun":
        result["checkpoints"] = checkpoints(output, result["kill_times"])
    return result


# ----- what the logs say ------------------------------------------------------------------------

LOST = re.compile(r"ElasticError: (sharded state lost from memory: [^\n]*)")


def job_lost(output: str) -> str | None:
    """The job's own words, when it ended because it lost its sharded state."""
    match = LOST.search(output)
    return match[1].strip() if match else None


def resumed_times(result: dict[str, Any], records: list[dict], kills: list[dict]) -> None:
    """Per failure: SIGKILL -> the start (``began``) of the first step of the next round: training resumed."""
    real = [k for k in kills if not k.get("skipped")]
    for kill, failed in zip(real, result["failures"]):
        before = {r["pid"] for r in records if r["t"] <= kill["at"]}
        first = next((r for r in records if r["pid"] != kill["pid"] and goodput.next_round(r, kill, before)), None)
        failed["resumed_s"] = round(first["began"] - kill["at"], 3) if first and "began" in first else None
        failed["first_step_own_s"] = round(first["t"] - first["began"], 3) if first and "began" in first else None


def peak_rss(records: list[dict]) -> dict[str, Any]:
    """The highest VmHWM any process logged, and the median of the processes' highest (MiB)."""
    per_pid: dict[int, int] = {}
    for r in records:
        if "hwm_mb" in r:
            per_pid[r["pid"]] = max(per_pid.get(r["pid"], 0), r["hwm_mb"])
    if not per_pid:
        return {}
    return {"max_mb": max(per_pid.values()), "median_mb": statistics.median(per_pid.values()),
            "processes": len(per_pid)}


def stamped_lines(output: str) -> list[tuple[float, str]]:
    """(time, message) of every timestamped lightning-elastic line of the job's output."""
    found = []
    for line in output.splitlines():
        if match := STAMPED.search(line):
            found.append((float(match["t"]), match["message"]))
    return found


def restores(output: str) -> list[dict[str, Any]]:
    """One record per reset that restored a commit: the ranks' restore lines taken together.

    A reset is the lines of one commit version and one change of world size; its ranks'
    restores overlap (every member takes part in the same transfers).
    """
    resets: list[dict[str, Any]] = []
    for at, message in stamped_lines(output):
        match = RESTORED.search(message)
        if not match:
            continue
        key = (int(match["version"]), int(match["old"]), int(match["new"]))
        line = {"rank": int(match["rank"]), "t": at, "mb": float(match["mb"]), "transfer_s": float(match["transfer"]),
                "whole_s": float(match["whole"]), "rebuild_s": float(match["rebuild"])}
        if resets and resets[-1]["key"] == key and at - resets[-1]["lines"][-1]["t"] < 30:
            resets[-1]["lines"].append(line)
        else:
            resets.append({"key": key, "lines": [line]})
    for reset in resets:
        lines = reset["lines"]
        version, old, new = reset.pop("key")
        reset.update({
            "version": version, "old_world": old, "new_world": new,
            "kind": "shrink" if new < old else "grow" if new > old else "same",
            "ranks": len(lines), "received_mb": round(sum(x["mb"] for x in lines), 1),
            "started": min(x["t"] - x["whole_s"] for x in lines), "ended": max(x["t"] for x in lines),
            "whole_s": max(x["whole_s"] for x in lines), "transfer_s": max(x["transfer_s"] for x in lines),
            "rebuild_s": max(x["rebuild_s"] for x in lines),
        })
    return resets


def attribute_resets(result: dict[str, Any], resets: list[dict[str, Any]], records: list[dict]) -> None:
    """Each failure's shrink (the survivors' restore at the smaller world) and the joiner's grow after it.

    ``join_pause_s``: how long rank 0 did not train while the replacement was taken in: from its
    last step at the smaller world to the start of its first step back at full size (the commit
    or check that saw the change, the commit of the live state, the new round, the restore).
    """
    kills = result["kill_times"]
    zero = [r for r in records if r["rank"] == 0]
    for index, (at, failed) in enumerate(zip(kills, result["failures"])):
        horizon = kills[index + 1] if index + 1 < len(kills) else float("inf")
        shrink = next((r for r in resets if r["kind"] == "shrink" and at < r["ended"] < horizon), None)
        grow = next((r for r in resets if r["kind"] == "grow" and at < r["ended"] < horizon), None)
        failed["join_pause_s"] = None
        if grow is not None:
            last = [r for r in zero if at < r["t"] < grow["ended"] and r["size"] < WORKERS]
            back = next((r for r in zero if r["t"] > grow["ended"] and r["size"] == WORKERS), None)
            if last and back and "began" in back:
                failed["join_pause_s"] = round(back["began"] - last[-1]["t"], 3)
        for name, reset in (("shrink", shrink), ("grow", grow)):
            failed[name] = None if reset is None else {
                "received_mb": reset["received_mb"], "transfer_s": reset["transfer_s"],
                "whole_s": reset["whole_s"], "rebuild_s": reset["rebuild_s"],
                "started_s": round(reset["started"] - at, 3), "ended_s": round(reset["ended"] - at, 3),
                "world": f"{reset['old_world']} -> {reset['new_world']}"}


def checkpoints(output: str, kill_times: list[float]) -> dict[str, Any]:
    """torchrun's DCP saves (the slowest rank's time per step saved) and loads (per restart)."""
    saves: dict[int, float] = {}
    loads: list[dict[str, float]] = []
    for line in output.splitlines():
        if match := SAVED.search(line):
            step = int(match["step"])
            saves[step] = max(saves.get(step, 0.0), float(match["s"]))
        elif match := LOADED.search(line):
            if loads and loads[-1]["step"] == int(match["step"]) and loads[-1]["ranks"] < WORKERS:
                loads[-1]["s"] = max(loads[-1]["s"], float(match["s"]))
                loads[-1]["ranks"] += 1
            else:
                loads.append({"step": int(match["step"]), "s": float(match["s"]), "mb": float(match["mb"]), "ranks": 1})
    return {"saves": len(saves), "save_s": sorted(saves.values()), "loads": loads}


# ----- the report ---------------------------------------------------------------------------------

def _median(values: list[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def _mm(values: list[float | None], fmt: str = "{:.2f}", unit: str = " s") -> str:
    """median / max (and how many had none)."""
    ok = [v for v in values if v is not None]
    if not values:
        return ""
    text = f"{fmt.format(statistics.median(ok))} / {fmt.format(max(ok))}{unit}" if ok else "none"
    return text + (f" ({len(values) - len(ok)} none)" if len(ok) < len(values) else "")


def _of(failures: list[dict], *path: str) -> list[float | None]:
    out = []
    for f in failures:
        value: Any = f
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out.append(value)
    return out


def reference_pace(results: dict[str, Any]) -> float | None:
    ref = results.get("reference", {})
    return ref["value"]["goodput"] if ref.get("ok") else None


def best_torchrun(results: dict[str, Any]) -> str | None:
    done = {k: r["value"]["goodput"] for k, r in results.items() if k.startswith("torchrun/") and r.get("ok")}
    return max(done, key=done.get) if done else None


def report(document: dict[str, Any]) -> str:
    results, entries = document["results"], document["arms"]
    pace = reference_pace(results)
    best = best_torchrun(results)
    rows, notes = [], []
    for key, entry in entries.items():
        record = results.get(key)
        if record is None:
            continue
        if not record.get("ok"):
            rows.append([entry["label"], record.get("skipped") and f"skipped ({record['skipped']})"
                         or "FAILED", *[""] * 10])
            if record.get("error"):
                notes.append(f"- {key}: {record['error'].splitlines()[0]}")
            continue
        v = record["value"]
        failures = v["failures"]
        sizes = sorted({s for s in _of(failures, "first_size") if s is not None})
        shrink_mb = _of(failures, "shrink", "received_mb")
        label = entry["label"] + (" **(torchrun's best N)**" if key == best else "")
        rows.append([
            label, (str(v["kills"]) + (f"; the job ended after kill {v['job_lost']['after_kill']} "
                                       f"({v['job_lost']['at_s']:.0f} s): commit lost" if v.get("job_lost") else "")
                    if entry["period"] else ""),
            f"{v['goodput']:.1f}", f"{v['goodput'] / pace:.3f}" if pace else "-",
            f"{v['pace_ratio']:.3f}" if v.get("pace_ratio") else "-",
            f"{v['steady_step_s']:.2f} s" if v.get("steady_step_s") else "-",
            f"{v['redone_per_failure']:.1f}" if v.get("redone_per_failure") is not None else "",
            _mm(_of(failures, "first_step_s")) + (f" (size {'/'.join(map(str, sizes))})" if sizes else ""),
            _mm(_of(failures, "resumed_s")),
            _mm(_of(failures, "full_size_s")) if entry["kind"] == "le" else "",
            (_mm(_of(failures, "shrink", "transfer_s")) + ", " + _mm(shrink_mb, "{:.0f}", " MB")
             if entry["kind"] == "le" else _load_cell(v) if entry["kind"] == "torchrun" else ""),
            f"{v['peak_rss_mb'].get('max_mb', 0):.0f} MB" if v.get("peak_rss_mb") else "",
        ])
    text = (f"Sharded (FSDP2) goodput, {WORKERS} ranks, {document['model']}, a SIGKILL every "
            f"{document['settings']['every']:g} s; reference pace {pace:.1f} samples/s" if pace else
            "Sharded (FSDP2) goodput (no reference pace)")
    text += (":\n\n" + md_table(
        ["arm", "kills", "goodput (samples/s)", "/ failure-free", "/ own pace at 4", "step at 4",
         "steps redone per failure", "kill -> first step completed, median / max", "kill -> training resumed",
         "kill -> back at 4", "re-shard at the smaller world: transfer time, MB received (lightning-elastic); "
         "DCP load at restart, MB (torchrun)", "peak RSS of a process"], rows))
    text += "\n\n" + breakdown(results, entries)
    text += "\n\n" + goals(results, entries, pace, best)
    if notes:
        text += "\n\nFailed arms:\n" + "\n".join(notes)
    return text


def _load_cell(v: dict[str, Any]) -> str:
    c = v.get("checkpoints", {})
    loads = c.get("loads", [])
    saves = c.get("save_s", [])
    cell = _mm([x["s"] for x in loads]) + (f", {loads[0]['mb']:.0f} MB" if loads else "")
    if saves:
        cell += f"; save {statistics.median(saves):.2f} s x {len(saves)}"
    return cell


def breakdown(results: dict[str, Any], entries: dict[str, Any]) -> str:
    """Where lightning-elastic's kill -> first step goes (medians over the kills, seconds after the SIGKILL)."""
    rows = []
    for key, entry in entries.items():
        record = results.get(key)
        if entry["kind"] != "le" or not record or not record.get("ok"):
            continue
        f = [x for x in record["value"]["failures"] if x.get("first_step_s") is not None]  # the job went on
        rows.append([entry["label"], *(_fmt(_median(_of(f, *path))) for path in (
            ("noticed_s",), ("formed_s",), ("shrink", "started_s"), ("shrink", "rebuild_s"),
            ("shrink", "transfer_s"), ("shrink", "ended_s"), ("resumed_s",), ("first_step_own_s",),
            ("first_step_s",), ("grow", "ended_s"), ("grow", "received_mb"), ("grow", "whole_s"),
            ("join_pause_s",)))])
    if not rows:
        return ""
    return ("Where the time goes after a kill (lightning-elastic; medians over the kills, seconds after the "
            "SIGKILL unless a duration):\n\n" + md_table(
                ["arm", "driver saw it", "next round formed", "restore began (group re-formed, holdings "
                 "gathered)", "rebuild (meta, shard, to_empty, optimizer state)", "transfer", "restore done",
                 "first step began", "that step's own time", "first step done", "joiner's restore done",
                 "MB to the joiner", "joiner's whole restore", "training paused to take the joiner in"], rows))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def goals(results: dict[str, Any], entries: dict[str, Any], pace: float | None, best: str | None) -> str:
    lines = ["Against issue 35's goals:"]
    for key, entry in entries.items():
        record = results.get(key)
        if entry["kind"] != "le" or not record or not record.get("ok"):
            continue
        v = record["value"]
        f = v["failures"]
        resumed, transfer = _median(_of(f, "resumed_s")), _median(_of(f, "shrink", "transfer_s"))
        done, step = _median(_of(f, "first_step_s")), v.get("steady_step_s")
        if resumed is not None and transfer is not None:
            lines.append(f"- {entry['label']}: kill -> training resumed at the smaller world {resumed:.2f} s "
                         f"(median) against 1 s + the transfer's {transfer:.2f} s = {1 + transfer:.2f} s: "
                         + ("met" if resumed <= 1 + transfer else f"missed by {resumed - 1 - transfer:.2f} s")
                         + (f"; kill -> that step done {done:.2f} s, of which the step itself "
                            f"{_median(_of(f, 'first_step_own_s')):.2f} s (a steady step at 4: {step:.2f} s)"
                            if done is not None and step else ""))
        if pace:
            ratio = v["goodput"] / pace
            lines.append(f"- {entry['label']}: goodput {ratio:.3f} of failure-free (goal >= 0.9): "
                         + ("met" if ratio >= 0.9 else f"missed by {0.9 - ratio:.3f}"))
        if v.get("job_lost"):
            lines.append(f"- {entry['label']}: the job ended after kill {v['job_lost']['after_kill']}: "
                         f"{v['job_lost']['reason']}")
    if best and pace:
        lines.append(f"- torchrun's best setting here: {entries[best]['label']}, goodput "
                     f"{results[best]['value']['goodput'] / pace:.3f} of failure-free")
    return "\n".join(lines)


# ----- main -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=30.0, help="seconds between SIGKILLs (default 30)")
    parser.add_argument("--duration", type=float, default=180.0,
                        help="seconds of training per lightning-elastic arm, from its first step at full size (180)")
    parser.add_argument("--torchrun-duration", type=float, default=120.0, help="per torchrun arm (default 120)")
    parser.add_argument("--reference-duration", type=float, default=60.0, help="the failure-free run (default 60)")
    parser.add_argument("--commit-every", type=int, default=2, help="lightning-elastic: steps between commits (2)")
    parser.add_argument("--checkpoint-every", default="2,4,8", metavar="N[,N...]",
                        help="torchrun: steps between DCP checkpoints, one run per value (default 2,4,8)")
    parser.add_argument("--preload-modules", default=PRELOAD,
                        help=f"the le+preload arm's --preload (default {PRELOAD}); empty: no such arm")
    parser.add_argument("--arms", help="a subset of the arms to run, comma-separated (reference, le, le+preload, "
                                       "torchrun/ckpt-N)")
    parser.add_argument("--workload-args", default="", help="extra arguments for workloads/sharded_train.py "
                                                              "in every arm (the model: --width, --blocks, ...)")
    parser.add_argument("--jitter", type=float, default=4.0,
                        help="each kill at its multiple of --every plus a seeded uniform offset of up to this many "
                             "seconds either way, the same offsets in every arm (default 4: about a commit cycle "
                             "here, so kills do not lock to one point of it)")
    parser.add_argument("--seed", type=int, default=35, help="seed of the kills' offsets (default 35)")
    parser.add_argument("--bound", type=float, default=180.0, help="seconds to wait for a step after a kill")
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    parser.add_argument("--workdir", type=Path, required=True, help="every arm's logs go here")
    args = parser.parse_args(argv)
    try:
        every = tuple(int(n) for n in args.checkpoint_every.split(",") if n)
    except ValueError:
        parser.error(f"--checkpoint-every: expected step counts separated by commas, got {args.checkpoint_every!r}")
    settings = Settings(every=args.every, duration=args.duration, torchrun_duration=args.torchrun_duration,
                        reference_duration=args.reference_duration, commit_every=args.commit_every,
                        checkpoint_every=every, preload=args.preload_modules or None, bound=args.bound,
                        start_timeout=300.0, workload_args=tuple(args.workload_args.split()), jitter=args.jitter,
                        seed=args.seed)
    entries = arms(settings)
    if args.arms:
        wanted = [a for a in args.arms.split(",") if a]
        if bad := [a for a in wanted if a not in entries]:
            parser.error(f"--arms: unknown arm(s) {', '.join(bad)}; choose from {', '.join(entries)}")
        entries = {k: v for k, v in entries.items() if k in wanted}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    document: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:], "environment": harness.environment(),
        "settings": dataclasses.asdict(settings), "workers": WORKERS, "batch": BATCH,
        "model": "24 x Linear(2048, 2048) + head, 100.7M parameters, AdamW, fp32" if not args.workload_args
        else f"workloads/sharded_train.py {args.workload_args}",
        "arms": entries, "results": {}}
    began = time.monotonic()
    try:
        for key, entry in entries.items():
            if entry.get("preload") and (reason := preload_supported()):
                document["results"][key] = {"ok": False, "skipped": reason}
                progress(f"[sharded] {key}: skipped ({reason})")
                continue
            progress(f"[sharded] {key}: {entry['label']}, {entry['duration']:g} s")
            record = harness.trial(lambda: measure(entry, args.workdir / key.replace("/", "-"), settings))
            document["results"][key] = record
            if record["ok"]:
                v = record["value"]
                progress(f"[sharded] {key}: {v['goodput']:.1f} samples/s, {v['kills']} kills")
            else:
                progress(f"[sharded] {key}: FAILED: {record['error'].splitlines()[0]}")
            _write(args.out, document, began)
        print("\n" + report(document), flush=True)
    except Skipped as reason:
        print(f"skipped: {reason}", file=sys.stderr)
    finally:
        harness.stop_all()
        _write(args.out, document, began)
    print(f"\nresults: {args.out}")
    return 0


def _write(out: Path, document: dict[str, Any], began: float) -> None:
    document["duration_s"] = round(time.monotonic() - began, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
