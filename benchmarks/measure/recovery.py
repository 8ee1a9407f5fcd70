"""Recovery: SIGKILL of a non-zero rank after 40 steps (3 workers) -> the first step completed after.

The small model (or the first of ``--models``: the 100m model is killed after step 12, past
its first commit, as its steps take about a second), per tool (trials interleaved):

- ``le/loop``: workloads/loop.py in ``@le.run`` under ``lightning-elastic launch -np 3 --min-np 1``
  (commit every 10 steps, check every step): the 2 survivors go on; the first step logged at
  world size 2 counts.
- ``le/lightning``: workloads/lightning_train.py, ``elastic_hvd``, same launch and cadence.
- ``torchrun/loop`` and ``torchrun/lightning`` (Lightning ``ddp``): ``torchrun --standalone
  --nproc-per-node 3 --max-restarts 1`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without
  it torchrun's restarted workers did not train again here), no checkpoint: every worker is
  restarted from scratch; the first step of a new process counts.
- ``torchft``: ``peers.torchft_recovery.measure(1, dir)`` per trial (its own setup: see that
  module); skipped, with the reason, when it is missing or raises ``PeerUnavailable``.

The victim is the process that last logged rank 1, killed once any rank logged step 40.
A trial without a step within ``bound`` seconds of the kill (or whose job ended first)
counts as "no recovery", with the job's last output kept in the results.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
from pathlib import Path
from typing import Any

from harness import (Job, Skipped, StepReader, Summary, TrialError, elastic_launch, failures, interleave, md_table,
                     torchrun, values, wait_until, workload)

WORKERS = 3
KILL_AFTER = {"small": 40, "100m": 12}  # by model: the 100m model's steps take ~1 s each
STEPS = 10**6  # never reached: the job is stopped once the recovery is measured
CADENCE = ("--commit-every", "10", "--check-every", "1")
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

TOOLS = {
    "le/loop": ("@le.run loop, lightning-elastic launch", "loop.py", CADENCE, True),
    "le/lightning": ("Lightning elastic_hvd, lightning-elastic launch", "lightning_train.py",
                     ("--strategy", "elastic_hvd", *CADENCE), True),
    "torchrun/loop": ("DDP loop, torchrun --max-restarts 1", "loop.py", (), False),
    "torchrun/lightning": ("Lightning ddp, torchrun --max-restarts 1", "lightning_train.py", ("--strategy", "ddp"),
                           False),
}
TORCHFT_LABEL = "torchft (benchmarks/peers/torchft_recovery.py)"


def run(trials: int, peer_trials: int, workdir: Path, bound: float, start_timeout: float = 300.0,
        model: str = "small") -> dict[str, Any]:
    plan: dict[str, tuple[int, Any]] = {}
    for key, (label, script, args, elastic) in TOOLS.items():
        plan[key] = (trials if elastic else peer_trials, _measure(script, args, elastic, bound, start_timeout, model))
    plan["torchft"] = (peer_trials, _torchft(bound))
    results, skipped = interleave("recovery", plan, workdir, lambda v: f"{v['seconds']:.2f} s")
    if "torchft" in skipped:
        print(f"torchft: skipped ({skipped['torchft']})", flush=True)
    labels = {key: label for key, (label, *_rest) in TOOLS.items()} | {"torchft": TORCHFT_LABEL}
    return {"workers": WORKERS, "model": model, "kill_after_step": KILL_AFTER[model], "bound_s": bound,
            "tools": {key: {"label": labels[key], "trials": results[key], "skipped": skipped.get(key)}
                      for key in plan}}


def _measure(script: str, args: tuple[str, ...], elastic: bool, bound: float, start_timeout: float, model: str):
    def measure(index: int, directory: Path) -> dict[str, Any]:
        inner = workload(script, "--model", model, "--steps", STEPS, "--log-dir", directory / "steps", *args)
        if elastic:
            command, env = elastic_launch(WORKERS, inner, min_np=1), None
        else:
            command, env = torchrun(WORKERS, inner, max_restarts=1), TORCHRUN_ENV
        with Job(command, directory, env) as job:
            return kill_and_time(job, StepReader(directory / "steps"), elastic, bound, start_timeout,
                                 KILL_AFTER[model])
    return measure


def kill_and_time(job: Job, reader: StepReader, elastic: bool, bound: float, start_timeout: float,
                  kill_after: int = KILL_AFTER["small"]) -> dict[str, Any]:
    def reached() -> bool:
        reader.poll()
        return any(r["step"] >= kill_after for r in reader.records)

    if not wait_until(reached, start_timeout, job):
        raise TrialError(f"the job did not reach step {kill_after} within {start_timeout:.0f} s "
                         f"(exit status {job.poll()}); last output:\n{job.tail()}")
    victim = next(r for r in reversed(reader.records) if r["rank"] == 1)
    before = {r["pid"] for r in reader.records}
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    killed_step = max(r["step"] for r in reader.records)

    def first_after() -> dict | None:
        reader.poll()
        return next((r for r in reader.records if r["t"] > killed_at and r["pid"] != victim["pid"]
                     and (r["size"] == WORKERS - 1 if elastic else r["pid"] not in before)), None)

    step = wait_until(first_after, bound, job)
    if step is None:
        ended = job.poll()
        why = f"the job ended (status {ended})" if ended is not None else f"none within {bound:.0f} s"
        raise TrialError(f"no recovery: {why} after the kill; last output:\n{job.tail()}")
    return {"seconds": step["t"] - killed_at, "victim_pid": victim["pid"], "killed_at_step": killed_step,
            "first_step": step["step"], "first_step_size": step["size"]}


def _torchft(bound: float):
    def measure(index: int, directory: Path) -> dict[str, Any]:
        try:
            from peers import PeerUnavailable, torchft_recovery
        except Exception as err:  # noqa: BLE001  (any import failure: the peer cannot run here)
            raise Skipped(f"cannot import benchmarks/peers/torchft_recovery.py: {type(err).__name__}: {err}") from None
        extra = {"bound": bound} if "bound" in inspect.signature(torchft_recovery.measure).parameters else {}
        try:
            (seconds,) = torchft_recovery.measure(1, directory, **extra)
        except PeerUnavailable as err:
            raise Skipped(str(err)) from None
        if seconds is None:
            raise TrialError(f"no recovery within {bound:.0f} s (torchft_recovery.measure returned None)")
        return {"seconds": seconds}
    return measure


def report(result: dict[str, Any]) -> str:
    rows, notes = [], []
    for key, tool in result["tools"].items():
        if not tool["trials"] and not tool["skipped"]:
            continue  # not asked for (--peer-trials 0)
        if tool["skipped"] and not tool["trials"]:
            rows.append([tool["label"], f"skipped ({tool['skipped']})", "", ""])
            continue
        got = values(tool["trials"], lambda v: v["seconds"])
        shown = ", ".join("none" if s is None else f"{s:.2f}" for s in got)
        rows.append([tool["label"], Summary.of(got).show(fmt="{:.2f}", unit=" s"),
                     f"{sum(s is not None for s in got)}/{len(got)}", shown])
        notes += [f"- {key}: {e.splitlines()[0]}" for e in failures(tool["trials"])]
    return (f"Recovery, model {result.get('model', 'small')}, {result['workers']} workers, SIGKILL of rank 1 after step {result['kill_after_step']} -> "
            f"first step completed after (bound {result['bound_s']:.0f} s):\n\n"
            + md_table(["tool", "median (range)", "recovered", "every trial (s)"], rows)
            + ("\n\nTrials without recovery:\n" + "\n".join(notes) if notes else ""))
