"""torchft's recovery time: SIGKILL one of 3 replica groups, time to the survivors' next step.

    bash benchmarks/setup-venv.sh
    benchmarks/.venv/bin/python benchmarks/peers/torchft_recovery.py [--repeats 5]

Per trial: a lighthouse (torchft's ``torchft_lighthouse`` binary, as its README starts it)
and 3 replica groups of one process each running benchmarks/peers/torchft_loop.py (the
suite's "small" model, data, batch size and optimizer, as in workloads/loop.py, under
torchft's Manager, DDP and Optimizer wrappers). Once the victim (replica 1, never
replica 0) has committed 40 steps, the last 10 of them in a quorum of all 3 (on 2 cores one
replica may import torch late and join by healing from a peer), it gets SIGKILL; the result
is the time from the kill to the first step a survivor commits in the new 2-replica quorum,
or None when none comes within ``bound`` seconds. Every process of the trial is killed (by
process group) after it.

Settings (``LIGHTHOUSE``, ``REPLICA``): the lighthouse flags of torchft's README
(``--quorum_tick_ms 100 --join_timeout_ms 10000``) with ``--min_replicas 2``, so the 2
survivors of 3 form a quorum, and ``--heartbeat_timeout_ms 1000`` instead of the default
5000, tuned for fast recovery (the managers heartbeat every 100 ms). The Manager (30 s) and
``ProcessGroupGloo`` (5 s) timeouts are torchft's train_ddp.py example's. What the
recovery time is made of: the lighthouse forms the survivors' quorum only once the victim's
heartbeats have been missing for ``heartbeat_timeout_ms`` (or ``join_timeout_ms`` passed),
so a recovery takes at least that; and a survivor whose gloo ring neighbour was the other
survivor does not see the peer's error, it waits for the gloo timeout (5 s) before it asks
for the new quorum.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import PeerUnavailable
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from peers import PeerUnavailable

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "workloads") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "workloads"))
from steplog import read_steps  # noqa: E402  (the suite's step-log reader)

LOOP = HERE / "torchft_loop.py"
REPLICAS = 3
VICTIM = 1
KILL_AFTER_STEP = 40
WARM = 10  # ...of which the last WARM in the 3-replica quorum (a late starter joins by healing)

# torchft_lighthouse flags. heartbeat_timeout_ms bounds the recovery time from below.
LIGHTHOUSE = {"min_replicas": 2, "quorum_tick_ms": 100, "join_timeout_ms": 10000, "heartbeat_timeout_ms": 1000}
# torchft_loop.py flags: Manager(min_replica_size, timeout), ProcessGroupGloo(timeout).
# --ddp patched: torchft 0.2.0's DDP comm hook crashes the survivors (see torchft_loop.py).
REPLICA = {"min_replicas": 2, "timeout": 30.0, "pg_timeout": 5.0, "ddp": "patched"}


def lighthouse_binary() -> Path:
    """torchft's lighthouse next to this interpreter; PeerUnavailable if torchft is missing."""
    try:
        import torchft  # noqa: F401
        import torchft.coordination  # noqa: F401
    except Exception as e:  # ImportError, or a torchft built for another torch
        raise PeerUnavailable(f"torchft is not importable in {sys.executable} ({type(e).__name__}: {e}); "
                              "run bash benchmarks/setup-venv.sh and use benchmarks/.venv/bin/python") from e
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    if not binary.exists():
        raise PeerUnavailable(f"torchft is installed but {binary} is missing")
    return binary


def wait_until(predicate, timeout: float, procs: list[subprocess.Popen] = ()) -> bool:
    """True once ``predicate`` holds; False if one of ``procs`` ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return bool(predicate())
        time.sleep(0.02)
    return True


def _flags(options: dict, style: str) -> list[str]:
    sep = "_" if style == "rust" else "-"
    return [arg for key, value in options.items() for arg in (f"--{key.replace('_', sep)}", str(value))]


class Trial:
    """One lighthouse and REPLICAS replica processes, each in its own process group."""

    def __init__(self, directory: Path, lighthouse: dict, replica: dict) -> None:
        self.dir = directory
        self.log_dir = directory / "steps"
        self.procs: list[subprocess.Popen] = []  # the lighthouse first
        self._lighthouse_opts, self._replica_opts = lighthouse, replica
        self._env: dict[str, str] = {}

    def _spawn(self, cmd: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        with open(self.dir / f"{name}.log", "ab") as out:  # a restarted replica appends
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)
        self.procs.append(proc)
        return proc

    def start(self, binary: Path) -> list[subprocess.Popen]:
        self.dir.mkdir(parents=True, exist_ok=True)
        lighthouse = self._spawn([str(binary), "--bind", "127.0.0.1:0", *_flags(self._lighthouse_opts, "rust")],
                                 "lighthouse")
        log = self.dir / "lighthouse.log"
        port = lambda: re.search(rb"Lighthouse listening on: \S+:(\d+)", log.read_bytes())  # noqa: E731
        if not wait_until(port, 30, [lighthouse]):
            raise RuntimeError(f"torchft lighthouse did not start; see {log}")
        address = f"http://127.0.0.1:{int(port().group(1))}"
        # What torchrun would set for each replica group: one thread per process on 2 cores.
        self._env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": address}
        return [self.start_replica(i) for i in range(REPLICAS)]

    def start_replica(self, i: int) -> subprocess.Popen:
        """Replica group ``i`` (again, after a loss: as torchrun ``--max-restarts`` restarts a group)."""
        return self._spawn([sys.executable, str(LOOP), "--replica-id", str(i), "--num-replicas", str(REPLICAS),
                            "--steps", "1000000", "--log-dir", str(self.log_dir),
                            *_flags(self._replica_opts, "python")], f"replica-{i}", self._env)

    def stop(self) -> None:
        """SIGKILL every process group of the trial; wait until none of their processes is left."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass  # reported below

        def group_gone(pgid: int) -> bool:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            os.killpg(pgid, signal.SIGKILL)  # a straggler (a child still exiting): again
            return False

        left = [p.pid for p in self.procs if not wait_until(lambda p=p: group_gone(p.pid), 30)]
        if left:
            raise RuntimeError(f"torchft trial left processes in process groups {left}")


