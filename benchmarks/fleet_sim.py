"""The driver at fleet scale: the real driver against N simulated workers (no torch).

    .venv/bin/python benchmarks/fleet_sim.py --workers 64,256,1024 --out benchmarks/results/<date>-fleet.json
    .venv/bin/python benchmarks/fleet_sim.py --workers 2048 --heartbeat-intervals 1,default   # side by side

For each N: the real ``Driver`` runs in its own process pinned to CPU 0
(``benchmarks/fleet/driver_process.py``, its launcher replaced by the simulator's), and N
simulated workers speaking the real signed protocol run in this process, pinned to CPU 1
(``benchmarks/fleet/simulated_workers.py``), 8 slots per host. Measured:

- first round: from the last worker's first rendezvous request to the moment every worker
  holds its round-1 assignment (workers all start at once);
- steady heartbeats (``--steady`` s after round 1): the driver's CPU (share of one core),
  its threads and memory, and each heartbeat's overhead past its one-interval long poll;
- with ``--adoption``, a driver restart (after the steady phase): the driver SIGKILLed, the
  workers going on without it for ``--outage`` s, the same driver command started again
  with the same ``--state-dir``: from that process's start to its imports done, and from
  its ``Driver``'s start to every adopted worker's first request (the driver's own
  ``workers_adopted`` measure); the re-formation below is then the adopted driver's;
- re-formation: one worker "SIGKILLed" (its connections close, the driver is told it
  exited with -9) -> every survivor holds its round-2 assignment (its host's 7 other
  workers are stopped by the driver, as a blacklisted host's are);
- the end: every survivor reports DONE and exits at once -> every report answered, and
  the driver's exit (verdict and summary written);
- dropped connections: connection errors the workers saw, and the kernel's listen-queue
  overflows (``TcpExtListenOverflows``) during the run; false "wedged" verdicts: workers
  the driver killed that the simulator did not.

A phase that does not finish within ``--bound`` seconds is reported as not reached, with
the driver's last log lines. Prints a Markdown table; every figure goes to ``--out``.

Several drivers side by side, in one run (``--checkouts``)::

    .venv/bin/python benchmarks/fleet_sim.py --workers 1024,4096 --repeats 2 --bound 120 --steady 10 \
        --somaxconn 16384 --store-patterns "" --checkouts before=/work/wt-bench-before,after=. --out ...

For each N, each repeat runs the driver of every checkout once, in the order given
(before, after, before, after, ... with ``--repeats 2``), every other setting equal. Only
the driver process comes from a checkout: its own ``benchmarks/fleet/driver_process.py``
(this tree's if it has none), started through ``benchmarks/fleet/checkout_bootstrap.py``,
which puts a finder first on ``sys.meta_path`` so that ``lightning_elastic`` and
``benchmarks``, and ``lightning_elastic.launcher`` as the checkout's pyproject.toml maps it
(its ``launcher/`` folder), are imported from that checkout and from nowhere else (a
``PYTHONPATH`` would not map ``launcher/``, and the venv's editable install would answer
for this tree). The simulated workers, the interpreter and the venv's other packages are
this tree's. The interface is the driver process's: the arguments above, the log lines
``driver process ready at T`` and ``Every adopted worker reached this driver T s after its
start`` on stderr, the job's result as the last JSON line on stdout; a checkout whose
driver's API changed adapts its own ``driver_process.py``. The tables get a ``checkout``
column, and a last table gives each N and checkout's medians (min-max) over its runs
(also printed with ``--repeats`` alone); ``--out`` records each checkout's path and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet.gc_pauses import GcPauses  # noqa: E402
from benchmarks.fleet.simulated_workers import Simulator  # noqa: E402

DRIVER_PROCESS = Path("benchmarks") / "fleet" / "driver_process.py"
DRIVER = ROOT / DRIVER_PROCESS
BOOTSTRAP = ROOT / "benchmarks" / "fleet" / "checkout_bootstrap.py"
SLOTS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Checkout:
    """A tree whose driver is measured (``--checkouts NAME=PATH``): its own
    ``benchmarks/fleet/driver_process.py`` (this tree's if it has none), run through
    ``fleet/checkout_bootstrap.py`` so that ``lightning_elastic`` and its ``launcher/`` come
    from PATH."""

    name: str
    path: Path
    script: Path
    commit: str
    dirty: bool

    @classmethod
    def parse(cls, text: str) -> Checkout:
        name, sep, path = text.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH (NAME of letters, digits, _ . -)")
        root = Path(path).expanduser().resolve()
        if not (root / "lightning_elastic" / "__init__.py").is_file() or not (root / "launcher").is_dir():
            raise argparse.ArgumentTypeError(f"{root}: not a checkout of lightning-elastic (no lightning_elastic/, launcher/)")
        own = root / DRIVER_PROCESS
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=root).stdout.strip()
        return cls(name, root, own if own.is_file() else DRIVER, git("rev-parse", "HEAD"),
                   bool(git("status", "--porcelain")))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "git_commit": self.commit, "git_dirty": self.dirty,
                "driver_script": str(self.script), "own_driver_script": (self.path / DRIVER_PROCESS).is_file()}


def parse_checkouts(text: str) -> list[Checkout]:
    checkouts = [Checkout.parse(item) for item in text.split(",") if item]
    names = [c.name for c in checkouts]
    if not checkouts or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: one or more NAME=PATH, each NAME once")
    return checkouts


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:]))
            return int(fields.get("ListenOverflows", 0))
    return 0


async def wait_until(predicate: Any, bound: float, driver: asyncio.subprocess.Process) -> bool:
    """Poll ``predicate`` every 10 ms until it holds (True), the bound passes or the driver exits."""
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline or driver.returncode is not None or not psutil.pid_exists(driver.pid):
            return False
        await asyncio.sleep(0.01)
    return True


async def loop_lag(lags: list[float], period: float = 0.01) -> None:
    """Record how late this event loop wakes a task that sleeps ``period``."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(period)
        lags.append(time.monotonic() - asked - period)


def busy_seconds(times: Any) -> float:
    return times.user + times.system


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def store_phase(sim: Simulator, proc: psutil.Process, pattern: str, n: int, bound: float) -> dict[str, Any]:
    """Every member of round 1 forms a process group's bootstrap through the store at once:
    time until the last has what it needs, requests sent, and the driver's CPU meanwhile."""
    ranks = {w: a.rank for w, a in sim.assigned[1].items()}
    cpu_before, started = busy_seconds(proc.cpu_times()), time.monotonic()
    tasks = [sim.workers[w].store_bootstrap(pattern, rank, n, f"bootstrap/{pattern}") for w, rank in ranks.items()]
    try:
        sent = await asyncio.wait_for(asyncio.gather(*tasks), bound)
    except asyncio.TimeoutError:
        return {"seconds": None, "bound": bound}
    took = time.monotonic() - started
    return {"seconds": took, "requests": sum(sent), "driver_cpu": (busy_seconds(proc.cpu_times()) - cpu_before) / took}


async def run_one(n: int, steady: float, bound: float, workdir: Path, interval: float | None,
                  store_patterns: tuple[str, ...] = (), gloo_max: int = 0,
                  simulator_gc: str = "frozen", outage: float | None = None,
                  keep_state: bool = False, checkout: Checkout | None = None, tag: str | None = None,
                  socket_dir: Path | None = None) -> dict[str, Any]:
    """One run at N workers. ``checkout``: whose driver process runs (None: this tree's
    ``driver_process.py``, directly); ``tag`` names the run's files in ``workdir``
    (``driver-TAG.log``, ``state-TAG``; default N)."""
    sim = Simulator()
    own_gc = GcPauses()
    tag = tag or str(n)
    control = (socket_dir or workdir) / f"control-{tag}.sock"
    server = await sim.serve(str(control))
    log_path = workdir / f"driver-{tag}.log"
    overflows_before = listen_overflows()
    state_dir = None if outage is None and not keep_state else workdir / f"state-{tag}"
    log_path.write_bytes(b"")
    # Only the driver process differs between checkouts: the same arguments, the same CPU.
    program = [str(DRIVER)] if checkout is None else [str(BOOTSTRAP), str(checkout.path), str(checkout.script)]

    async def spawn_driver() -> asyncio.subprocess.Process:
        with open(log_path, "ab") as log:  # a restarted driver logs after its predecessor
            return await asyncio.create_subprocess_exec(
                sys.executable, *program, "--workers", str(n), "--slots-per-host", str(SLOTS_PER_HOST),
                "--control", str(control), *(["--heartbeat-interval", str(interval)] if interval else []),
                *(["--state-dir", str(state_dir)] if state_dir else []),
                stdout=asyncio.subprocess.PIPE, stderr=log,
                preexec_fn=lambda: os.sched_setaffinity(0, {0}),
            )

    driver = await spawn_driver()
    proc = psutil.Process(driver.pid)
    result: dict[str, Any] = {"workers": n, "heartbeat_interval": interval}
    if checkout is not None:
        result["checkout"] = checkout.name
    try:
        # First round: every worker assigned round 1.
        formed = await wait_until(lambda: len(sim.assigned.get(1, {})) == n, bound, driver)
        if formed:
            result["first_round_s"] = max(a.at for a in sim.assigned[1].values()) - max(sim.first_asks.values())
        else:
            result["first_round_s"] = None
            result["first_round_assigned"] = len(sim.assigned.get(1, {}))
            return result
        if simulator_gc == "frozen":
            freeze_simulator_heap()
        # Process-group bootstrap through the driver's store, every worker at once.
        for pattern in store_patterns:
            if pattern == "gloo" and n > gloo_max:
                continue
            result[f"store_{pattern}"] = await store_phase(sim, proc, pattern, n, bound)
        # Steady heartbeats.
        sim.stats.heartbeat_overheads.clear()
        lags: list[float] = []
        lag_probe = asyncio.create_task(loop_lag(lags))
        cpu_before, wall_before = proc.cpu_times(), time.monotonic()
        threads, rss = [], []
        while time.monotonic() - wall_before < steady:
            threads.append(proc.num_threads())
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(0.5)
        cpu_after, wall_after = proc.cpu_times(), time.monotonic()
        busy = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
        result["steady_driver_cpu"] = busy / (wall_after - wall_before)
        result["driver_threads"] = max(threads)
        result["driver_rss_mb"] = max(rss) / 1e6
        lag_probe.cancel()
        # The simulator's own event-loop lag: a heartbeat's overhead includes it, and a
        # busy simulator is no fault of the driver's.
        result["simulator_lag_ms_p99"] = None if not lags else 1000 * percentile(lags, 0.99)
        # Heartbeats sent during the steady phase only: one sent while round 1 formed waits
        # for the formation, which is not the steady service's latency.
        overheads = [o for sent, o in sim.stats.heartbeat_overheads if sent >= wall_before]
        result["heartbeat_overhead_ms_p50"] = None if not overheads else 1000 * statistics.median(overheads)
        result["heartbeat_overhead_ms_p99"] = None if not overheads else 1000 * percentile(overheads, 0.99)
        result["heartbeats_in_steady"] = len(overheads)
        if outage is not None:
            assert state_dir is not None
            driver = await restart_driver(sim, driver, spawn_driver, state_dir, log_path, n, outage, bound, result)
            proc = psutil.Process(driver.pid)
            if result.get("adoption_s") is None:
                return result
            if simulator_gc == "frozen":
                # The fleet's new connections to the new driver are its long-lived heap now,
                # as the first round's were (4,096 processes would not walk each other's).
                gc.collect()
                freeze_simulator_heap()
        # A loss: one worker of the last host (its slot alone is blacklisted: its siblings
        # train on, so the new round has every other worker).
        last_host = f"sim-{(n + SLOTS_PER_HOST - 1) // SLOTS_PER_HOST - 1:04d}"
        victim = next(w for w in sim.workers if w.startswith(f"{last_host}["))
        survivors = n - 1
        driver_cpu, own_cpu = busy_seconds(proc.cpu_times()), busy_seconds(os.times())
        killed_at = time.monotonic()
        sim.kill(victim)
        reformed = await wait_until(lambda: len(sim.assigned.get(2, {})) == survivors, bound, driver)
        result["reform_s"] = max(a.at for a in sim.assigned[2].values()) - killed_at if reformed else None
        # Who was busy meanwhile: a simulator near 100 % bounds the figure, not the driver.
        took = time.monotonic() - killed_at
        result["reform_driver_cpu"] = (busy_seconds(proc.cpu_times()) - driver_cpu) / took
        result["reform_simulator_cpu"] = (busy_seconds(os.times()) - own_cpu) / took
        if not reformed:
            result["reform_assigned"] = len(sim.assigned.get(2, {}))
            return result
        # Connection errors up to here: the end tears the service down under requests still
        # in flight, which is no fault of the service's.
        result["connection_errors_before_end"] = sim.stats.connection_errors
        # The end: every survivor reports that training returned, and exits (all at once).
        async def finish(worker: Any) -> None:
            try:
                await worker.report_done()
            finally:
                worker.exit(0)

        finish_started = time.monotonic()
        ends = await asyncio.gather(*(finish(w) for w in sim.live()), return_exceptions=True)
        # Every DONE report answered (each worker exits as soon as its own is).
        result["done_reports_s"] = time.monotonic() - finish_started
        result["end_errors"] = sorted({f"{type(e).__name__}: {e}" for e in ends if isinstance(e, BaseException)})[:3]
        # Read while waiting: the result line (with the GC pauses) can exceed a pipe's buffer.
        stdout, _ = await asyncio.wait_for(driver.communicate(), bound)
        # The first DONE sent -> the driver's exit, its verdict and summary written.
        result["finish_s"] = time.monotonic() - finish_started
        out = stdout.decode().strip().splitlines()
        job = json.loads(out[-1]) if out else {}
        result["job"] = {"success": job.get("success"), "reason": job.get("reason"), "rounds": job.get("rounds")}
        result.update(gc_summary(job.get("gc_pauses", []), killed_at, killed_at + result["reform_s"]))
        result.update(gc_summary(own_gc.pauses, killed_at, killed_at + result["reform_s"], who="simulator"))
        return result
    finally:
        own_gc.close()
        gc.unfreeze()
        gc.set_threshold(*GC_DEFAULTS)
        result["connection_errors"] = sim.stats.connection_errors
        result["disowned"] = sim.stats.disowned
        result["error_kinds"] = dict(sim.stats.error_kinds)
        result["connections"] = sim.stats.connections
        result["listen_overflows"] = listen_overflows() - overflows_before
        driver_log = log_path.read_text(errors="replace")
        result["false_wedged"] = len(sim.unexpected_kills) + driver_log.count("sent no heartbeat")
        result["driver_log_tail"] = driver_log.splitlines()[-5:]
        if driver.returncode is None and proc.is_running():
            proc.kill()
        try:
            await asyncio.wait_for(driver.wait(), 30)
        except asyncio.TimeoutError:
            result["driver_not_reaped"] = True
        for worker in sim.live():
            worker.exit(-9)
        server.close()


ADOPTED = re.compile(r"Every adopted worker reached this driver ([0-9.]+) s after its start")
READY = re.compile(r"driver process ready at ([0-9.]+)")


async def restart_driver(sim: Simulator, driver: asyncio.subprocess.Process, spawn: Any, state_dir: Path,
                         log_path: Path, n: int, outage: float, bound: float,
                         result: dict[str, Any]) -> asyncio.subprocess.Process:
    """SIGKILL the driver once its saved state holds the whole round, let the workers run on
    ``outage`` s, start the same command again; the new driver's figures go to ``result``."""
    state = state_dir / "state.json"

    def whole_round_saved() -> bool:
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads(state.read_text())
            saved = saved.get("job", saved)  # version 2 holds the JobState under "job" (--checkouts: 1 too)
            return bool(saved["round"]) and len(saved["round"]["members"]) == n
        return False

    deadline = time.monotonic() + bound
    while not whole_round_saved():
        if time.monotonic() > deadline:
            result["adoption_s"] = None
            return driver
        await asyncio.sleep(0.2)
    driver.kill()
    await driver.wait()
    errors, disowned = sim.stats.connection_errors, sim.stats.disowned
    await asyncio.sleep(outage)
    result["adoption_outage_s"] = outage
    result["adoption_live_after_outage"] = len(sim.live())
    offset = log_path.stat().st_size
    spawned_wall = time.time()
    driver = await spawn()
    proc = psutil.Process(driver.pid)

    def new_log() -> str:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    adopted = await wait_until(lambda: ADOPTED.search(new_log()) is not None, bound, driver)
    text = new_log()
    ready = READY.search(text)
    found = ADOPTED.search(text)
    result["adoption_process_start_s"] = float(ready.group(1)) - spawned_wall if ready else None
    result["adoption_s"] = float(found.group(1)) if adopted and found else None
    result["adoption_driver_cpu_s"] = busy_seconds(proc.cpu_times())
    result["adoption_connection_errors"] = sim.stats.connection_errors - errors  # refused while no driver ran
    result["adoption_disowned"] = sim.stats.disowned - disowned  # workers the new driver did not take back
    result["adoption_round"] = max(sim.assigned)  # no new round was formed: still 1
    return driver


def checkout_cells(results: list[dict[str, Any]]) -> tuple[str, str, Any]:
    """The ``checkout`` column's header, separator and cell, if any run names one."""
    if not any("checkout" in r for r in results):
        return "", "", lambda r: ""
    return " checkout |", " --- |", lambda r: f" {r.get('checkout', '—')} |"


def adoption_table(results: list[dict[str, Any]]) -> str:
    head, line, cell = checkout_cells(results)
    rows = [f"| workers |{head} outage | process start -> imports done | driver start -> every adopted worker's first request "
            "| new driver's CPU to then | refused connections in the outage | workers disowned | round after |",
            f"| --- |{line} --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "adoption_outage_s" in r:
            rows.append(f"| {r['workers']} |{cell(r)} {r['adoption_outage_s']:g} s | {fmt(r.get('adoption_process_start_s'))} s "
                        f"| {fmt(r.get('adoption_s'))} s | {fmt(r.get('adoption_driver_cpu_s'))} s "
                        f"| {r.get('adoption_connection_errors', '—')} | {r.get('adoption_disowned', '—')} "
                        f"| {r.get('adoption_round', '—')} |")
    return "\n".join(rows)


GC_DEFAULTS = gc.get_threshold()


def freeze_simulator_heap() -> None:
    """The simulator's own collections, as 4,096 worker processes would have them.

    Each real worker is a process of its own with a small heap; this one process holds all
    4,096 workers' state (12,288 connections with their streams, tasks and buffers), and
    CPython's default collections walk all of it: full collections of 0.1-0.3 s that stop
    every simulated worker at once, which no real fleet does. Like the driver
    (``launcher/driver/gc_policy.py``): young collections every 20,000 allocations, and the
    fleet's long-lived objects frozen once the first round has formed.
    """
    gc.set_threshold(20_000, GC_DEFAULTS[1], GC_DEFAULTS[2])
    gc.freeze()


def gc_summary(pauses: list[list[float]] | list[tuple[float, float, int]], start: float, end: float,
               who: str = "driver") -> dict[str, Any]:
    """A process's garbage collections over the job, and those within [start, end] (the
    re-formation): count, longest and total pause, full (generation 2) collections."""
    def summary(chosen: list[list[float]]) -> dict[str, Any]:
        return {"count": len(chosen), "full": sum(1 for _, _, gen in chosen if gen == 2),
                "longest_ms": 1000 * max((d for _, d, _ in chosen), default=0.0),
                "total_ms": 1000 * sum(d for _, d, _ in chosen)}
    during = [p_ for p_ in pauses if p_[0] + p_[1] >= start and p_[0] <= end]
    return {f"{who}_gc": summary(pauses), f"{who}_gc_reform": summary(during)}


def gc_cell(gc: dict[str, Any] | None, counts: bool = False) -> str:
    if not gc:
        return "—"
    head = f"{gc['count']} ({gc['full']}), " if counts else ""
    return f"{head}{gc['longest_ms']:.0f} ms, {gc['total_ms']:.0f} ms"


def fmt(value: Any, spec: str = ".2f", none: str = "not reached") -> str:
    return none if value is None else format(value, spec)


def table(results: list[dict[str, Any]]) -> str:
    head, line, cell = checkout_cells(results)
    rows = [f"| workers |{head} heartbeat interval | first round | re-formed after a loss | CPU while re-forming, driver / simulator "
            "| driver CPU, steady | heartbeat overhead p50 / p99 "
            "| driver threads | driver RSS | connection errors (before the end) | listen overflows | false wedged "
            "| GC while re-forming: pauses (full), longest, total | GC over the job: longest, total "
            "| simulator GC while re-forming | the end: DONE reports answered / driver exited |",
            f"| --- |{line} --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rows.append(
            f"| {r['workers']} |{cell(r)} {r.get('heartbeat_interval') or 'default'} | {fmt(r.get('first_round_s'))} s | {fmt(r.get('reform_s'))} s "
            f"| {fmt(100 * r.get('reform_driver_cpu', 0), '.0f')} / {fmt(100 * r.get('reform_simulator_cpu', 0), '.0f')} % "
            f"| {fmt(100 * r['steady_driver_cpu'], '.0f') + ' %' if 'steady_driver_cpu' in r else '—'} "
            f"| {fmt(r.get('heartbeat_overhead_ms_p50'), '.1f', '—')} / {fmt(r.get('heartbeat_overhead_ms_p99'), '.1f', '—')} ms "
            f"| {r.get('driver_threads', '—')} | {fmt(r.get('driver_rss_mb'), '.0f', '—')} MB "
            f"| {r.get('connection_errors_before_end', r['connection_errors'])} | {r['listen_overflows']} | {r['false_wedged']} "
            f"| {gc_cell(r.get('driver_gc_reform'), counts=True)} | {gc_cell(r.get('driver_gc'))} "
            f"| {gc_cell(r.get('simulator_gc_reform'), counts=True)} "
            f"| {fmt(r.get('done_reports_s'), '.2f', '—')} / {fmt(r.get('finish_s'), '.2f', '—')} s |"
        )
    return "\n".join(rows)


def spread(values: list[float | None], spec: str = ".2f", unit: str = " s", missing: str = "not reached") -> str:
    """Median (min-max) of the runs' values; a run without one (a phase not reached) is counted apart."""
    done = [v for v in values if v is not None]
    missed = len(values) - len(done)
    if not done:
        return missing
    text = format(statistics.median(done), spec) + unit
    if len(done) > 1:
        text += f" ({format(min(done), spec)}-{format(max(done), spec)})"
    return text + (f", {missed} {missing}" if missed else "")


def summary_table(results: list[dict[str, Any]]) -> str:
    """One row per N, checkout and heartbeat interval: medians (min-max) over its runs."""
    head, line, cell = checkout_cells(results)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["workers"], r.get("heartbeat_interval"), r.get("checkout")), []).append(r)
    adoption = any("adoption_outage_s" in r for r in results)
    rows = [f"| workers |{head} heartbeat interval | runs | first round | re-formed after a loss "
            "| DONE reports answered | driver exited | driver CPU, steady | heartbeat overhead p99 "
            f"| connection errors (before the end) | false wedged | job succeeded |{' adoption |' if adoption else ''}",
            f"| --- |{line} --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |{' --- |' if adoption else ''}"]
    for (n, interval, _), runs in groups.items():
        cpu = [100 * r["steady_driver_cpu"] if "steady_driver_cpu" in r else None for r in runs]
        rows.append(
            f"| {n} |{cell(runs[0])} {interval or 'default'} | {len(runs)} "
            f"| {spread([r.get('first_round_s') for r in runs])} | {spread([r.get('reform_s') for r in runs])} "
            f"| {spread([r.get('done_reports_s') for r in runs])} | {spread([r.get('finish_s') for r in runs])} "
            f"| {spread(cpu, '.0f', ' %')} | {spread([r.get('heartbeat_overhead_ms_p99') for r in runs], '.1f', ' ms', 'no heartbeat')} "
            f"| {sum(r.get('connection_errors_before_end', r['connection_errors']) for r in runs)} "
            f"| {sum(r['false_wedged'] for r in runs)} "
            f"| {sum(1 for r in runs if (r.get('job') or {}).get('success'))} of {len(runs)} |"
            + (f" {spread([r.get('adoption_s') for r in runs])} |" if adoption else ""))
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    os.sched_setaffinity(0, {1})  # the driver has CPU 0 to itself
    results = []
    checkouts: list[Checkout | None] = args.checkouts or [None]
    with tempfile.TemporaryDirectory(prefix="fleet-sim-") as tmp:
        workdir = args.log_dir.resolve() if args.log_dir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tags: set[str] = set()
        for n in args.workers:
            # Each repeat runs every checkout once, in the order given (before, after, before,
            # after, ...), every other setting equal: machine noise falls on them alike.
            for repeat in range(args.repeats):
                for checkout in checkouts:
                    for interval in args.heartbeat_intervals:
                        name = "" if checkout is None else f" {checkout.name} ({checkout.path})"
                        print(f"N = {n},{name} heartbeat interval {interval or 'default'}, "
                              f"run {repeat + 1} of {args.repeats} ...", file=sys.stderr, flush=True)
                        parts = [str(n), *([checkout.name] if checkout else []),
                                 *([f"hb{interval:g}"] if interval and len(args.heartbeat_intervals) > 1 else [])]
                        tag = "-".join(parts)
                        base, k = tag, 2
                        while tag in tags:  # a repeat, or N given twice in --workers
                            tag, k = f"{base}-{k}", k + 1
                        tags.add(tag)
                        result = await run_one(n, args.steady, args.bound, workdir, interval,
                                               args.store_patterns, args.gloo_max, args.simulator_gc,
                                               args.outage if args.adoption else None, args.state_dir,
                                               checkout=checkout, tag=tag, socket_dir=Path(tmp))
                        result["repeat"] = repeat + 1
                        results.append(result)
                        print(json.dumps({k: v for k, v in result.items() if k != "driver_log_tail"}),
                              file=sys.stderr)
    return results


