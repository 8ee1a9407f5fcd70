"""Worker loss under Ray: fault -> first step of the survivors at world size 2, next to a local SIGKILL.

    .venv/bin/python benchmarks/ray_node_loss.py --repeats 5 --out benchmarks/results/2026-11-24-ray-node-loss.json

Three workers train examples/elastic_loop.py (``--step-delay 0.05 --samples 4096
--batch-size 8 --commit-every 10 --epochs 50``: far more steps than a trial lasts) under
``lightning-elastic launch -np 3 --min-np 1``. Once some worker has logged step 15, the
worker of rank 1 is lost in one of three ways:

- ray/node-removed: ``--ray ADDRESS`` on a ``ray.cluster_utils.Cluster`` (a head without CPUs,
  three 1-CPU worker nodes, each a raylet on this machine); ``cluster.remove_node`` of the
  node that hosts rank 1;
- local/sigkill: ``-H 127.0.0.1:1,127.0.0.2:1,127.0.0.3:1``; SIGKILL of rank 1's process
  (the worker on 127.0.0.2);
- ray/actor-killed: as ray/node-removed, but ``ray.kill`` of rank 1's worker actor (the
  node stays).

The victim is rank 1 in every variant, so that the three lose the same role. Under Ray,
rank 1 is not always on the second node added (the driver orders the nodes its own way):
each Ray trial records which node it was (``victim_node_index``, 0-based in order added).

Reported: wall-clock time from just before the fault call to the first step completed by a
survivor at world size 2 (step events' ``time``; one machine, one clock). Trials are
interleaved (trial 1 of each variant, then trial 2, ...). One Ray cluster serves the whole
run: every Ray trial starts on three freshly added worker nodes, removed again when it
ends, so no trial inherits a blacklisted or half-dead node. Each launch is stopped (SIGTERM,
then SIGKILL) as soon as its measurement is taken. Prints a Markdown table; every trial goes
to ``--out`` (JSON, with git commit, load average, torch and Ray versions).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
from harness import Job, Summary, TrialError, interleave, md_table, values, wait_until  # noqa: E402

EXAMPLE = harness.ROOT / "examples" / "elastic_loop.py"
EXAMPLE_ARGS = ["--step-delay", "0.05", "--samples", "4096", "--batch-size", "8", "--commit-every", "10",
                "--epochs", "50"]
WORKERS = 3
FAULT_AFTER_STEP = 15
LOCAL_HOSTS = [f"127.0.0.{i + 1}" for i in range(WORKERS)]
MB = 2**20
SMALL_NODE = {"include_dashboard": False, "object_store_memory": 80 * MB}  # as tests/integration/test_ray.py
ACTOR_PREFIX = "lightning-elastic:"
SECTION = "ray-node-loss"  # trial logs go to <workdir>/<SECTION>/<variant>/<trial>
VARIANTS = {
    "ray/node-removed": "Ray node removed (`cluster.remove_node`)",
    "local/sigkill": "local SIGKILL (`-H 127.0.0.1:1,127.0.0.2:1,127.0.0.3:1`)",
    "ray/actor-killed": "Ray actor killed (`ray.kill`)",
}


# ----- the example's events -------------------------------------------------------------------

class EventLog:
    """The JSON lines every worker appends to ``DIR/*.jsonl``, read incrementally.

    Only complete lines are taken: a worker may be writing the last one right now.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    continue
            self._offsets[path] = offset + end
        return self.events

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.poll() if e["kind"] == "step"]


def host_of_worker(worker_id: str) -> str:
    """``ray-0123456789ab[0]#1`` -> ``ray-0123456789ab``."""
    return worker_id.split("[")[0]


# ----- the Ray cluster ------------------------------------------------------------------------

def host_of_node(node: Any) -> str:
    """The host name the driver gives a Ray node (launcher/ray/nodes.py)."""
    return f"ray-{node.node_id[:12]}"


class RayNodes:
    """One ``ray.cluster_utils.Cluster`` for the run: a CPU-less head (no worker lands on it)
    and the worker nodes of the current trial. This process stays connected to it, to find
    and kill actors."""

    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **SMALL_NODE})
        self.workers: list[Any] = []
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level="WARNING")

    @property
    def address(self) -> str:
        return self.cluster.address

    def fresh(self, count: int) -> None:
        """Exactly ``count`` newly added 1-CPU worker nodes, every earlier one removed."""
        self.remove_all()
        for _ in range(count):
            self.workers.append(self.cluster.add_node(num_cpus=1, **SMALL_NODE))
        self.cluster.wait_for_nodes(timeout=60)

    def node_of(self, host: str) -> Any:
        return next(node for node in self.workers if host_of_node(node) == host)

    def remove(self, node: Any) -> None:
        # Bounded: Ray waits at most a few seconds for each of the node's processes.
        self.workers.remove(node)
        self.cluster.remove_node(node)

    def remove_all(self) -> None:
        for node in list(self.workers):
            self.remove(node)

    def close(self) -> None:
        try:
            self.remove_all()
        finally:
            ray.shutdown()
            self.cluster.shutdown()


def named_actors(suffix: str = "") -> list[dict[str, str]]:
    """The project's worker actors alive in the cluster (``lightning-elastic:<job>:<worker>``)."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(ACTOR_PREFIX) and a["name"].endswith(suffix)]


# ----- one trial --------------------------------------------------------------------------------

def example_command(events_dir: Path) -> list[str]:
    return [harness.PYTHON, str(EXAMPLE), "--events", str(events_dir), *EXAMPLE_ARGS]


def launch_command(source: list[str], events_dir: Path) -> list[str]:
    # -x: the workers Ray starts get the job's tag too (they are not the launch's children,
    # and a Ray actor has the raylet's environment), so Job.stop finds any straggler.
    return [*harness.launcher_command(), "launch", *source, "-np", str(WORKERS), "--min-np", "1",
            "-x", harness.TAG_VARIABLE, *example_command(events_dir)]


def fault_and_time(job: Job, log: EventLog, fault: Callable[[dict[str, Any]], Callable[[], None]],
                   start_timeout: float, bound: float) -> dict[str, Any]:
    """Wait for step ``FAULT_AFTER_STEP``, fault rank 1, time the survivors' first step at size 2.

    ``fault(victim)`` gets rank 1's latest step event and returns the call that faults it:
    whatever has to be looked up happens before the clock starts.
    """
    def reached() -> bool:
        return any(e["step"] >= FAULT_AFTER_STEP for e in log.steps())

    if not wait_until(reached, start_timeout, job, interval=0.05):
        raise TrialError(f"no step {FAULT_AFTER_STEP} within {start_timeout:.0f} s (exit status {job.poll()}); "
                         f"last output:\n{job.tail()}")
    steps = log.steps()
    sizes = sorted({e["size"] for e in steps})
    if sizes != [WORKERS]:
        raise TrialError(f"world sizes {sizes} before the fault, not [{WORKERS}]; last output:\n{job.tail()}")
    victim = next(e for e in reversed(steps) if e["rank"] == 1)
    strike = fault(victim)
    at = time.time()
    strike()
    fault_call_s = time.time() - at

    def first_after() -> dict[str, Any] | None:
        return next((e for e in log.steps() if e["size"] == WORKERS - 1 and e["time"] > at
                     and e["worker"] != victim["worker"]), None)

    step = wait_until(first_after, bound, job, interval=0.05)
    if step is None:
        ended = job.poll()
        why = f"the job ended (status {ended})" if ended is not None else f"none within {bound:.0f} s"
        raise TrialError(f"no step at world size {WORKERS - 1}: {why} after the fault; last output:\n{job.tail()}")
    return {"seconds": round(step["time"] - at, 4), "fault_call_s": round(fault_call_s, 4),
            "victim_worker": victim["worker"], "victim_pid": victim["pid"], "fault_at_step": victim["step"],
            "first_step": step["step"], "first_step_worker": step["worker"]}


def local_sigkill(start_timeout: float, bound: float) -> Callable[[int, Path], dict[str, Any]]:
    def measure(index: int, directory: Path) -> dict[str, Any]:
        events_dir = directory / "events"
        hosts = ",".join(f"{h}:1" for h in LOCAL_HOSTS)

        def fault(victim: dict[str, Any]) -> Callable[[], None]:
            return lambda: os.kill(victim["pid"], signal.SIGKILL)

        with Job(launch_command(["-H", hosts], events_dir), directory) as job:
            result = fault_and_time(job, EventLog(events_dir), fault, start_timeout, bound)
        result["victim_host"] = host_of_worker(result["victim_worker"])
        return result
    return measure


def on_ray(nodes: RayNodes, how: str, start_timeout: float, bound: float) -> Callable[[int, Path], dict[str, Any]]:
    """A Ray trial; ``how``: ``node-removed`` or ``actor-killed``."""
    def measure(index: int, directory: Path) -> dict[str, Any]:
        events_dir = directory / "events"
        nodes.fresh(WORKERS)
        order = [host_of_node(node) for node in nodes.workers]  # as added

        def fault(victim: dict[str, Any]) -> Callable[[], None]:
            if how == "node-removed":
                node = nodes.node_of(host_of_worker(victim["worker"]))
                return lambda: nodes.remove(node)
            named = wait_until(lambda: named_actors(f":{victim['worker']}"), 30, interval=0.1)
            if not named:
                raise TrialError(f"no named actor of worker {victim['worker']} within 30 s")
            actor = ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])
            return lambda: ray.kill(actor)

        try:
            with Job(launch_command(["--ray", nodes.address], events_dir), directory) as job:
                result = fault_and_time(job, EventLog(events_dir), fault, start_timeout, bound)
        finally:
            nodes.remove_all()  # the next Ray trial starts on fresh nodes
        result["victim_host"] = host_of_worker(result["victim_worker"])
        result["victim_node_index"] = order.index(result["victim_host"])  # 1: the second node added
        # The launch is gone and so are its nodes: its actors must be too.
        wait_until(lambda: not named_actors(), 30, interval=0.2)
        result["actors_left"] = [a["name"] for a in named_actors()]
        return result
    return measure


# ----- the run ----------------------------------------------------------------------------------

def report(results: dict[str, list[dict[str, Any]]]) -> str:
    rows, notes = [], []
    for key, records in results.items():
        got = values(records, lambda v: v["seconds"])
        rows.append([VARIANTS[key], Summary.of(got).show(unit=" s"), f"{sum(s is not None for s in got)}/{len(got)}",
                     ", ".join("failed" if s is None else f"{s:.2f}" for s in got)])
        notes += [f"- {key}: {r['error'].splitlines()[0]}" for r in records if not r["ok"]]
    return (f"{WORKERS} workers, rank 1 lost once step {FAULT_AFTER_STEP} is logged -> first step of a survivor "
            f"at world size {WORKERS - 1}:\n\n"
            + md_table(["variant", "median (range)", "recovered", "every trial (s)"], rows)
            + ("\n\nFailed trials:\n" + "\n".join(notes) if notes else ""))


def leftover_processes(marker: str) -> list[str]:
    """Processes still running a command that mentions ``marker`` (every job's command names its
    events directory), and children of this process (Ray's own, after the cluster's shutdown)."""
    me = psutil.Process()
    found = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in me.children(recursive=True) if p.is_running()]
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != me.pid and marker in " ".join(proc.info["cmdline"] or ()):
                found.append(f"{proc.pid} {' '.join(proc.info['cmdline'])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(set(found))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="trials of each variant")
    parser.add_argument("--out", type=Path, help="JSON file for every trial (default: not written)")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help=f"seconds a job may take to log step {FAULT_AFTER_STEP}")
    parser.add_argument("--bound", type=float, default=120.0,
                        help=f"seconds after the fault within which a step at world size {WORKERS - 1} counts")
    parser.add_argument("--workdir", type=Path, help="keep every trial's logs here (default: a temporary directory)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    # A SIGTERM ends the run like Ctrl-C: the current job stopped (atexit), the cluster shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lightning-elastic-ray-node-loss-"))
    environment = {**harness.environment(), "ray": ray.__version__}
    document: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "config": {"workers": WORKERS, "fault_after_step": FAULT_AFTER_STEP, "example_args": EXAMPLE_ARGS,
                   "repeats": args.repeats, "start_timeout_s": args.start_timeout, "bound_s": args.bound},
        "environment": environment,
    }
    started = time.monotonic()
    harness.progress(f"trial logs: {workdir}")
    nodes = RayNodes()
    try:
        plan = {
            "ray/node-removed": (args.repeats, on_ray(nodes, "node-removed", args.start_timeout, args.bound)),
            "local/sigkill": (args.repeats, local_sigkill(args.start_timeout, args.bound)),
            "ray/actor-killed": (args.repeats, on_ray(nodes, "actor-killed", args.start_timeout, args.bound)),
        }
        results, _ = interleave(SECTION, plan, workdir, lambda v: f"{v['seconds']:.2f} s")
    finally:
        harness.stop_all()
        nodes.close()
    document["leftover_processes"] = leftover_processes(str(workdir / SECTION))
    if document["leftover_processes"]:
        harness.progress(f"warning: processes left behind: {document['leftover_processes']}")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    environment["loadavg_end"] = os.getloadavg()
    document["duration_s"] = round(time.monotonic() - started, 1)
    document["results"] = {key: {"label": VARIANTS[key], "trials": records} for key, records in results.items()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\n{report(results)}\n")
    load = ", ".join(f"{x:.2f}" for x in environment["loadavg_start"])
    print(f"commit {(environment['git_commit'] or '?')[:10]}, torch {environment['torch']}, ray {ray.__version__}, "
          f"load average at start {load}, {document['duration_s']:.0f} s")
    if args.out:
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