def recovery_time(directory: Path, binary: Path, bound: float = 120.0, lighthouse: dict = LIGHTHOUSE,
                  replica: dict = REPLICA) -> float | None:
    """One trial: seconds from SIGKILL to a survivor's first step in the new quorum, or None."""
    trial = Trial(directory, lighthouse, replica)
    try:
        replicas = trial.start(binary)
        victim = replicas[VICTIM]

        def ready() -> bool:  # the victim at step 40+, its last WARM steps in the full quorum
            steps = [s for s in read_steps(trial.log_dir) if s["pid"] == victim.pid]
            return (len(steps) >= WARM and steps[-1]["step"] >= KILL_AFTER_STEP
                    and all(s["size"] == REPLICAS for s in steps[-WARM:]))

        if not wait_until(ready, 300, replicas):
            raise RuntimeError(f"torchft: replica {VICTIM} did not reach step {KILL_AFTER_STEP} with all "
                               f"{REPLICAS} replicas in the quorum; see the logs in {directory}")
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        survivors = [p for p in replicas if p is not victim]
        after = lambda: [s["t"] for s in read_steps(trial.log_dir)  # noqa: E731
                         if s["t"] > killed_at and s["pid"] != victim.pid and s["size"] == REPLICAS - 1]
        if not wait_until(after, bound, survivors):
            return None
        return min(after()) - killed_at
    finally:
        trial.stop()


def measure(repeats: int, workdir: Path, bound: float = 120.0, lighthouse: dict = LIGHTHOUSE,
            replica: dict = REPLICA) -> list[float | None]:
    """``repeats`` trials in ``workdir``: seconds from SIGKILL to the next step, None for none.

    Raises PeerUnavailable (a RuntimeError) when torchft cannot run in this interpreter.
    """
    binary = lighthouse_binary()
    workdir = Path(workdir)
    return [recovery_time(workdir / f"torchft-trial-{i}", binary, bound, lighthouse, replica)
            for i in range(repeats)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bound", type=float, default=120.0, help="seconds to wait for a step after the kill")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=LIGHTHOUSE["heartbeat_timeout_ms"])
    parser.add_argument("--join-timeout-ms", type=int, default=LIGHTHOUSE["join_timeout_ms"])
    parser.add_argument("--ddp", choices=("patched", "stock"), default=REPLICA["ddp"],
                        help="stock: torchft.DistributedDataParallel as shipped (its survivors crash)")
    parser.add_argument("--json", action="store_true", help="print the list of results as JSON")
    parser.add_argument("--workdir", type=Path, help="keep the trials' logs here (default: a temporary directory)")
    args = parser.parse_args()
    lighthouse = {**LIGHTHOUSE, "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
                  "join_timeout_ms": args.join_timeout_ms}
    replica = {**REPLICA, "ddp": args.ddp}
    try:
        if args.workdir:
            results = measure(args.repeats, args.workdir, args.bound, lighthouse, replica)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                results = measure(args.repeats, Path(tmp), args.bound, lighthouse, replica)
    except PeerUnavailable as e:
        print(json.dumps({"skipped": str(e)}) if args.json else f"torchft: skipped ({e})")
        return
    if args.json:
        print(json.dumps(results))
        return
    ok = [r for r in results if r is not None]
    median = f"{statistics.median(ok):.2f} s" if ok else "never"
    shown = ", ".join("no recovery" if r is None else f"{r:.2f} s" for r in results)
    print(f"torchft {args.ddp} DDP (lighthouse {' '.join(_flags(lighthouse, 'rust'))}): SIGKILL -> first step after, "
          f"{REPLICAS} replicas: median {median}; every trial: {shown}")


if __name__ == "__main__":
    main()