@contextlib.contextmanager
def kernel_listen_cap(value: int | None) -> Iterator[int]:
    """``net.core.somaxconn`` raised to ``value`` for the run (as the driver's warning
    advises), restored after; None keeps the machine's. Yields the cap in force."""
    path = Path("/proc/sys/net/core/somaxconn")
    before = int(path.read_text())
    if value is None or value == before:
        yield before
        return
    path.write_text(f"{value}\n")
    try:
        yield value
    finally:
        path.write_text(f"{before}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="64,256,1024", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of steady heartbeats to measure")
    parser.add_argument("--bound", type=float, default=150.0, help="longest a phase may take")
    parser.add_argument("--heartbeat-intervals", default=[None], metavar="S,S...",
                        type=lambda s: [float(x) if x != "default" else None for x in s.split(",")],
                        help="run each N with each heartbeat interval ('default': the driver's choice)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--log-dir", type=Path,
                        help="keep the driver's logs here (driver-N.log; driver-N-CHECKOUT[-K].log with "
                             "--checkouts, -K for the K-th run of the same)")
    parser.add_argument("--store-patterns", default=("nccl", "nccl-scalable"), metavar="P,P...",
                        type=lambda s: tuple(x for x in s.split(",") if x),
                        help="process-group bootstraps to run through the store after round 1 "
                             "(nccl, nccl-scalable, gloo; '' for none)")
    parser.add_argument("--gloo-max", type=int, default=256,
                        help="run the gloo bootstrap only up to this many workers (it is quadratic)")
    parser.add_argument("--simulator-gc", choices=("frozen", "default"), default="frozen",
                        help="the simulator's own garbage collection: 'frozen' (its heap frozen after the "
                             "first round, young collections every 20,000 allocations: as 4,096 small "
                             "worker processes) or CPython's defaults (full collections over every "
                             "simulated worker at once)")
    parser.add_argument("--adoption", action="store_true",
                        help="restart the driver after the steady phase (--state-dir) and measure the adoption")
    parser.add_argument("--state-dir", action="store_true",
                        help="run the driver with --state-dir, without restarting it (what keeping the "
                             "state costs; --adoption implies it)")
    parser.add_argument("--outage", type=float, default=5.0, help="seconds without a driver (with --adoption)")
    parser.add_argument("--somaxconn", type=int,
                        help="raise the kernel's listen-queue cap (net.core.somaxconn, root) for the run")
    parser.add_argument("--checkouts", type=parse_checkouts, metavar="NAME=PATH,...",
                        help="measure the driver of each checkout side by side (e.g. before=/old/tree,after=.): "
                             "each N runs each checkout's own benchmarks/fleet/driver_process.py with its code "
                             "as lightning_elastic (the simulated workers stay this tree's); a checkout column "
                             "in the tables")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each N this many times (with --checkouts: each checkout in turn, "
                             "before/after/before/after ...); a table of medians follows")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    started = time.time()
    with kernel_listen_cap(args.somaxconn) as somaxconn:
        results = asyncio.run(main_async(args))
    for r in results:
        r["somaxconn"] = somaxconn
    print(table(results))
    if args.adoption:
        print()
        print(adoption_table(results))
    if args.checkouts or args.repeats > 1:
        print()
        print(summary_table(results))
    if args.out is not None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT).stdout)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "argv": sys.argv[1:], "git_commit": commit, "git_dirty": dirty, "python": platform.python_version(),
            "checkouts": [c.describe() for c in args.checkouts or []],
            "cpu_count": os.cpu_count(), "loadavg_end": os.getloadavg(), "results": results,
        }, indent=1))


if __name__ == "__main__":
    main()
